"""The pool harness on the real MemCache: :class:`MemcachePool` is a :class:`byte_store.PoolService`
whose keys, bytes, leases, eviction and two-writer rules are MemCache's own.

Each harness process (the test process, each TP rank process) reaches MemCache through its own
client, a MemCache agent (``memcache_host.agent``) whose real ``DistributedObjectStore`` maps that
process's KV caches at their addresses. vllm-ascend's ``MemcacheBackend`` is unchanged: the
``memcache_hybrid.DistributedObjectStore`` it creates is ``byte_store``'s client class, and every
call it makes comes here (through ``byte_store_remote`` from a rank process), where:

- the harness's faults and observers run first, exactly as on the byte store (a copy that errors,
  raises, waits at a gate, is slow, or is watched for which request's block it reads);
- then the calling process's agent makes the call on the real client, and its result is what
  vllm-ascend sees;
- the harness keeps its records (per key: writes, finish, leases; copies and bytes per direction),
  while MemCache stays the truth: a key's ``state`` asks MemCache whether it is still there.

Keys are namespaced per pool (``p<N>/``), so tests sharing one MetaService never see each other's
keys. What this does not model: MemCache on an NPU (the copies are memmoves through the CANN
stand-in, transport ``host_shm``); a client living inside the worker process (an agent process is
the client of one harness process at a time). An agent outlives the process it served: the next harness process takes it, with
its share (the objects in it stay; ``memcache_host.Cluster.drop`` ends one with its share).
"""

from __future__ import annotations

import bisect
import itertools
import os
import time

import numpy as np

import memcache_host
from byte_store import L2G, KeyInfo, PoolService

_POOL_IDS = itertools.count(1)


class RealBlob:
    """The harness's record of one MemCache key: its allocation, the writes and finish the harness
    saw, its read leases; ``state`` and ``data`` ask MemCache."""

    def __init__(self, pool: "MemcachePool", key: str, gva: int, size: int, state: str = "writing"):
        self.pool, self.key, self.gva, self.size = pool, key, gva, size
        self.writes: list[tuple[int, int, float, bool]] = []
        self.finished_at: float | None = None
        self.result: int | None = None
        self.leases = 0
        self.seen = state  # what the harness saw: writing | ready | failed

    @property
    def state(self) -> str:
        """writing (not finished by anyone here) | ready (MemCache has it) | failed (finished and
        gone, or superseded: MemCache removed this allocation and the key was allocated anew)."""
        if self.pool.blobs.get(self.key) is not self:
            return "failed"
        if self.seen == "writing":
            return "writing"
        return "ready" if self.pool.exists_now([self.key])[0] else "failed"

    @property
    def data(self) -> np.ndarray:
        return np.frombuffer(self.pool.read(self.key), dtype=np.uint8)


