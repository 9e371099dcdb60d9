"""Group ``pool_save_failures`` (vllm-ascend 0.26.0rc1 / 0.30.0rc2): a failed save copy costs its keys,
not the engine.

Engine A serves two prompts while one save copy (GDN layer 0, or attention layer 3, the step's last)
returns an error or raises, injected around the store's copy. A must keep serving and sample what a
run without the pool samples; no key may be ready with a layer slot never written; engine B, serving
the same prompts from the same pool afterwards, must read every state right and sample the same
tokens. With the group skipped the sending thread raises and the engine stops (the control case).

The store is the pair's default (the real MemCache 1.2.0 on both pairs: its own write finish then
removes the failed keys). test_memcache_capacity.py drives the same failure with no injection: B's
saves into a MemCache pool that is full.
"""

from __future__ import annotations

import pytest

from support import PAIR, activate_skipping

PAIRS = ("v0260", "v0300")
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

import byte_store  # noqa: E402
from harness_pool import PoolInstance, differing_tokens, engine_loop, layer_slot_fault, make_pool, reference_outputs  # noqa: E402
from harness_pool.lifetime import ready_with_a_gap  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

GROUP = "pool_save_failures"
PROMPTS = {"r0": list(range(20_000, 20_040)), "r1": list(range(21_000, 21_056))}
MAX_TOKENS = 2


@pytest.fixture
def skipping():
    """``skipping(*groups)``: the library re-activated with those groups skipped (none: as configured)."""

    def set_(*groups: str):
        activate_skipping(*groups).apply_pending()

    yield set_
    set_()


def _serve(kind: str, layer: int):
    """A serves PROMPTS with one save copy of ``layer``'s slot failing as ``kind``; then B serves them
    from the same pool. (pool, A, B, fault); raises where an engine stops."""
    pool = make_pool()
    a, b = PoolInstance(pool, name="A"), PoolInstance(pool, name="B")
    try:
        fault = pool.add_fault(kind, direction=byte_store.L2G, times=1, at=layer_slot_fault(a, [layer]))
        for rid, prompt in PROMPTS.items():
            a.add_request(rid, prompt, max_tokens=MAX_TOKENS)
        engine_loop(a)
        pool.clear_faults()
        for rid, prompt in PROMPTS.items():
            b.add_request(rid, prompt, max_tokens=MAX_TOKENS)
        engine_loop(b)
        return pool, a, b, fault
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["error", "raise"])
@pytest.mark.parametrize("layer", [0, 3])
def test_a_failed_save_copy_costs_its_keys_not_the_engine(skipping, kind, layer):
    reference = reference_outputs(PROMPTS, max_tokens=MAX_TOKENS)
    pool, a, b, fault = _serve(kind, layer)
    gaps = ready_with_a_gap(pool, a)
    print(f"\n{kind} at layer {layer}: {fault.hits} copy failed, {len(pool.blobs)} keys written, {len(gaps)} ready with a gap")
    assert fault.hits == 1
    assert differing_tokens(a.outputs, reference) == 0 and differing_tokens(b.outputs, reference) == 0
    for inst in (a, b):
        assert inst.wrong_reads() == [] and inst.wrong_reads(kind="attn") == [], inst.name
        pool_ = inst.scheduler.kv_cache_manager.block_pool
        assert pool_.get_num_free_blocks() == pool_.num_gpu_blocks - 1, inst.name
    assert gaps == [] and pool.violations == []


def test_without_the_group_the_engine_stops(skipping):
    skipping(GROUP)
    with pytest.raises(RuntimeError, match="failed during asynchronous transfer"):
        _serve("error", 3)
