"""A byte-level MemCache pool for the CPU harness, stood in at the module vllm-ascend imports.

vllm-ascend's ``MemcacheBackend`` does ``from memcache_hybrid import DistributedObjectStore``
(a client of a hardware/service pool); :func:`install` puts a ``memcache_hybrid`` module in
``sys.modules`` whose ``DistributedObjectStore`` is a client of one :class:`PoolService`. Everything
above that boundary (``MemcacheBackend``, the layer threads, ``KVPoolWorker`` / ``KVPoolScheduler``)
is vllm-ascend's own code.

What the service does, as MemCache's GVA API is used by the layerwise path:
- ``batch_alloc(keys, sizes)``: one blob per new key, its GVA space ``blob index << GVA_SHIFT``; the
  blob is *writing* (not visible) until finished. A key that is being written or ready gets its
  existing address (MemCache's rule): writers of a key being written all copy into it (the last copy
  wins); a copy into a ready key succeeds and changes nothing (the first finished bytes stay).
- ``batch_copy(gvas, addrs, sizes, direction)``: real bytes, ``ctypes.memmove`` between the blob and
  host memory. Every range is bounds-checked: the GVA range must lie in its blob, the host range in
  a region the harness registered (the host tensors standing for the NPU caches). A bad range is a
  :class:`Violation` and the copy fails. Direction 0 (L2G) writes the blob, 1 (G2L) reads it.
- ``batch_write_finish(keys, results)``: result 0 makes the key *ready*; anything else *failed*
  (removed for everyone: a later lookup misses, also when another writer of the same allocation had
  finished it with 0, and that writer's later finish returns ``MMC_LEASE_GONE``); an unknown key
  returns ``MMC_UNKNOWN_KEY``.
- ``batch_get_key_info`` / ``batch_is_exist``: ready keys have a size / exist; on MemCache 1.2.x
  (``shows_writing``) so does a key still being written, as 1.2.0 answers (its read lease fails).
- ``batch_add_lease`` / ``batch_remove_lease``: counted, never refused for a ready key.

Faults (:meth:`PoolService.add_fault`): a copy whose keys match can return an error, raise, or
block on a gate (bounded by ``GATE_LIMIT_S``), in either direction, once or every time; a ``delay``
fault makes it slow (it succeeds after ``delay()`` seconds, or when its gate opens). ``at`` narrows
a fault to ranges of the key (``at(key, offset, blob size)``: e.g. one layer slot).

Observers (``PoolService.observers``): called with every copy's ranges (key, offset, host address,
size) and the host whose addresses they are (``host.pid``: its process) once its faults let it
run -- when it would read the host memory (harness_pool's ``BlockOwners`` checks there which
request owns each block a save copy reads).

Held to MemCache's behaviour by ``test_store_conformance`` (the same operations on both, results
compared where the library can tell). Not modelled: MemCache refuses a read copy without a read
lease (-3102; vllm-ascend always takes one first), MemCache refusing (0) the same client's
allocation of a key for ~2 s after that client finished it with a failure, allocation leases
expiring on their own (a test expires them with :meth:`PoolService.outlive_allocations`), read
leases expiring, capacity and eviction (a test evicts with :meth:`PoolService.evict`), a writer's
process exiting with its share, MemCache's get-while-writing defect (``memcache_pool`` runs them for
real).

Records, per key: every write (offset, size, time, ok), the finish (result, time), so tests can ask
which layer slots were written before the key became ready (:meth:`PoolService.written_slots`).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

GVA_SHIFT = 32
GATE_LIMIT_S = 30.0  # a gated copy never waits longer than this (no hung tests)
MMC_NOT_FOUND = -3101  # a read lease of a key that is not ready
MMC_LEASE_GONE = -3102  # finishing a key another writer's failed finish removed
MMC_UNKNOWN_KEY = -3000  # finishing a key nobody allocated
MMC_LEASE_EXPIRED = -3106  # a copy into an allocation past its lease (MemCache's code for it)
L2G, G2L = 0, 1  # batch_copy directions: save (write the pool), load (read the pool)


@dataclass
class Blob:
    key: str
    gva: int
    data: np.ndarray
    state: str = "writing"  # writing | ready | failed
    writes: list[tuple[int, int, float, bool]] = field(default_factory=list)
    finished_at: float | None = None
    result: int | None = None
    leases: int = 0
    expired: bool = False  # its allocation lease ran out while it was written (outlive_allocations)

    @property
    def size(self) -> int:
        return len(self.data)


@dataclass
class Fault:
    """A copy touching a key for which ``match(key)`` holds gets ``kind``: error | raise | gate |
    delay | expire (every allocation being written outlives its lease first: the copy then fails)."""

    kind: str
    direction: int | None = None  # L2G, G2L or None (both)
    match: Callable[[str], bool] = lambda key: True
    times: int | None = None  # None: every matching copy; n: the next n
    gate: threading.Event = field(default_factory=threading.Event)
    hits: int = 0
    delay: Callable[[], float] | None = None  # kind "delay": seconds the copy takes (cut short by the gate)
    #: narrows ``match`` to ranges: ``at(key, offset, blob size)`` for each range the copy touches
    #: (e.g. one layer slot of a key); None: the whole key
    at: Callable[[str, int, int], bool] | None = None
    #: narrows it to copies made by a process whose pid ``caller(pid)`` accepts (one TP rank's
    #: process); None: any process's
    caller: Callable[[int], bool] | None = None

    def hits_copy(self, targets) -> bool:
        if self.at is None:
            return any(self.match(k) for k in dict.fromkeys(b.key for b, *_ in targets))
        return any(self.match(b.key) and self.at(b.key, off, b.size) for b, off, *_ in targets)


@dataclass
class Violation:
    kind: str  # "host-range" | "gva-range" | "unknown-gva"
    detail: str


class KeyInfo:
    """What ``batch_get_key_info`` returns per key (MemCache's ``size()`` / ``gva_list()``)."""

    def __init__(self, size: int, gva: int):
        self._size, self._gva = size, gva

    def size(self) -> int:
        return self._size

    def gva_list(self) -> list[int]:
        return [self._gva] if self._size else []

    def type_list(self) -> list[int]:  # media of each copy (vllm-ascend 0.30 rewarms SSD = 2): never SSD here
        return [0] if self._size else []


class PoolService:
    """One MemCache pool, shared by every instance (scheduler and worker clients) attached to it."""

    def __init__(self, shows_writing: bool | None = None):
        #: ``batch_is_exist`` and ``batch_get_key_info`` show a key still being written (MemCache
        #: 1.2.x: exists 1, its size and address; a read lease of it fails); None: as the installed
        #: memcache-hybrid does (1.3.0 when none is installed)
        if shows_writing is None:
            import memcache_host

            shows_writing = memcache_host.shows_writing()
        self.shows_writing = shows_writing
        self.lock = threading.RLock()
        self.blobs: dict[str, Blob] = {}
        self._by_index: dict[int, Blob] = {}
        self._next = itertools.count(1)
        self.regions: list[tuple[int, int]] = []  # host ranges a copy may touch
        self.faults: list[Fault] = []
        self.violations: list[Violation] = []
        self.copies = {L2G: 0, G2L: 0}
        self.bytes = {L2G: 0, G2L: 0}
        self.key_bytes: dict[int, dict[str, int]] = {L2G: {}, G2L: {}}  # bytes copied per key and direction
        self.copy_log: list[tuple[int, tuple[str, ...], int]] = []  # (direction, keys, result)
        #: ``observer(direction, [(key, offset, host addr, size)], host)`` for every copy, once its faults
        #: let it run (after a gate or delay, before an injected error or raise): what it touches
        self.observers: list[Callable] = []
        #: lease releases of a key that held no lease (a lease released early, for a reader still copying)
        self.over_releases: list[str] = []

    # ------------------------------------------------------------------ harness side
    def register_region(self, ptr: int, size: int) -> None:
        with self.lock:
            self.regions.append((int(ptr), int(size)))

    def add_fault(self, kind: str, *, direction: int | None = None, match=None, times: int | None = None, delay=None, at=None, caller=None) -> Fault:
        assert kind in ("error", "raise", "gate", "delay", "expire") and (kind == "delay") == (delay is not None), kind
        fault = Fault(kind, direction, match or (lambda key: True), times, delay=delay, at=at, caller=caller)
        with self.lock:
            self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self.lock:
            faults, self.faults = self.faults, []
        for f in faults:
            f.gate.set()

    def clear(self) -> None:
        """Forget every key (an emptied / restarted pool); registered regions and faults stay."""
        with self.lock:
            self.blobs.clear()
            self._by_index.clear()

    def evict(self, match) -> list[str]:
        """Forget every key for which ``match(key)`` holds (as MemCache evicts); returns them."""
        with self.lock:
            gone = [k for k in self.blobs if match(k)]
            for key in gone:
                self._by_index.pop(self.blobs.pop(key).gva >> GVA_SHIFT, None)
        return gone

    def ready_keys(self) -> list[str]:
        with self.lock:
            return [k for k, b in self.blobs.items() if b.state == "ready"]

    def written_slots(self, key: str, num_slots: int) -> set[int]:
        """Layer slots of ``key`` written by a successful copy (slot = offset * num_slots // size)."""
        blob = self.blobs[key]
        size = blob.size
        return {off * num_slots // size for off, _n, _t, ok in blob.writes if ok}

    def read(self, key: str) -> bytes:
        return self.blobs[key].data.tobytes()

    # ------------------------------------------------------------------ MemCache API
    def batch_alloc(self, keys, sizes, *more, host=None) -> list[int]:  # vllm-ascend 0.30 adds (replicas, lease_ttl_ms)
        out = []
        with self.lock:
            for key, size in zip(keys, sizes):
                blob = self.blobs.get(key)
                if blob is not None and blob.state != "failed":  # being written or ready: its address
                    out.append(blob.gva)
                    continue
                index = next(self._next)
                blob = Blob(key, index << GVA_SHIFT, np.zeros(int(size), dtype=np.uint8))
                self.blobs[key] = blob
                self._by_index[index] = blob
                out.append(blob.gva)
        return out

    def batch_write_finish(self, keys, results, host=None) -> list[int]:
        now = time.monotonic()
        out = []
        with self.lock:
            for key, res in zip(keys, results):
                blob = self.blobs.get(key)
                if blob is None:
                    out.append(MMC_UNKNOWN_KEY)
                    continue
                if blob.state == "failed":  # another writer's failed finish removed it
                    out.append(MMC_LEASE_GONE)
                    continue
                if blob.expired and self.shows_writing:  # 1.2.x: refused; the key stays shown, unreadable
                    out.append(MMC_UNKNOWN_KEY)
                    continue
                blob.result, blob.finished_at = int(res), now
                blob.state = "ready" if res == 0 else "failed"
                out.append(0)
        return out

    def _shown(self) -> tuple[str, ...]:
        return ("ready", "writing") if self.shows_writing else ("ready",)

    def batch_get_key_info(self, keys, host=None) -> list[KeyInfo]:
        shown = self._shown()
        with self.lock:
            return [KeyInfo(b.size, b.gva) if (b := self.blobs.get(k)) is not None and b.state in shown else KeyInfo(0, 0) for k in keys]

    def batch_is_exist(self, keys, host=None) -> list[int]:
        shown = self._shown()
        with self.lock:
            return [int((b := self.blobs.get(k)) is not None and b.state in shown) for k in keys]

    def batch_add_lease(self, keys, lease_ttl_ms=0, host=None) -> list[int]:
        with self.lock:
            out = []
            for k in keys:
                b = self.blobs.get(k)
                if b is None or b.state != "ready":
                    out.append(MMC_NOT_FOUND)
                else:
                    b.leases += 1
                    out.append(0)
            return out

    def batch_remove_lease(self, keys, host=None) -> int:
        with self.lock:
            for k in keys:
                if (b := self.blobs.get(k)) is not None and b.leases:
                    b.leases -= 1
                elif b is not None:
                    self.over_releases.append(k)
        return 0

    def batch_copy(self, gvas, addrs, sizes, direction, host: "LocalHost | None" = None) -> int:
        """``host``: the memory of the process whose addresses ``addrs`` are (default: this one's)."""
        host = host or LocalHost(self.regions)
        with self.lock:
            targets = []
            for gva, addr, size in zip(gvas, addrs, sizes):
                found = self._blob_at(int(gva))
                if found is None:
                    self.violations.append(Violation("unknown-gva", f"gva={int(gva):#x}"))
                    return MMC_NOT_FOUND
                blob, off = found
                targets.append((blob, off, int(addr), int(size)))
            keys = tuple(dict.fromkeys(b.key for b, *_ in targets))
            faults = [
                f
                for f in self.faults
                if (f.direction is None or f.direction == direction)
                and (f.times is None or f.hits < f.times)
                and (f.caller is None or f.caller(host.pid))
                and f.hits_copy(targets)
            ]
            for f in faults:
                f.hits += 1
        for f in faults:
            if f.kind == "expire":  # the store stalled past the allocation lease just before this copy
                self.outlive_allocations()
            elif f.kind == "gate":
                f.gate.wait(GATE_LIMIT_S)
            elif f.kind == "delay":  # a slow store: the copy succeeds after delay() s (or once the gate opens)
                f.gate.wait(min(f.delay(), GATE_LIMIT_S))
        for observe in list(self.observers):
            observe(direction, [(b.key, off, addr, size) for b, off, addr, size in targets], host)
        kinds = {f.kind for f in faults}
        if "raise" in kinds:
            self._log(direction, keys, -2)
            raise RuntimeError("byte store: copy raised (injected)")
        if "error" in kinds:
            self._log(direction, keys, -1)
            return -1
        with self.lock:
            for blob, off, addr, size in targets:
                if off < 0 or off + size > blob.size:
                    self.violations.append(Violation("gva-range", f"{blob.key} [{off}, {off + size}) of {blob.size}"))
                    self._log(direction, keys, -1)
                    return -1
            outside = host.outside([(addr, size) for _b, _o, addr, size in targets])
            if outside:
                blob, _off, addr, size = targets[outside[0]]
                self.violations.append(Violation("host-range", f"{addr:#x}+{size} for {blob.key}"))
                self._log(direction, keys, -1)
                return -1
        now = time.monotonic()
        res = self._move(direction, targets, host, (gvas, addrs, sizes))
        with self.lock:
            for blob, off, addr, size in targets:
                if direction == L2G:
                    blob.writes.append((off, size, now, res == 0))
                if res == 0:
                    self.bytes[direction] += size
                    self.key_bytes[direction][blob.key] = self.key_bytes[direction].get(blob.key, 0) + size
            if res == 0:
                self.copies[direction] += 1
        self._log(direction, keys, res)
        return res

    def _blob_at(self, gva: int):
        """(blob, offset in it) of a GVA, or None."""
        blob = self._by_index.get(gva >> GVA_SHIFT)
        return None if blob is None else (blob, gva - blob.gva)

    def _move(self, direction, targets, host, call) -> int:
        """The copy itself, once faults and bounds let it run (the host memory is read now)."""
        with self.lock:
            if direction == L2G and any(blob.expired and blob.state == "writing" for blob, *_ in targets):
                return MMC_LEASE_EXPIRED  # MemCache refuses the whole copy; its finish 0 still publishes the key
            if direction == L2G:  # a copy into a key already ready succeeds and changes nothing (MemCache)
                for (blob, off, _addr, size), data in zip(targets, host.read([(addr, size) for _b, _o, addr, size in targets])):
                    if blob.state != "ready":
                        blob.data[off : off + size] = np.frombuffer(data, dtype=np.uint8)
            else:
                host.write([(addr, blob.data[off : off + size].tobytes()) for blob, off, addr, size in targets])
        return 0

    def outlive_allocations(self) -> int:
        """Every allocation being written is now past its allocation lease (MemCache's
        ``lease_ttl_ms``; ``memcache_pool`` waits for the real store's): a copy into it fails
        (``MMC_LEASE_EXPIRED``); its finish then does what MemCache does right after the expiry:
        1.3.0 publishes the key with what was copied before (finish 0 returns 0), 1.2.x refuses the
        finish and keeps showing the key as being written (``shows_writing``: it exists, its read
        lease fails). Returns 0 (the real store's probe counts its copies)."""
        with self.lock:
            for blob in self.blobs.values():
                if blob.state == "writing":
                    blob.expired = True
        return 0

    def _log(self, direction, keys, res) -> None:
        with self.lock:
            self.copy_log.append((direction, keys, res))


class LocalHost:
    """The memory of this process, as a copy reaches it: only inside the registered ``regions``."""

    def __init__(self, regions):
        self.regions = regions
        self.pid = os.getpid()  # the process whose memory this is

    def outside(self, ranges) -> list[int]:
        """Indices of the (address, size) ranges not inside one registered region."""
        return [i for i, (addr, size) in enumerate(ranges) if not any(s <= addr and addr + size <= s + n for s, n in self.regions)]

    def read(self, ranges) -> list[bytes]:
        return [ctypes.string_at(addr, size) for addr, size in ranges]

    def write(self, items) -> None:
        for addr, data in items:
            ctypes.memmove(addr, data, len(data))


class DistributedObjectStore:
    """``memcache_hybrid.DistributedObjectStore``: a client of the installed :class:`PoolService`."""

    service: PoolService | None = None  # set by install()

    def __init__(self):
        assert self.service is not None, "byte_store.install(service) first"
        self._svc = self.service

    def init(self, local_rank, init_bm=True) -> int:
        return 0

    def register_buffer(self, ptr, size) -> None:
        self._svc.register_region(ptr, size)

    def __getattr__(self, name):
        if name.startswith("batch_"):
            return getattr(self._svc, name)
        raise AttributeError(name)


def install(service: PoolService) -> None:
    """Make ``service`` the pool that MemCache clients created from now on talk to."""
    module = sys.modules.get("memcache_hybrid")
    if getattr(module, "DistributedObjectStore", None) is not DistributedObjectStore:
        # this process never opens a real client (memcache_pool's agents do): vllm-ascend's backend
        # gets this module's class, the real package installed or not
        module = types.ModuleType("memcache_hybrid")
        module.DistributedObjectStore = DistributedObjectStore
        sys.modules["memcache_hybrid"] = module
    DistributedObjectStore.service = service


# ------------------------------------------------------------------ a pool that outlives its process
# (issue 25: a pool written by one release pair and read by another; each pair is its own venv)
def save(service: PoolService, path: str) -> int:
    """Write ``service``'s ready keys and their bytes to ``path``; returns how many."""
    import pickle

    with service.lock:
        ready = {k: b.data.tobytes() for k, b in service.blobs.items() if b.state == "ready"}
    with open(path, "wb") as f:
        pickle.dump(ready, f)
    return len(ready)


def load(path: str) -> PoolService:
    """A pool holding the ready keys :func:`save` wrote (each finished with result 0)."""
    import pickle

    with open(path, "rb") as f:
        ready = pickle.load(f)
    service = PoolService()
    for key, data in ready.items():
        (gva,) = service.batch_alloc([key], [len(data)])
        blob = service._by_index[gva >> GVA_SHIFT]
        blob.data[:] = np.frombuffer(data, dtype=np.uint8)
        service.batch_write_finish([key], [0])
    return service
