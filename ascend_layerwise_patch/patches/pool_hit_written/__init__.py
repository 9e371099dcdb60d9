"""A pool hit counts only keys that are ready to read, not keys another engine is still writing.

Target   vllm_ascend...ascend_store.backend.memcache_backend: MemcacheBackend.batch_get_key_info (the
         layerwise hit check: a block is a hit when every key has a size, or on 0.30 a size and an
         address) and MemcacheBackend.exists (``batch_is_exist``: the other lookups). Only the
         scheduler's client is changed (``create_scheduler_client``: ``init_bm`` False); a worker's
         calls are left as they are.
Why      vllm-ascend 0.26.0rc1 and 0.30.0rc2 pin MemCache ``memcache-hybrid==1.2.0``. There a key
         that another client has allocated and not yet finished (a second engine saving the same
         prefix at that moment) exists (``batch_is_exist`` 1) and has a size and an address
         (``batch_get_key_info``), so the hit check counts it; the worker's read lease on it then
         fails (the key is being written) and the load of that block fails. 0.26 stops the engine
         ("Layerwise multi-group KV load failed and cannot safely fall back"); 0.30 ends the
         request with an error under vLLM's default policy, or recomputes under ``recompute``. Two
         engines sharing a pool meet this whenever one reads a prefix the other is still writing
         (tests/standins/test_memcache_writers.py on the real MemCache 1.2.0). MemCache 1.3.0 shows
         no key being written to either call.
How      After upstream's answer, each key it counts is confirmed as MemCache's own read path
         confirms it: a read lease (``batch_add_lease``), released at once (``batch_remove_lease``).
         A key whose lease fails counts as absent: the hit ends before it and the engine computes
         that block itself (and saves nothing over it: the other writer's key is allocated). Two
         store calls per lookup that found something; none when it found nothing.
Removal  Skipped where the installed MemCache hides keys being written (``memcache-hybrid`` 1.3.0 or
         later: read from its version).
"""

from __future__ import annotations

import functools
import logging

from .._checks import Group
from .._checks import param_names as _params
from .._checks import source as _source
from .._ranges import SUPPORTED
from .._targets import STORE

logger = logging.getLogger(__name__)

BACKEND = f"{STORE}.backend.memcache_backend:MemcacheBackend"
#: the lease a probe takes (ms): released at once, so any positive TTL does
PROBE_LEASE_MS = 1000
#: the first MemCache release whose exists / key info hide a key being written (measured: 1.3.0)
HIDES_WRITING = (1, 3)


def confirmed(backend, keys: list[str], counted: list[bool]) -> list[bool]:
    """``counted[i]`` and key ``i`` takes a read lease (released at once)."""
    probe = [k for k, c in zip(keys, counted) if c]
    if not probe or backend.store is None:
        return list(counted)
    results = backend.store.batch_add_lease(probe, PROBE_LEASE_MS)
    if len(results) != len(probe):
        return [False] * len(keys)  # an answer of the wrong shape confirms nothing: a miss costs time only
    leased = [k for k, r in zip(probe, results) if r == 0]
    if leased:
        backend.store.batch_remove_lease(leased)
    if len(leased) < len(probe):
        logger.debug("pool hit check: %d of %d keys are still being written (counted as misses)", len(probe) - len(leased), len(probe))
    ok = iter(r == 0 for r in results)
    return [c and next(ok) for c in counted]


def _scheduler(backend) -> bool:
    return getattr(backend, "_init_bm", True) is False


def make_exists(original):
    @functools.wraps(original)
    def exists(self, keys):
        states = original(self, keys)
        if not _scheduler(self) or len(states) != len(keys):
            return states
        ok = confirmed(self, list(keys), [s == 1 for s in states])
        return [0 if s == 1 and not c else s for s, c in zip(states, ok)]

    return exists


class Absent:
    """The key info of a key that is not ready: no size, no address (what MemCache answers for a
    missing key, as an object: the hit checks call ``size()`` on every entry)."""

    def size(self) -> int:
        return 0

    def gva_list(self) -> list[int]:
        return []

    def type_list(self) -> list[int]:
        return []


def _has_size(info) -> bool:
    try:
        return info is not None and int(info.size()) > 0
    except (AttributeError, TypeError, ValueError):
        return False


def make_key_info(original):
    @functools.wraps(original)
    def batch_get_key_info(self, keys, *args, **kwargs):
        infos = original(self, keys, *args, **kwargs)
        if not _scheduler(self) or infos is None or len(infos) != len(keys):
            return infos
        sized = [_has_size(i) for i in infos]
        ok = confirmed(self, list(keys), sized)
        return [Absent() if has and not c else i for i, has, c in zip(infos, sized, ok)]

    return batch_get_key_info


def _memcache_hides_writing(_original) -> str | None:
    from importlib import metadata

    try:
        version = metadata.version("memcache-hybrid")
    except metadata.PackageNotFoundError:
        return None
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts >= HIDES_WRITING:
        return f"memcache-hybrid {version} shows no key being written to exists / key info"
    return None


def _scheduler_client_ok(original) -> str | None:
    cls = original.__globals__.get("MemcacheBackend")
    if cls is None or "init_bm=False" not in _source(cls.create_scheduler_client):
        return "MemcacheBackend.create_scheduler_client no longer makes the scheduler's client with init_bm=False"
    return None


def _checked(original) -> str | None:
    names = _params(original)
    if names[:2] != ["self", "keys"]:
        return f"{original.__qualname__} parameters are {names}, expected self, keys first"
    return _scheduler_client_ok(original)


GROUP = Group(
    "pool_hit_written",
    SUPPORTED,
    risk="with MemCache 1.2.x a key another engine is still writing counts as a pool hit: its load fails (0.26 stops, 0.30 fails the request)",
    why="a pool hit counts only keys that take a read lease (MemCache 1.2.x shows keys being written)",
    fixed_upstream=_memcache_hides_writing,
)

SPECS = (
    GROUP.spec("pool_hit_written", f"{BACKEND}.batch_get_key_info", make_key_info, precondition=_checked),
    GROUP.spec("pool_hit_written_exists", f"{BACKEND}.exists", make_exists, precondition=_checked),
)
