"""Issue 32 on vllm-ascend 0.30.0rc2 + vLLM 0.30.0 (``pool_load_wait_bound``): a layerwise pool load copy
that never returns is reported after the bound and recovered, instead of hanging the engine.

Instance A fills the pool with three 40-token prompts; instance B (TP 2, 2 KV heads, async scheduling,
policy ``recompute``, ranks as processes with a real gloo TP group) asks b1 / b2 (a 32-token pool hit
each); rank 1's first GDN load copy blocks on a gate (byte_store's ``gate`` fault) that rank 1 itself
opens once its next step is in the late-copy fence with the copy still out (events, no timer). With
the bound (``WAIT_S`` shortened to 0.3 s): every request finishes with the tokens of a run
without the pool, nothing read after the failed step is wrong, no key saved in the steps computed on
the failure is ready, the next step waits in the late-copy fence until the copy has landed (it never
writes into a block vLLM reused), the receiving thread stays alive, its stale event is cleared, a
request b3 with a pool hit of its own loads and finishes right, and no read lease is left. A copy
that never returns stops both ranks at the fence. With only
``pool_load_wait_bound`` skipped, the failed step never finishes (the harness's reply limit, shortened).
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.registry import APPLIED

from support import PAIR

PAIRS = ("v0300",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

import rank_procs  # noqa: E402
from byte_store import G2L  # noqa: E402
from harness_pool import PoolInstance, differing_tokens, engine_loop, groups_skipped, make_pool, reference_outputs  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from ascend_layerwise_patch.patches import _failed_load, pool_load_recovery  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

A1, A2, A3 = (list(range(n, n + 40)) for n in (1000, 2000, 3000))
#: async scheduling prefills in 16-token chunks (as test_pool_load_recovery's TWO_ASYNC)
TWO = {"b1": A1[:32] + list(range(7, 39)) + [1, 2], "b2": A2[:32] + list(range(40, 72)) + [3, 4]}
B3 = A3[:32] + list(range(80, 100))  # after the gate opens: a pool hit of its own
MAX_TOKENS = 3
TP = 2
FAILED_STEP = 2  # batches computed before the failure is known (async: the failed one and the one in flight)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return reference_outputs({**TWO, "b3": B3}, max_tokens=MAX_TOKENS)


def _state(rank) -> dict:
    worker = rank.connector.connector_worker
    thread = worker.kv_recv_thread
    with thread.request_queue.mutex:
        unfinished = thread.request_queue.unfinished_tasks
    return dict(
        rank=rank.rank,
        unfinished=unfinished,
        fatal=repr(thread._fatal_error) if thread._fatal_error is not None else None,
        alive=thread.is_alive(),
        set_events=[i for i, ev in enumerate(worker.layer_load_finished_events) if ev.is_set()],
        **pool_load_recovery.bound.COUNTS.snapshot(),
        failed_elsewhere=pool_load_recovery.agreement.COUNTS.snapshot()["failed_elsewhere"],
    )


#: the gate of the gated copy: an event the rank processes share (they fork from this process)
_GATE = None
#: in a rank process: per late-copy fence, whether a copy was still out when the fence first looked
FENCES: list[bool] = []


def _fence_opens_the_gate(rank) -> None:
    """In a rank process: the late-copy fence opens the gate after its first look at the receiving
    thread found a copy still out -- so the copy returns only once the step after the failure is
    waiting for it, whatever the machine's speed."""
    fence, idle = _failed_load.late_copy_fence, _failed_load.thread_idle
    first = []

    def thread_idle(thread) -> bool:
        result = idle(thread)
        if first:
            first.clear()
            FENCES.append(not result)
            if not result:
                _GATE.set()
        return result

    def late_copy_fence(worker, thread, wake=None):
        first.append(True)
        try:
            return fence(worker, thread, wake)
        finally:
            first.clear()

    _failed_load.thread_idle, _failed_load.late_copy_fence = thread_idle, late_copy_fence


def _fences(rank) -> list[bool]:
    return list(FENCES)


