"""Issue 25 (e), verified on vllm-ascend 0.30.0rc2: the scheduler's hit-check cache
(``_lw_block_hit_cache``: hits kept 0.5 s, misses 30 s) cannot report an evicted key as a hit to a
hybrid (GDN) model -- it is only read by ``_lookup_layerwise_contiguous``, used when the scheduler has
no ``cache_coordinator`` (single-group models); a hybrid model's hit check goes through the coordinator
and asks the store every time. What a key evicted between the hit check and the load does to a hybrid
model instead: the worker raises ("Layerwise multi-group KV load failed and cannot safely fall back to
per-block recomputation") out of ``execute_model`` -- in vLLM that ends the engine. No wrong read, but
not recovered either; pinned here as upstream behaviour (not fixed by this library on 0.30).

On the pool harness running vLLM 0.30.0 + vllm-ascend 0.30.0rc2 (v0300 only: see
test_pool_hit_boundary.py for v0290).
"""

from __future__ import annotations

import pytest

from support import PAIR

PAIRS = ("v0300",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from harness_pool import PoolInstance, engine_loop, make_pool  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

A = list(range(1000, 1040))


def test_hit_cache_is_off_the_hybrid_path_and_an_eviction_before_the_load_raises():
    pool = make_pool()
    a = PoolInstance(pool, name="A")
    a.add_request("a", A)
    engine_loop(a)
    b = PoolInstance(pool, name="B")
    sched = b.scheduler.connector.connector_scheduler
    assert sched.cache_coordinator is not None  # hybrid: the coordinator's lookup, not the cached one
    evicted = []
    b.after_schedule = lambda inst, so: evicted.extend(pool.evict(lambda key: True)) if inst.steps == 0 else None
    b.add_request("b", A[:32] + [7, 8, 9, 10, 11])
    with pytest.raises(RuntimeError, match="cannot safely fall back to per-block recomputation"):
        engine_loop(b)
    assert evicted and not sched._lw_block_hit_cache  # the hit (32 tokens) was asked of the store, never cached
    assert not b.reads_of("b") and not b.reads_of("b", kind="attn")  # nothing computed on what was missing
