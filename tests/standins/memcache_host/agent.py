"""One MemCache client process (an "agent"): the real ``DistributedObjectStore`` of one harness process.

MemCache's client is one per process and does not survive ``fork`` (a forked child's inherited client
hangs; a new one in the child reports success and stays the parent's). The harness forks its TP rank
processes from the test process, so no harness process opens a client itself: each gets an agent, a
fresh process started with the hardware stand-ins (:func:`memcache_host.client_env`), whose client
is that harness process's client. The harness process's KV caches are shared memory
(:func:`memcache_host.device_buffer`) that the agent maps at the same addresses, so the agent's
``batch_copy`` reads and writes the caller's caches exactly where the caller's own client would.

Protocol (``multiprocessing.connection``, one thread per connection): ``("map", path, addr, size)``,
``("call", method, args)``, ``("read", key, size)``, ``("close",)``. Every reply is
``("ok", value)`` or ``("error", text)``; ``KeyInfo`` values come back as ``(size, gva_list)``.

Run as ``python agent.py ADDRESS PARENT_PID DEVICE_ID READY_FD`` (it writes ``ready <init result>``
to READY_FD once it listens); it exits (closing its client cleanly, so
its ``/dev/shm`` share is released) when told to, or once the process that started it is gone.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import traceback

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_SHARED, _MAP_FIXED_NOREPLACE, _PROT_RW = 0x01, 0x100000, 3
G2L = 1


def _scratch(size: int, old):
    """An anonymous buffer in memfabric's device window (this process's own slice of it)."""
    size = (size + (1 << 21) - 1) >> 21 << 21
    if old is not None:
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.munmap(old[0], old[1])
    start = 0x100000000000 + ((os.getpid() % 256) << 35) + (31 << 30)  # the top GiB of the 32 GiB slice
    got = _libc.mmap(start, size, _PROT_RW, 0x22 | _MAP_FIXED_NOREPLACE, -1, 0)
    if got != start:
        raise OSError(ctypes.get_errno(), "agent: no scratch buffer in the device window")
    return got, size


class Agent:
    def __init__(self, device_id: int):
        from memcache_hybrid import DistributedObjectStore

        self.store = DistributedObjectStore()
        started = time.monotonic()
        self.init_rc = self.store.init(device_id, init_bm=True)
        self.init_s = time.monotonic() - started
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.scratch = None  # (addr, size): a device-window buffer of this process for reads
        self.maps: dict[int, int] = {}  # the harness process's buffers mapped here: start -> size

    def map(self, path: str, addr: int, size: int) -> int:
        fd = os.open(path, os.O_RDWR)
        try:
            got = _libc.mmap(addr, size, _PROT_RW, _MAP_SHARED | _MAP_FIXED_NOREPLACE, fd, 0)
        finally:
            os.close(fd)
        if got != addr:
            raise OSError(ctypes.get_errno(), f"agent: could not map {path} at {addr:#x}")
        self.maps[addr] = size
        return 0

    def unmap_all(self) -> int:
        """Forget the buffers of the harness process this agent served (it serves another next)."""
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        for addr, size in self.maps.items():
            _libc.munmap(addr, size)
        n, self.maps = len(self.maps), {}
        return n

    def call(self, name: str, args):
        value = getattr(self.store, name)(*args)
        if name == "batch_get_key_info":
            return [(info.size(), list(info.gva_list())) for info in value]
        return value

    def read(self, key: str, size: int):
        """The bytes of ``key`` (``size`` of them), read through this agent's own device-window
        scratch buffer: (result, bytes or None)."""
        with self.lock:
            if self.scratch is None or self.scratch[1] < size:
                self.scratch = _scratch(max(size, 1 << 22), self.scratch)
            addr = self.scratch[0]
            ctypes.memset(addr, 0, size)
            rc = self.store.batch_get_into([key], [addr], [size], G2L)[0]
            return rc, (ctypes.string_at(addr, size) if rc == 0 else None)

    def serve(self, conn) -> None:
        while not self.closed.is_set():
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            try:
                op = msg[0]
                if op == "close":
                    self.closed.set()
                    reply = ("ok", None)
                elif op == "map":
                    reply = ("ok", self.map(*msg[1:]))
                elif op == "unmap_all":
                    reply = ("ok", self.unmap_all())
                elif op == "read":
                    reply = ("ok", self.read(*msg[1:]))
                elif op == "hello":
                    reply = ("ok", {"pid": os.getpid(), "init_rc": self.init_rc, "init_s": self.init_s})
                else:
                    reply = ("ok", self.call(msg[1], msg[2]))
            except Exception:
                reply = ("error", traceback.format_exc())
            try:
                conn.send(reply)
            except OSError:
                return


def main(address: str, owner: int, device_id: int, ready_fd: int) -> int:
    from multiprocessing.connection import Listener

    agent = Agent(device_id)
    listener = Listener(address, family="AF_UNIX")

    def accept():
        while True:
            try:
                conn = listener.accept()
            except OSError:
                return
            threading.Thread(target=agent.serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    with os.fdopen(ready_fd, "w") as ready:
        ready.write(f"ready {agent.init_rc}\n")
    while not agent.closed.wait(0.2):
        try:
            os.kill(owner, 0)
        except OSError:  # the process that started this agent is gone
            break
    listener.close()
    if agent.init_rc == 0:
        agent.store.close()  # releases this client's /dev/shm share (a kill would leave it behind)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
