"""A layerwise save's MemCache allocation lease is the store's own, not 5 minutes (vllm-ascend 0.30.0rc2).

Target   vllm_ascend...ascend_store.backend.memcache_backend: MemcacheBackend.batch_alloc (``V029_030``).
Why      0.30 allocates every pool write with a 5-minute lease (``LAYERWISE_READ_LEASE_TTL_MS``).
         When the writer's host dies with keys allocated and unfinished, MemCache 1.2.0's MetaService
         frees them only once that lease runs out, and answers no client meanwhile: every engine on
         the pool stalls in its lookups for minutes (tests/standins/test_memcache_writers.py, the
         writer that dies mid-write, on the real MemCache). 0.25 / 0.26 ask no lease.
How      A lease above ``ASCEND_LAYERWISE_PATCH_ALLOC_LEASE_S`` is lowered to it; unset, the call asks
         none, as 0.25 / 0.26 do (MemCache's ``ock.mmc.meta.lease_ttl_ms``, ~10 s by default); ``off``
         keeps upstream's. A save past its lease fails and costs its keys (``pool_save_failures``).
Removal  When the save path asks no lease longer than the bound (``LAYERWISE_READ_LEASE_TTL_MS``).
"""

from __future__ import annotations

import functools

from ...host import OFF_WORDS, logger, switch
from .._checks import Group
from .._checks import expects as _expects
from .._ranges import V029_030
from .._targets import STORE

BACKEND = f"{STORE}.backend.memcache_backend:MemcacheBackend"
ENV = "ASCEND_LAYERWISE_PATCH_ALLOC_LEASE_S"


def bound_ms(environ=None) -> int | None:
    """The longest allocation lease a save may ask (ms; 0: the store's own), or None (``off``)."""
    value = switch(ENV, environ)
    if not value:
        return 0
    if value in OFF_WORDS:
        return None
    try:
        seconds = float(value)
    except ValueError:
        logger().warning("ascend_layerwise_patch: %s=%r is not a number of seconds; using the store's own lease", ENV, value)
        return 0
    return max(int(seconds * 1000), 0)


def capped(lease_ms: int, bound: int | None) -> int:
    """The lease to ask: ``lease_ms`` where no bound applies, else at most ``bound`` (0 asks none)."""
    if bound is None or lease_ms <= 0:
        return lease_ms
    return min(lease_ms, bound)


def make_batch_alloc(original):
    @functools.wraps(original)
    def batch_alloc(self, keys, sizes, lease_ttl_ms: int = 0, *args, **kwargs):
        return original(self, keys, sizes, capped(int(lease_ttl_ms), bound_ms()), *args, **kwargs)

    return batch_alloc


def _asks_long_lease(original) -> str | None:
    from importlib import import_module

    lease = getattr(import_module(f"{STORE}.pool_worker"), "LAYERWISE_READ_LEASE_TTL_MS", None)
    bound = bound_ms()
    if lease is None or (bound is not None and bound > 0 and lease <= bound):
        return "vllm-ascend's layerwise saves ask no allocation lease longer than the bound"
    return None


GROUP = Group(
    "pool_alloc_lease",
    V029_030,
    risk="an engine host that dies mid-save stalls MemCache 1.2.0's MetaService, and every engine on the pool, for up to 5 minutes",
    why="a layerwise save's allocation lease is MemCache's own (or ASCEND_LAYERWISE_PATCH_ALLOC_LEASE_S), not 5 minutes",
    fixed_upstream=_asks_long_lease,
)

SPECS = (
    GROUP.spec("pool_alloc_lease", f"{BACKEND}.batch_alloc", make_batch_alloc,
               precondition=_expects(["self", "keys", "sizes", "lease_ttl_ms"])),
)