class MemcachePool(PoolService):
    """One pool (a key namespace) on the real MemCache of ``cluster``."""

    real = True  # the real MemCache: byte_store_remote passes every call the caller's host

    def __init__(self, cluster: memcache_host.Cluster):
        super().__init__()
        self.cluster = cluster
        self.prefix = f"p{next(_POOL_IDS)}.{os.getpid()}/"
        self._starts: list[int] = []  # sorted GVAs of known keys
        self._at: dict[int, RealBlob] = {}
        self.results: dict[str, list] = {}  # what MemCache answered, per call name (the last call)
        self._probe = None  # outlive_allocations' buffer
        self.alloc_leases: list[int] = []  # the lease (ms) each batch_alloc asked; 0: MemCache's configured one

    # ------------------------------------------------------------------ plumbing
    def _agent(self, host) -> memcache_host.AgentHandle:
        return self.cluster.agent(host.pid if host is not None else os.getpid())

    def _ns(self, keys) -> list[str]:
        return [self.prefix + k for k in keys]

    def _index(self, blob: RealBlob) -> None:
        if blob.gva not in self._at:
            bisect.insort(self._starts, blob.gva)
        self._at[blob.gva] = blob

    def _blob_at(self, gva: int):
        i = bisect.bisect_right(self._starts, gva) - 1
        if i < 0:
            return None
        blob = self._at[self._starts[i]]
        return (blob, gva - blob.gva) if gva - blob.gva < max(blob.size, 1) else None

    def register_region(self, ptr: int, size: int, host=None) -> None:
        """A cache tensor of this process (``host`` None) or of a rank process: its agent maps it."""
        if host is None:
            super().register_region(ptr, size)
            path, start, total = memcache_host.buffer_of(int(ptr), int(size))
        else:
            path, start, total = ptr  # a rank process sends (path, start, size) of its buffer
        self._agent(host).map(path, start, total)

    def drop_process(self, pid: int) -> None:
        """A harness process ended: its client (agent) is free for another process; the objects in
        its share stay (``memcache_host.Cluster``)."""
        self.cluster.release(pid)

    # ------------------------------------------------------------------ MemCache API
    def batch_alloc(self, keys, sizes, *more, host=None) -> list[int]:
        gvas = self._agent(host).call("batch_alloc", self._ns(keys), list(sizes), *more)
        self.alloc_leases.append(int(more[1]) if len(more) > 1 else 0)  # (media, lease ms): 0.30 asks one
        with self.lock:
            for key, size, gva in zip(keys, sizes, gvas):
                if gva <= 0:
                    continue
                blob = self.blobs.get(key)
                # a new allocation unless the key is being written or ready (MemCache then hands
                # out its address: a second writer of the same allocation)
                if blob is None or blob.gva != gva or blob.state == "failed":
                    blob = self.blobs[key] = RealBlob(self, key, int(gva), int(size))
                    self._index(blob)
        return gvas

    def batch_write_finish(self, keys, results, host=None) -> list[int]:
        out = self._agent(host).call("batch_write_finish", self._ns(keys), [int(r) for r in results])
        now = time.monotonic()
        with self.lock:
            for key, res in zip(keys, results):
                blob = self.blobs.get(key)
                if blob is not None:
                    blob.result, blob.finished_at = int(res), now
                    blob.seen = "ready" if res == 0 else "failed"
        return out

    def batch_get_key_info(self, keys, host=None) -> list[KeyInfo]:
        infos = self._agent(host).call("batch_get_key_info", self._ns(keys))
        out = []
        with self.lock:
            for key, (size, gvas) in zip(keys, infos):
                gva = gvas[0] if gvas else 0
                if size and (key not in self.blobs or self.blobs[key].gva != gva):
                    blob = self.blobs[key] = RealBlob(self, key, int(gva), int(size), state="ready")
                    self._index(blob)
                out.append(KeyInfo(int(size), int(gva)))
        return out

    def batch_is_exist(self, keys, host=None) -> list[int]:
        return self._agent(host).call("batch_is_exist", self._ns(keys))

    def batch_add_lease(self, keys, lease_ttl_ms=0, host=None) -> list[int]:
        out = self._agent(host).call("batch_add_lease", self._ns(keys), lease_ttl_ms)
        with self.lock:
            for key, res in zip(keys, out):
                if res == 0 and key in self.blobs:
                    self.blobs[key].leases += 1
        return out

    def batch_remove_lease(self, keys, host=None):
        out = self._agent(host).call("batch_remove_lease", self._ns(keys))
        with self.lock:
            for key in keys:
                blob = self.blobs.get(key)
                if blob is not None and blob.leases:
                    blob.leases -= 1
                elif blob is not None:
                    self.over_releases.append(key)
        return out

    def _move(self, direction, targets, host, call) -> int:
        gvas, addrs, sizes = call
        return int(self._agent(host).call("batch_copy", [int(g) for g in gvas], [int(a) for a in addrs], [int(s) for s in sizes], direction))

    # ------------------------------------------------------------------ harness side
    def exists_now(self, keys) -> list[bool]:
        """Whether MemCache holds each key ready now (its key info has a size: 1.2.0's ``exists``
        also counts a key still being written)."""
        infos = self.cluster.agent(os.getpid()).call("batch_get_key_info", self._ns(keys))
        return [bool(size) for size, _gvas in infos]

    def ready_keys(self) -> list[str]:
        with self.lock:
            keys = list(self.blobs)
        return [k for k, ok in zip(keys, self.exists_now(keys)) if ok] if keys else []

    def read(self, key: str) -> bytes:
        blob = self.blobs[key]
        rc, data = self.cluster.agent(os.getpid()).read(self.prefix + key, blob.size)
        if rc != 0:
            raise KeyError(f"{key}: MemCache read returned {rc}")
        return data

    def evict(self, match) -> list[str]:
        """Remove every key for which ``match(key)`` holds from MemCache (as its eviction does)."""
        with self.lock:
            gone = [k for k in self.blobs if match(k)]
        if gone:
            self.cluster.agent(os.getpid()).call("remove_batch", self._ns(gone))
        with self.lock:
            for key in gone:
                blob = self.blobs.pop(key, None)
                if blob is not None and self._at.get(blob.gva) is blob:
                    del self._at[blob.gva]
                    self._starts.remove(blob.gva)
        return gone

    def clear(self) -> None:
        self.evict(lambda key: True)

    def outlive_allocations(self, limit_s: float = 60.0) -> int:
        """Return once every allocation made before the call is past MemCache's allocation lease
        (``memcache_host.MetaService``'s ``lease_ttl_ms``): a probe key allocated now by this
        process's client is copied into until MemCache refuses a copy (copies do not renew a lease;
        one allocated earlier expired first). A probe refused at its first copy proves nothing (1.2.0
        sometimes hands out space it is still reclaiming): a new probe is taken. The store decides,
        not a timer; ``limit_s`` only bounds a store that never refuses. Returns the copies made."""
        if self._probe is None:
            self._probe = memcache_host.device_buffer(1 << 12)
            self.register_region(self._probe.data_ptr(), self._probe.numel())
        agent = self.cluster.agent(os.getpid())
        copy = lambda gva: agent.call("batch_copy", [gva], [self._probe.data_ptr()], [self._probe.numel()], L2G)  # noqa: E731
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            key = [f"{self.prefix}~lease-probe-{next(_POOL_IDS)}"]
            gva = agent.call("batch_alloc", key, [self._probe.numel()])[0]
            assert gva > 0, f"MemCache refused the probe's allocation ({gva})"
            copies = 0
            while copy(gva) == 0 and time.monotonic() < deadline:
                copies += 1
                time.sleep(0.05)
            agent.call("batch_write_finish", key, [-1])
            if copies:
                return copies
        raise AssertionError(f"MemCache still accepted copies into an allocation after {limit_s:.0f} s (its lease?)")
