"""The byte store served to other processes: the pool harness's TP ranks as processes talk to one
:class:`byte_store.PoolService` in the test's process, as every NPU worker talks to MemCache.

:class:`PoolServer` serves the pool (one thread per client connection); :class:`RemoteService` is a
rank process's view of it (what ``byte_store.install`` takes there): its ``batch_*`` calls go to the
server, which reaches the caller's memory back over the same connection while it runs the copy
(``_RemoteHost``: read, write, bounds, and the caller's pid for the observers).
"""

from __future__ import annotations

import os
import threading

from byte_store import GATE_LIMIT_S, LocalHost, PoolService

#: a reply from the pool never takes longer than this: a gated copy waits GATE_LIMIT_S at most
REPLY_LIMIT_S = GATE_LIMIT_S + 30.0
#: a rank's first ``register_region`` on the real MemCache starts its agent: the agents start one at
#: a time, each up to three joins (``memcache_host.JOIN_TIMEOUT_S``), so a rank may wait behind the
#: others' retries; below ``rank_procs.START_LIMIT_S``, which bounds the rank's start
REGISTER_LIMIT_S = 220.0


class _RemoteHost(LocalHost):
    """A client process's memory, reached over its connection while the service runs its copy."""

    def __init__(self, conn):
        self.conn = conn
        self._pid: int | None = None

    @property
    def pid(self) -> int:
        """The client's process id (asked once)."""
        if self._pid is None:
            self._pid = self._ask("who", None)
        return self._pid

    def _ask(self, op, payload):
        self.conn.send((op, payload))
        if not self.conn.poll(REPLY_LIMIT_S):
            raise TimeoutError(f"byte store: the client did not answer {op!r} within {REPLY_LIMIT_S} s")
        return self.conn.recv()

    def outside(self, ranges):
        return self._ask("outside", ranges)

    def read(self, ranges):
        return self._ask("read", ranges)

    def write(self, items):
        self._ask("write", items)


class PoolServer:
    """Serves a :class:`PoolService` to other processes (one thread per client connection)."""

    def __init__(self, service: PoolService):
        from multiprocessing.connection import Listener

        self.service = service
        self.listener = Listener(family="AF_UNIX")
        self.address = self.listener.address
        self.closed = False
        threading.Thread(target=self._accept, name="byte-store-server", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="byte-store-client", daemon=True).start()

    def _serve(self, conn) -> None:
        svc, host = self.service, _RemoteHost(conn)
        while True:
            try:
                name, args = conn.recv()
            except (EOFError, OSError):
                return
            try:
                if name == "batch_copy" or getattr(svc, "real", False):  # the real MemCache: the caller's client
                    reply = ("ok", getattr(svc, name)(*args, host=host))
                else:
                    reply = ("ok", getattr(svc, name)(*args))
            except Exception as exc:  # the client raises it (an injected "raise" fault, ...)
                reply = ("raise", exc)
            try:
                conn.send(reply)
            except OSError:
                return

    def close(self) -> None:
        self.closed = True
        self.listener.close()


class RemoteService:
    """A client process's view of a :class:`PoolServer`'s pool (what :func:`install` takes there):
    ``batch_*`` calls go to the service, one connection per calling thread (MemCache's client is
    called from the worker's layer threads at once); host ranges are this process's."""

    def __init__(self, address, real: bool = False):
        self.address = address
        #: the pool is the real MemCache (``memcache_pool``): this process's caches are device
        #: buffers its MemCache client (an agent) maps
        self.real = real
        self.regions: list[tuple[int, int]] = []
        self._local = threading.local()
        self._host = LocalHost(self.regions)

    def register_region(self, ptr: int, size: int) -> None:
        self.regions.append((int(ptr), int(size)))
        if self.real:
            import memcache_host

            self._call("register_region", (memcache_host.buffer_of(int(ptr), int(size)), int(size)), REGISTER_LIMIT_S)

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            from multiprocessing.connection import Client

            conn = self._local.conn = Client(self.address, family="AF_UNIX")
        return conn

    def __getattr__(self, name):
        if not name.startswith("batch_"):
            raise AttributeError(name)
        return lambda *args: self._call(name, args)

    def _call(self, name, args, limit_s: float = REPLY_LIMIT_S):
        conn = self._conn()
        conn.send((name, args))
        while True:
            if not conn.poll(limit_s):
                raise TimeoutError(f"byte store: no answer to {name} within {limit_s} s")
            kind, payload = conn.recv()
            if kind == "ok":
                return payload
            if kind == "raise":
                raise payload
            if kind == "outside":
                conn.send(self._host.outside(payload))
            elif kind == "read":
                conn.send(self._host.read(payload))
            elif kind == "who":
                conn.send(os.getpid())
            else:  # write
                conn.send(self._host.write(payload))
