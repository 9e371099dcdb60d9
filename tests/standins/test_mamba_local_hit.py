"""Issue 25 (b): on vllm-ascend 0.30.0rc2, balance scheduling (``enable_balance_scheduling``:
``BalanceScheduler.schedule``, patch_balance_schedule.py) takes the largest per-group local hit
(``max`` over ``find_longest_cache_hit_per_group``'s lengths) with no reconciliation: a local prefix
hit deeper in full attention than in the GDN group starts GDN from a state nobody cached. Group
``mamba_local_hit`` (its joint hit gives every group the same length) applies there.

On the pool harness (tests/standins/harness_pool) running vLLM 0.30.0's Scheduler (vllm-ascend's
BalanceScheduler) in mamba align mode, vllm-ascend 0.30.0rc2's AscendStore connector halves, the
byte-level pool and 0.30's runner order. One instance serves A (40 tokens, one chunk), then B = A's
first 16 tokens + 5 others: a local hit of one block in full attention. Control: the same with
balance scheduling off (vLLM 0.30's own schedule path reconciles the groups itself).

v0300 only (see test_pool_hit_boundary.py: vllm-ascend 0.30.0rc2's worker patches do not import on
vLLM 0.29.0).
"""

from __future__ import annotations

import pytest

from ascend_layerwise_patch.registry import APPLIED
from support import PAIR, group_states

PAIRS = ("v0300",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from harness_pool import PoolInstance, differing_tokens, engine_loop, groups_skipped, make_pool, reference_outputs  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

A = list(range(1000, 1040))
TAIL = [7, 8, 9, 10, 11]
BALANCE = {"scheduler_config": {"enable_balance_scheduling": True}}


def _row(balance: bool):
    """(wrong GDN reads, GDN reads, what they found, B's tokens that differ from a run without the
    pool) of B's first step."""
    inst = PoolInstance(make_pool(), name="A", additional_config=BALANCE if balance else None)
    assert inst.scheduler._balance_enabled == balance
    prompts = {"a": A, "b": A[:16] + TAIL}
    for req_id, prompt in prompts.items():
        inst.add_request(req_id, prompt)
        engine_loop(inst)
    reads = inst.reads_of("b", step=inst.first_step_of("b"))
    differ = differing_tokens(inst.outputs, reference_outputs({"b": prompts["b"]}))
    return sum(not r.ok for r in reads), len(reads), sorted({(r.expected, r.actual) for r in reads}, key=str), differ


def _rows(skip: str | None) -> dict:
    with groups_skipped(*filter(None, [skip])):
        return {balance: _row(balance) for balance in (True, False)}


def test_mamba_local_hit_applies():
    assert group_states("mamba_local_hit") == {APPLIED}


def test_balance_scheduling_local_hit_keeps_its_mamba_state():
    off = _rows("mamba_local_hit")
    on = _rows(None)
    print(f"\nmamba_local_hit off: balance {off[True]}, plain {off[False]}\nmamba_local_hit on:  balance {on[True]}, plain {on[False]}")
    # both GDN layers read a state nobody cached at 16 tokens: B samples a wrong token
    assert (off[True][:2], off[True][3]) == ((2, 2), 1)
    assert (on[True][:2], on[True][3]) == ((0, 2), 0)
    assert (off[False][:2], off[False][3]) == (on[False][:2], on[False][3]) == ((0, 2), 0)  # vLLM 0.30's own path
