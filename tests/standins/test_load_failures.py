"""Layerwise loads that fail, raise or stay blocked: vLLM is told in the same step, and recomputes.

Harness: tests/standins/harness_pool (``PoolInstance``: vLLM's real Scheduler with its
``kv_load_failure_policy``, the AscendStore connector halves from KVConnectorFactory, the real layer
receiving thread, a byte-level MemCache whose copies can be made to fail, raise or block). Instance
A fills the pool; instance B hits its first 32 tokens for request "b" while request "c" (no hit)
runs in the same batch. Every block value names its content, so a layer that computes on a block
that was never loaded reads a wrong value (``PoolInstance.wrong_reads``).
"""

from __future__ import annotations


import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.patches import load_failures
from ascend_layerwise_patch.patches import _failed_load
from ascend_layerwise_patch.registry import APPLIED, SKIPPED

from support import PAIR, activate_skipping

PAIRS = ("v0251",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from byte_store import G2L  # noqa: E402
from harness_pool import PoolInstance, differing_tokens, engine_loop, make_pool  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

PROMPT = list(range(3000, 3040))
B_PROMPT = PROMPT[:32] + [7, 8, 9, 10, 11]  # pool hit: 32 tokens, 2 blocks of each group
C_PROMPT = list(range(5000, 5021))  # nothing in the pool
MAX_TOKENS = 3  # two decode steps after the prefill read every state the prefill left
_NAMES = {s.name for s in load_failures.SPECS if s.group == load_failures.GROUP}


def _set(on: bool) -> None:
    """The whole library, with (on) or without (off) this group."""
    reg = activate_skipping() if on else activate_skipping(load_failures.GROUP)
    if not on:
        assert {st.state for st in reg.status() if st.name in _NAMES} == {SKIPPED}, reg.status()


def test_load_failures_applies(library):
    """The group's state, on its own (the defect tests run as configured)."""
    library(True)
    assert {st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.name in _NAMES} == {APPLIED}


@pytest.fixture
def library():
    yield _set
    _set(True)


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    """The tokens of a run without any pool (vLLM's own prefix caching only)."""
    inst = PoolInstance(None, name="control")
    reqs = [inst.add_request(r, p, max_tokens=MAX_TOKENS) for r, p in (("b", B_PROMPT), ("c", C_PROMPT))]
    engine_loop(inst)
    assert inst.wrong_reads() == [] and inst.wrong_reads(kind="attn") == []
    return {r.request_id: list(r.output_token_ids) for r in reqs}


class Run:
    def __init__(self, policy: str, fault: str, layer: str = "gdn", *, release_gate_after_first_step: bool = False):
        """``fault`` hits the first load of B that reads a key of ``layer``'s group (gdn / attn)."""
        self.pool = make_pool()
        a = PoolInstance(self.pool, name="A")
        a.add_request("a", PROMPT, max_tokens=1)
        engine_loop(a)
        self.b = b = PoolInstance(self.pool, name="B", kv_load_failure_policy=policy)
        group = str(b.group_of[(b.gdn_layers if layer == "gdn" else b.attn_layers)[0]])
        self.fault = self.pool.add_fault(fault, direction=G2L, times=1, match=lambda key: key.split("@")[1] == group)
        self.free_at_start = b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        self.req_b = b.add_request("b", B_PROMPT, max_tokens=MAX_TOKENS)
        self.req_c = b.add_request("c", C_PROMPT, max_tokens=MAX_TOKENS)
        self.loaded_blocks: set[int] = set()

        def after(inst, _so):
            if inst.steps == 1:
                ids = inst.ranks[0].requests["b"].block_ids
                self.loaded_blocks = {ids[g][i] for g in range(len(ids)) for i in range(32 // inst.block_size)} - {0}
                if release_gate_after_first_step:
                    self.fault.gate.set()

        engine_loop(b, on_step=after)

    def tokens(self) -> dict[str, list[int]]:
        """What the scheduler delivered (a rolled-back step's tokens are discarded there)."""
        return {r.request_id: list(r.output_token_ids) for r in (self.req_b, self.req_c)}

    def reported(self) -> list[set[int]]:
        return [set(o.invalid_block_ids) if o is not None else set() for o in self.b.kv_outputs]

    def wrong_after_first_step(self, req_id: str) -> list:
        return [r for kind in ("gdn", "attn") for r in self.b.wrong_reads(req_id, kind=kind) if r.step > 0]

    def check_clean_end(self) -> None:
        assert not self.b.has_work()
        assert self.pool.violations == []
        assert all(blob.leases == 0 for blob in self.pool.blobs.values())  # every read lease released
        assert self.b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == self.free_at_start  # no leak


@pytest.mark.parametrize("fault,layer", [("error", "gdn"), ("raise", "gdn"), ("error", "attn")])
def test_failed_load_is_reported_and_recomputed(library, expected, fault, layer):
    library(True)
    run = Run("recompute", fault, layer)
    assert run.fault.hits == 1
    reported = run.reported()
    # the scheduler learns it in the same step, for every block the load should have written
    assert reported[0] and reported[0] <= run.loaded_blocks and all(not r for r in reported[1:])
    assert any(b in reported[0] for b in run.loaded_blocks)
    # b was rolled back and recomputed: everything it read afterwards is right; c never noticed
    assert run.wrong_after_first_step("b") == []
    assert run.b.wrong_reads("c") == [] and run.b.wrong_reads("c", kind="attn") == []
    assert run.tokens() == expected
    assert run.req_b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    run.check_clean_end()


def test_failed_load_with_fail_policy_ends_only_that_request(library, expected):
    library(True)
    run = Run("fail", "error")
    assert run.reported()[0]
    assert run.req_b.status == RequestStatus.FINISHED_ERROR
    assert run.req_c.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert run.tokens()["c"] == expected["c"] and run.b.wrong_reads("c") == []
    run.check_clean_end()


def test_blocked_load_times_out_and_is_recomputed(library, expected, monkeypatch):
    library(True)
    monkeypatch.setattr(_failed_load, "WAIT_S", 0.3)  # upstream's 10 s, shortened for the test
    run = Run("recompute", "gate", release_gate_after_first_step=True)
    reported = run.reported()
    assert reported[0] and reported[0] <= run.loaded_blocks
    assert run.wrong_after_first_step("b") == [] and run.b.wrong_reads("c") == []
    assert run.tokens() == expected
    run.check_clean_end()


def test_unpatched_computes_on_unloaded_blocks(library, expected):
    """vllm-ascend as released (this group off): nothing is reported, b computes on garbage."""
    library(False)
    run = Run("fail", "error", "attn")  # with the group off, vllm-ascend refuses recompute for hybrids
    assert run.fault.hits == 1
    assert all(not r for r in run.reported())  # the hybrid request's failure is never reported
    first = [r for r in run.b.wrong_reads("b", kind="attn") if r.step == 0]
    later = [r for r in run.b.wrong_reads("b", kind="attn") if r.step > 0]
    assert first and all(r.actual == "zero" for r in first)  # attention over blocks never loaded
    assert later  # and never recomputed: every later step reads them too
    assert run.req_b.status == RequestStatus.FINISHED_LENGTH_CAPPED  # delivered as if all was well
    differ = differing_tokens(run.tokens(), {"b": expected["b"]})
    print(f"\nunpatched, attention load error: {len(first)} wrong attention block reads of b in the failed "
          f"step, {len(later)} in the {run.b.steps - 1} steps after it; 0 blocks reported; "
          f"{differ} of b's {len(expected['b'])} tokens differ from a run without the pool")
    assert differ == len(expected["b"])  # every token it delivered was computed on blocks never loaded


@pytest.mark.parametrize("reload", [False, True], ids=["no-reload", "change-off"])
def test_a_store_that_keeps_failing_costs_one_recompute(library, expected, reload):
    """Every load of the GDN group's keys fails, for good. Under ``recompute`` b is rolled back once,
    resumes from its local hits without asking the pool again, and finishes with the tokens of a
    run without the pool. Control (``change-off``: the request's no-reload mark dropped after every
    step, as before ``load_fail_no_reload``): b asks the pool at every resume, fails again and is
    preempted again -- it never finishes."""
    library(True)
    pool = make_pool()
    a = PoolInstance(pool, name="A")
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    b = PoolInstance(pool, name="B", kv_load_failure_policy="recompute")
    group = str(b.group_of[b.gdn_layers[0]])
    fault = pool.add_fault("error", direction=G2L, match=lambda key: key.split("@")[1] == group)
    req_b = b.add_request("b", B_PROMPT, max_tokens=MAX_TOKENS)
    req_c = b.add_request("c", C_PROMPT, max_tokens=MAX_TOKENS)

    def after(_inst, _so):
        if reload:
            req_b.__dict__.pop(load_failures._NO_RELOAD, None)

    steps = engine_loop(b, max_steps=30, on_step=after)
    print(f"\npool keeps failing, {'change off' if reload else 'on'}: {fault.hits} failed loads in {steps} steps, "
          f"b {'unfinished' if b.has_work() else 'finished'}")
    if reload:
        assert b.has_work() and fault.hits >= 5 * len(b.gdn_layers) and not req_b.is_finished()
    else:
        assert not b.has_work() and fault.hits == len(b.gdn_layers)  # one failed step: a copy per GDN layer
        assert {r.request_id: list(r.output_token_ids) for r in (req_b, req_c)} == expected
        assert b.wrong_reads("c") == []


def test_recompute_for_a_hybrid_is_refused_without_the_group_and_allowed_with_it(library):
    """``load_fail_policy`` lifts vllm-ascend's refusal of ``recompute`` for hybrid models only while
    ``load_failures`` is in force (read through the registry's context, not by importing it)."""
    library(False)  # load_failures skipped: its policy group stays applied but reads the group's state
    with pytest.raises(Exception) as refused:
        PoolInstance(make_pool(), name="refused", kv_load_failure_policy="recompute")
    assert "recompute" in str(refused.value) or "hybrid" in str(refused.value).lower(), refused.value
    library(True)
    inst = PoolInstance(make_pool(), name="allowed", kv_load_failure_policy="recompute")
    assert inst.configs[0].kv_transfer_config.kv_load_failure_policy == "recompute"
