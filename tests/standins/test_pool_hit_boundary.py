"""Issue 25 (a): on vllm-ascend 0.30.0rc2 a hybrid request whose whole prompt is in the pool resumes
on a saved GDN-state boundary (group ``pool_hit_boundary``), not at prompt length - 1.

On the pool harness (tests/standins/harness_pool) running vLLM 0.30.0's Scheduler in mamba align
mode, vllm-ascend 0.30.0rc2's AscendStore connector halves (use_layerwise, MemCache backend, GVA data
plane, the coordinator's reachable-hit lookup), the byte-level pool and 0.30's runner order (the
connector's staged per-layer mamba copy). Instance A serves a 40-token prompt; instance B, same pool,
empty HBM, serves exactly A's first 32 tokens. Upstream's ``get_num_new_matched_tokens`` takes the
32-token hit, subtracts one (the last token must be computed) and B resumes at 31: each GDN layer
reads the state saved at 32 -- one that already contains the token it is about to compute.

v0300 only: on v0290 (vLLM 0.29.0) vllm-ascend 0.30.0rc2's worker patches do not import
(``patch_deepseek_v2``), so no NPU worker of that pair starts and the harness, which applies them as
the worker does, cannot run either.
"""

from __future__ import annotations

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.registry import APPLIED
from support import PAIR, activate_skipping, group_states

PAIRS = ("v0300",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from harness_pool import PoolInstance, differing_tokens, engine_loop, groups_skipped, make_pool, reference_outputs  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

A = list(range(1000, 1040))  # 40 tokens, 16-token blocks


def _serve(inst: PoolInstance, req_id: str, prompt) -> None:
    inst.add_request(req_id, prompt)
    engine_loop(inst)


def whole_prompt(chunk: int = 256):
    """A (prefilled in ``chunk``-token chunks) on one instance, then B = A[:32] on a second one."""
    pool = make_pool()
    _serve(PoolInstance(pool, name="A", max_num_batched_tokens=chunk), "a", A)
    b = PoolInstance(pool, name="B")
    _serve(b, "b", A[:32])
    return b, A[:32]


def pool_hit_plus_5():
    """Control: B = A[:32] + 5 other tokens (the hit is not the whole prompt)."""
    pool = make_pool()
    _serve(PoolInstance(pool, name="A"), "a", A)
    b = PoolInstance(pool, name="B")
    _serve(b, "b", A[:32] + [7, 8, 9, 10, 11])
    return b, A[:32] + [7, 8, 9, 10, 11]


SCENARIOS = {
    "whole_prompt_one_chunk": lambda: whole_prompt(256),  # states saved at 32 and 40 only
    "whole_prompt_16_token_chunks": lambda: whole_prompt(16),  # states at 16, 32, 40
    "pool_hit_plus_5": pool_hit_plus_5,
}


def _row(name: str):
    """(wrong GDN reads, GDN reads, the tokens B's GDN layers resumed from, B's tokens that differ
    from a run without the pool) of B's first step."""
    b, prompt = SCENARIOS[name]()
    reads = b.reads_of("b", step=b.first_step_of("b"))
    differ = differing_tokens(b.outputs, reference_outputs({"b": prompt}))
    return sum(not r.ok for r in reads), len(reads), sorted({r.expected for r in reads}), differ


def _rows(skip: str | None) -> dict:
    with groups_skipped(*filter(None, [skip])):
        return {name: _row(name) for name in SCENARIOS}


def test_pool_hit_boundary_applies():
    assert group_states("pool_hit_boundary") == {APPLIED}


def test_whole_prompt_hit_resumes_on_a_saved_state():
    """Group off: B's GDN layers read the state saved at the prompt end while resuming at 31 (one
    wrong read per GDN layer, 2) and B samples a wrong token. As configured (the library on): B
    resumes where a state was saved -- 0 (nothing saved below 32: the prompt recomputes) or 16 --
    reads it right and samples the token of a run without the pool. The control is right either way."""
    off = _rows("pool_hit_boundary")
    on = _rows(None)
    print(f"\npool_hit_boundary off: {off}\npool_hit_boundary on:  {on}")
    assert off["whole_prompt_one_chunk"] == (2, 2, [31], 1)
    assert off["whole_prompt_16_token_chunks"] == (2, 2, [31], 1)
    assert on["whole_prompt_one_chunk"] == (0, 0, [], 0)  # resumed at 0: no state read at all
    assert on["whole_prompt_16_token_chunks"] == (0, 2, [16], 0)
    assert off["pool_hit_plus_5"] == on["pool_hit_plus_5"] == (0, 2, [32], 0)


@pytest.mark.control("the library reverted inside the test: upstream's own behaviour, the same without the library (the defect: wrong states read)")
def test_library_off_reads_wrong_states():
    """The whole library off (every group reverted): the same 2 wrong reads and a wrong token."""
    import harness_pool

    harness_pool.setup_runtime()
    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    try:
        assert not [st.name for st in reg.status() if st.state == APPLIED]
        row = _row("whole_prompt_one_chunk")
    finally:
        activate_skipping()
    print(f"\nlibrary off, whole_prompt_one_chunk: {row}")
    assert row == (2, 2, [31], 1)


@pytest.mark.control("the fix detector run on upstream's own code")
def test_detector_probe_lands_where_the_method_lands():
    """The fixed-upstream detector calls the real method on a probe scheduler: 0.30.0rc2 lands a
    whole-prompt hit at 31 (not fixed); the patched method at 16 (the boundary below the prompt)."""
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_scheduler import KVPoolScheduler

    from ascend_layerwise_patch.patches import pool_hit_boundary

    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    try:
        original = KVPoolScheduler.get_num_new_matched_tokens
        assert pool_hit_boundary.probe_hit(original) == 31
        assert pool_hit_boundary._fixed_upstream(original) is None
        assert pool_hit_boundary.probe_hit(pool_hit_boundary.boundary_hit(original)) == 16
    finally:
        reg.activate()