class GateRun:
    """A fills the pool; B (TP 2, async) runs b1 and b2 with rank 1's first GDN load copy gated;
    ``open_at_fence``: the step after the failure opens it from its late-copy fence."""

    def __init__(self, reply_limit: float | None = None, open_at_fence: bool = False, late_error: bool = False):
        global _GATE
        _GATE = multiprocessing.get_context("fork").Event()  # before B's ranks fork
        self.pool = pool = make_pool()
        a = PoolInstance(pool, name="A", tp=TP)
        try:
            for name, prompt in (("a1", A1), ("a2", A2), ("a3", A3)):
                a.add_request(name, prompt)
                engine_loop(a)
        finally:
            a.close()
        self.b = b = PoolInstance(
            pool, name="B", kv_load_failure_policy="recompute", async_scheduling=True, long_prefill_token_threshold=16, tp=TP
        )
        if reply_limit is not None:
            b.procs.reply_limit = reply_limit
        gdn = str(b.group_of[b.gdn_layers[0]])
        gated = lambda key: key.split("@")[1] == gdn and key.endswith(f"@1tp{TP}")  # noqa: E731
        self.fault = pool.add_fault("gate", direction=G2L, times=1, match=gated)
        self.fault.gate = _GATE
        if open_at_fence:
            b.on_ranks(_fence_opens_the_gate)
        if late_error:  # the same copy, once its gate opens, returns an error
            pool.add_fault("error", direction=G2L, times=1, match=gated)
        self.before: dict = {}
        self.failed_step_keys: list[str] = []

        def after_schedule(inst, so):
            if inst.steps == 0:
                self.before = dict(pool.blobs)

        def on_step(inst, so):
            if inst.steps == FAILED_STEP and not self.failed_step_keys:
                self.failed_step_keys = [k for k, blob in pool.blobs.items() if self.before.get(k) is not blob]

        b.after_schedule = after_schedule
        self.reqs = [b.add_request(r, p, max_tokens=MAX_TOKENS) for r, p in TWO.items()]
        try:
            engine_loop(b, on_step=on_step)
        except BaseException:
            self.fault.gate.set()  # the copy may go (the server thread would hold it GATE_LIMIT_S)
            raise
        self.fences = b.on_ranks(_fences)
        self.tokens = {r.request_id: list(r.output_token_ids) for r in self.reqs}

    def wrong_after_failed_step(self) -> list:
        return [r for kind in ("gdn", "attn") for r in self.b.wrong_reads(kind=kind) if r.step >= FAILED_STEP]

    def ready_failed_step_keys(self) -> list[str]:
        return [k for k in self.failed_step_keys if self.pool.blobs.get(k) is not None and self.pool.blobs[k].state == "ready"]

    def leases(self) -> int:
        return sum(blob.leases for blob in self.pool.blobs.values())

    def states_when_idle(self, limit_s: float = 10.0) -> list[dict]:
        deadline = time.monotonic() + limit_s
        while True:
            states = self.b.on_ranks(_state)
            if all(s["unfinished"] == 0 for s in states) or time.monotonic() > deadline:
                return states
            time.sleep(0.05)


def test_pool_load_wait_bound_applies():
    states = {st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.group == pool_load_recovery.WAIT_BOUND_GROUP}
    assert states == {APPLIED}


@pytest.mark.parametrize("late", ["returns", "fails"])
def test_a_late_copy_is_reported_after_the_bound_recovered_and_fenced(reference, monkeypatch, late):
    """The gate opens only from the next step's late-copy fence: the wait gives up after 0.3 s, the
    requests are rolled back, and the next step waits in the late-copy fence (both ranks: the
    agreement told rank 0) until the copy has returned, before it computes. ``fails``: the late copy returns an
    error, as it does on the real MemCache 1.2.0 (its read lease was released when the wait gave up:
    -3102); the receiving thread must go on (it used to raise: the fence then stopped the engine)."""
    monkeypatch.setattr(_failed_load, "WAIT_S", 0.3)  # the shared 10 s bound, read in the rank processes (forked later)
    run = GateRun(open_at_fence=True, late_error=late == "fails")
    b = run.b
    try:
        after = run.states_when_idle()
        assert run.fault.hits == 1
        assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in run.reqs), [r.status for r in run.reqs]
        assert differing_tokens(run.tokens, {r: reference[r] for r in TWO}) == 0, run.tokens
        assert all(r.num_preemptions == 1 for r in run.reqs)  # both were in the gated batched copy: recomputed
        assert run.wrong_after_failed_step() == [] and b.null_writes == []
        assert run.ready_failed_step_keys() == []  # the steps computed on the failure put no key (dropped on both ranks)
        assert [s["waits_timed_out"] for s in after] == [0, 1], after
        assert after[0]["failed_elsewhere"] > 0, after  # rank 0 learnt it (agreement)
        # one fence per rank, in the step after the failure: rank 1's copy was still out (the fence
        # then waited until it returned); rank 0 had none out and went on at once
        assert run.fences == [[False], [True]], run.fences
        assert [s["late_copies_fenced"] for s in after] == [0, 1], after
        assert all(s["unfinished"] == 0 and s["alive"] and s["fatal"] is None for s in after), after
        assert run.leases() == 0
        b3 = b.add_request("b3", B3, max_tokens=MAX_TOKENS)
        engine_loop(b)
        end = b.on_ranks(_state)
        assert b3.status == RequestStatus.FINISHED_LENGTH_CAPPED and list(b3.output_token_ids) == reference["b3"]
        assert b3.num_preemptions == 0  # A3's blocks (B never computed them): its GDN state at 32 loaded from the pool
        assert any(r.expected == 32 and r.ok for r in b.reads_of("b3")), b.reads_of("b3")
        assert b.wrong_reads("b3") == [] and b.wrong_reads("b3", kind="attn") == []
        assert end[1]["stale_events_cleared"] >= 1 and end[1]["waits_timed_out"] == 1, end
        assert all(s["alive"] and s["fatal"] is None for s in end), end
        assert run.leases() == 0
    finally:
        run.fault.gate.set()
        b.close()
    print(f"\nwait bound 0.3 s, rank 1's GDN copy back once its fence waited, tp{TP} async: fences {run.fences}; per rank "
          f"after {after}; end {end}; failed-step keys {len(run.failed_step_keys)}, ready 0; wrong reads after the failed "
          "step 0; leases 0")


def test_a_copy_that_never_returns_stops_every_rank_at_the_fence(monkeypatch):
    """The copy never comes back (the gate stays closed; ``LATE_COPY_S`` shortened to 1 s): the step
    after the failure ends on BOTH ranks with the fence's error -- no hang, no rank left waiting in a
    collective, no write into a block vLLM reused."""
    monkeypatch.setattr(_failed_load, "WAIT_S", 0.3)
    monkeypatch.setattr(_failed_load, "LATE_COPY_S", 1.0)  # read in the rank processes (forked later)
    start = time.monotonic()
    with pytest.raises(rank_procs.RankFailure) as failure:
        GateRun()
    wall = time.monotonic() - start
    text = str(failure.value)
    print(f"\nthe copy never returns: RankFailure after {wall:.1f} s: {text.splitlines()[0]}")
    assert "TP ranks [0, 1] failed" in text, text
    assert text.count("has not returned within 1 s") >= 2, text


def test_without_the_bound_the_failed_step_never_finishes(monkeypatch):
    """``pool_load_wait_bound`` skipped (the rest of the library on): rank 1 waits for its layer
    without end (upstream's ``keep waiting``), rank 0 in the layer's collective behind it: the step
    never comes back (the harness's reply limit, 5 s here; byte_store's gate would let the copy go
    after 30 s, in production nothing does)."""
    start = time.monotonic()
    with groups_skipped(pool_load_recovery.WAIT_BOUND_GROUP), pytest.raises(rank_procs.RankFailure) as failure:
        GateRun(reply_limit=5.0)
    wall = time.monotonic() - start
    text = str(failure.value)
    print(f"\nbound off: RankFailure after {wall:.1f} s: {text.splitlines()[0]} / {text.splitlines()[1]}")
    assert "did not come back within 5 s" in text
    rank1 = text.partition("--- rank 1 is at:")[2]
    assert "wait_for_layer_load" in rank1, text  # rank 1 is in the layer wait
