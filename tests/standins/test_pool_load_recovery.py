"""Issue 25 follow-up (f), vllm-ascend 0.30.0rc2 + vLLM 0.30.0: a failed hybrid pool load costs time only
(``pool_load_recovery``, ``pool_load_recovery_policy``).

Instance A fills the pool with two 40-token prompts; instance B (policy ``recompute``) asks for two
requests b1 / b2, each a 32-token pool hit (2 blocks of 16) and 24 tokens after it, and pool keys
are evicted between B's schedule and its load (all keys, only the GDN group's, only the attention
group's, only b1's prefix, or at TP 2 only rank 1's), or B's first GDN load copy returns an error or
raises. Library off (the groups skipped; test_pool_load_failure_upstream.py pins the rest):
the worker raises and the engine ends. Library on: every request finishes with the tokens of a run
without a pool hit, no token of the failed step is delivered, nothing read after the failed step is
wrong, no GDN state is written into the null block, no key the failed step saved is ready, every
read lease is released, and a request c with b1's prompt as prefix, run on B afterwards, reads
nothing stale. On the pool harness (tests/standins/harness_pool), v0300 only.
"""

from __future__ import annotations

import pytest

from support import PAIR

PAIRS = ("v0300",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from byte_store import G2L  # noqa: E402
from harness_pool import PoolInstance, engine_loop, make_pool  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

A1 = list(range(1000, 1040))
A2 = list(range(2000, 2040))
TWO = {"b1": A1[:32] + list(range(7, 31)), "b2": A2[:32] + list(range(40, 64))}
#: async scheduling: B prefills in 16-token chunks, so the step after the failed one (scheduled before the
#: failure is known: 48..64) saves a full block (32..48) computed on the state that was never loaded
TWO_ASYNC = {"b1": A1[:32] + list(range(7, 39)) + [1, 2], "b2": A2[:32] + list(range(40, 72)) + [3, 4]}
C = TWO["b1"] + list(range(300, 310))  # b1's prompt as prefix: a local hit on B after the failure
C_ASYNC = TWO_ASYNC["b1"] + list(range(300, 310))
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    inst = PoolInstance(None, name="reference")
    prompts = {**TWO, "c": C, **{f"{r}-async": p for r, p in TWO_ASYNC.items()}, "c-async": C_ASYNC}
    reqs = [inst.add_request(r, p, max_tokens=MAX_TOKENS) for r, p in prompts.items()]
    engine_loop(inst)
    return {r.request_id: list(r.output_token_ids) for r in reqs}


class Run:
    """A fills the pool (a1 then a2); B runs b1 and b2 with ``evict`` keys gone after its first
    schedule: "all", "gdn", "attn" (one group's keys of both prefixes) or "b1" (b1's prefix only)."""

    def __init__(self, evict: str, policy: str = "recompute", scheduling: str = "sync", tp: int | None = None):
        # "rank1": TP 2 (or ``tp``), only rank 1's GDN keys evicted (the other ranks load); "copy1": only
        # rank 1's first GDN load copy returns an error
        tp = tp or (2 if evict in ("rank1", "copy1") else 1)
        self.tp = tp
        self.asy = asy = scheduling == "async"
        self.prompts = TWO_ASYNC if asy else TWO
        self.computed_on_failure = 2 if asy else 1  # batches computed before the failure is known
        self.pool = pool = make_pool()
        a = PoolInstance(pool, name="A", tp=tp)
        a.add_request("a1", A1)
        engine_loop(a)
        a1_keys = set(pool.blobs)
        a.add_request("a2", A2)
        engine_loop(a)
        self.b = b = PoolInstance(
            pool, name="B", kv_load_failure_policy=policy, async_scheduling=asy, long_prefill_token_threshold=16 if asy else 0, tp=tp
        )
        gdn = str(b.group_of[b.gdn_layers[0]])
        match = {
            "all": lambda key: True,
            "gdn": lambda key: key.split("@")[1] == gdn,
            "attn": lambda key: key.split("@")[1] != gdn,
            "b1": lambda key: key in a1_keys,
            "rank1": lambda key: key.endswith(f"@1tp{tp}") and key.split("@")[1] == gdn,
            "copy": None,  # nothing evicted: the first GDN load copy returns an error
            "copy1": None,  # ... of rank 1
            "raise": None,  # ... or raises
        }[evict]
        self.fault = None
        if match is None:
            rank = f"@1tp{tp}" if evict == "copy1" else ""
            self.fault = pool.add_fault(
                "raise" if evict == "raise" else "error",
                direction=G2L,
                times=1,
                match=lambda key: key.split("@")[1] == gdn and key.endswith(rank),
            )
        self.evicted: list[str] = []
        self.before = {}
        self.failed_step_keys: list[str] = []
        self.after_failed_step: dict[str, int] = {}

        def after_schedule(inst, so):
            if inst.steps == 0:
                self.evicted.extend(pool.evict(match) if match is not None else ())
                self.before = dict(pool.blobs)

        def on_step(inst, so):
            if inst.steps == self.computed_on_failure and not self.after_failed_step:
                self.failed_step_keys = [k for k, blob in pool.blobs.items() if self.before.get(k) is not blob]
                self.after_failed_step = {r.request_id: len(r.output_token_ids) for r in self.reqs}

        b.after_schedule = after_schedule
        self.reqs = [b.add_request(r, p, max_tokens=MAX_TOKENS) for r, p in self.prompts.items()]
        engine_loop(b, on_step=on_step)
        self.tokens = {r.request_id: list(r.output_token_ids) for r in self.reqs}

    def wrong_after_failed_step(self) -> list:
        """B's reads after the failed step (the failed step's own output is never delivered)."""
        return [r for kind in ("gdn", "attn") for r in self.b.wrong_reads(kind=kind) if r.step >= self.computed_on_failure]

    def ready_failed_step_keys(self) -> list[str]:
        return [k for k in self.failed_step_keys if self.pool.blobs.get(k) is not None and self.pool.blobs[k].state == "ready"]

    def leases(self) -> int:
        return sum(blob.leases for blob in self.pool.blobs.values())

    def then_c(self) -> list:
        """c (b1's prompt + 10) after the failure on B (a local hit of b1's blocks) and on a new
        instance D (a pool hit of what B saved): their wrong reads."""
        prompt = C_ASYNC if self.asy else C
        req = self.b.add_request("c", prompt, max_tokens=MAX_TOKENS)
        engine_loop(self.b)
        self.d = d = PoolInstance(self.pool, name="D", tp=self.tp)
        req_d = d.add_request("c", prompt, max_tokens=MAX_TOKENS)
        engine_loop(d)
        self.tokens["c"] = list(req.output_token_ids)
        self.tokens["c-d"] = list(req_d.output_token_ids)
        assert d.reads_of("c", step=0)  # D computed c (a pool hit or not)
        return [r for inst in (self.b, d) for kind in ("gdn", "attn") for r in inst.wrong_reads("c", kind=kind)]


@pytest.mark.parametrize(
    "evict,scheduling", [("all", "sync"), ("gdn", "sync"), ("attn", "sync"), ("all", "async"), ("copy", "sync"), ("copy", "async"), ("raise", "sync"),
     ("rank1", "sync")]
)
def test_an_eviction_before_the_load_is_recomputed(reference, evict, scheduling):
    from ascend_layerwise_patch.patches.pool_load_recovery import worker

    dropped = worker.counters()["saves_dropped"]
    run = Run(evict, scheduling=scheduling)
    dropped = worker.counters()["saves_dropped"] - dropped
    b = run.b
    sfx = "-async" if run.asy else ""
    failed = ["b1"] if evict == "b1" else ["b1", "b2"]
    assert run.evicted or run.fault.hits == 1
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in run.reqs), [r.status for r in run.reqs]
    assert run.tokens == {r: reference[r + sfx] for r in TWO}  # as a run without a pool hit
    assert [run.after_failed_step[r] for r in failed] == [0] * len(failed)  # the failed step's token dropped
    assert all(r.num_preemptions == (r.request_id in failed) for r in run.reqs)
    assert run.wrong_after_failed_step() == [] and b.null_writes == []
    assert run.ready_failed_step_keys() == [] and run.leases() == 0
    assert bool(dropped) == run.asy  # async: the step in flight had saves (the load step saves nothing in 0.30)
    assert run.then_c() == [] and run.tokens["c"] == run.tokens["c-d"] == reference["c" + sfx]
    wrong0 = [r for kind in ("gdn", "attn") for r in b.wrong_reads(kind=kind) if r.step < run.computed_on_failure]
    print(f"\n{evict} {scheduling}: {len(run.evicted)} keys evicted, {run.fault.hits if run.fault else 0} copies failed; failed-step reads discarded: {len(wrong0)} wrong; after it: "
          f"{len(run.wrong_after_failed_step())} wrong of {len(b.reads_of()) + len(b.reads_of(kind='attn'))}; "
          f"null writes {len(b.null_writes)}; failed-step keys {len(run.failed_step_keys)}, ready {len(run.ready_failed_step_keys())}")


def test_under_fail_only_the_failed_request_ends(reference):
    run = Run("b1", policy="fail")
    status = {r.request_id: r.status for r in run.reqs}
    assert status == {"b1": RequestStatus.FINISHED_ERROR, "b2": RequestStatus.FINISHED_LENGTH_CAPPED}
    assert run.tokens["b1"] == [] and run.tokens["b2"] == reference["b2"]
    assert run.wrong_after_failed_step() == [] and run.b.null_writes == [] and run.leases() == 0
    assert run.then_c() == [] and run.tokens["c"] == run.tokens["c-d"] == reference["c"]


def test_the_async_step_after_a_failed_load_would_publish_its_saves(monkeypatch):
    """Async scheduling: the step after the failed one was scheduled before the failure was known and
    saves a block computed on the unloaded state. With its saves kept (the worker's drop turned off
    here), that block is published: a later pool hit reads it. With the library it saves nothing
    (the all-async case above)."""
    from ascend_layerwise_patch.patches.pool_load_recovery import worker

    monkeypatch.setattr(worker, "_drop_saves", lambda _worker, _request: 0)
    kept = Run("all", scheduling="async")
    wrong = kept.then_c()
    print(f"\nasync, the failed requests' saves kept: {len(kept.ready_failed_step_keys())} keys of the steps computed on "
          f"the failure made ready, c reads {len(wrong)} wrong (library: 0, 0 -- test_an_eviction_..._recomputed[all-async])")
    assert kept.ready_failed_step_keys() and wrong


@pytest.mark.parametrize("release", ["library", "upstream"])
def test_a_failed_request_releases_no_lease_another_request_of_the_step_holds(reference, monkeypatch, release):
    """b1 (a 32-token hit: the GDN state at 32 + attention blocks 0, 1) and b2 (a 16-token hit: the GDN
    state at 16 + attention block 0) share attention block 0's key in one step; b1's attention block 1
    key is evicted (its load keys are leased group by group: GDN, then attention). Upstream releases every key b1 leased before raising, b2's shared one included, and keeps
    its result in the step's lease cache, so b2 copies it unleased and releases it once more
    (``PoolService.over_releases``; "upstream": the library's report with upstream's releases); the
    library re-leases such a key for b2. Either way b2 loads and finishes right, b1 is recomputed."""
    from ascend_layerwise_patch.patches.pool_load_recovery import worker

    if release == "upstream":
        monkeypatch.setattr(worker._HeldReleases, "batch_remove_lease", lambda self, keys: self._store.batch_remove_lease(keys))
    pool = make_pool()
    a = PoolInstance(pool, name="A")
    a.add_request("a1", A1)  # attention blocks 0, 1 and the GDN state at 32
    engine_loop(a)
    first = set(pool.blobs)
    a0 = PoolInstance(pool, name="A0")  # no hit (no state at 16 yet): saves the GDN state at 16
    a0.add_request("a0", A1[:20])
    engine_loop(a0)
    b = PoolInstance(pool, name="B", kv_load_failure_policy="recompute")
    gdn = str(b.group_of[b.gdn_layers[0]])
    (state_16,) = set(pool.blobs) - first
    block_0 = state_16.split("@")[2]
    attn_1 = {k for k in first if k.split("@")[1] != gdn and k.split("@")[2] != block_0}
    b.after_schedule = lambda inst, so: pool.evict(lambda key: key in attn_1) if inst.steps == 0 else None
    b1 = b.add_request("b1", TWO["b1"], max_tokens=MAX_TOKENS)
    b2 = b.add_request("b2", A1[:16] + list(range(500, 520)), max_tokens=MAX_TOKENS)
    engine_loop(b)
    assert len(attn_1) == 1 and b.reads_of("b2", step=0)  # b2 loaded its hit in the failed step
    assert (b1.num_preemptions, b2.num_preemptions) == (1, 0)
    assert list(b1.output_token_ids) == reference["b1"] and len(b2.output_token_ids) == MAX_TOKENS
    assert b.wrong_reads("b2") == [] and b.wrong_reads("b2", kind="attn") == []
    assert [r for kind in ("gdn", "attn") for r in b.wrong_reads("b1", kind=kind) if r.step >= 1] == []
    assert sum(blob.leases for blob in pool.blobs.values()) == 0
    if release == "upstream":
        assert pool.over_releases  # attention block 0's key, released for b1 while b2 still copied it
    else:
        assert pool.over_releases == []


def test_async_scheduling_across_ranks_keeps_upstreams_stop_without_the_agreement():
    """TP 2 with async scheduling, ``pool_load_agreement`` skipped: the step in flight when rank 1's
    load fails saves on rank 0 too, and rank 0 cannot know (its layers computed on rank 1's unloaded
    state through the all-reduce): the library does not recover there and vllm-ascend's stop stays --
    on rank 1 only. With the ranks as processes (as vLLM runs them) that stop is a hang on rank 0: it
    waits in the layer's all-reduce for a rank that will never enter it (here until the harness's
    gloo timeout; on an NPU, HCCL's operator timeout, then the RPC timeout). Issue 32; with the
    agreement: test_pool_load_agreement.py."""
    import rank_procs
    from ascend_layerwise_patch.patches.pool_load_recovery import AGREEMENT_GROUP, worker
    from harness_pool import groups_skipped

    with groups_skipped(AGREEMENT_GROUP), pytest.raises(rank_procs.RankFailure) as failure:
        Run("rank1", scheduling="async")
    text = str(failure.value)
    rank0, _, rank1 = text.partition("--- rank 1 raised:")
    assert worker.FAIL_FAST in rank1  # rank 1 stops (vllm-ascend's own raise)
    assert "--- rank 0 raised:" in rank0 and "all_reduce" in rank0 and "Timed out" in rank0  # rank 0 hangs in the collective


# ------------------------------------------------ a local hit in the step in flight (issue 32 §3)
def _in_flight_hit(layer: str, tp: int) -> dict:
    """Async scheduling: b's first GDN (or attention) load copy returns an error (at TP 2 on rank 1
    only); d, with b's first 48 tokens, arrives while the failed step is still in the batch queue and
    is scheduled in the step in flight with a local hit on b's blocks. c on a third instance then
    asks d's prompt plus 16 tokens."""
    from harness_pool import reference_outputs

    pool = make_pool()
    a = PoolInstance(pool, name="A", tp=tp)
    try:
        a.add_request("a1", A1)
        engine_loop(a)
    finally:
        a.close()
    b = PoolInstance(pool, name="B", tp=tp, kv_load_failure_policy="recompute", long_prefill_token_threshold=16, async_scheduling=True)
    group = str(b.group_of[(b.attn_layers if layer == "attn" else b.gdn_layers)[0]])
    rank = f"@1tp{tp}" if tp > 1 else ""
    pool.add_fault("error", direction=G2L, times=1, match=lambda key: key.split("@")[1] == group and key.endswith(rank))
    b_prompt = A1[:32] + list(range(7, 39)) + [1, 2]
    d_prompt = b_prompt[:48] + [9, 9, 9]
    b.add_request("b", b_prompt, max_tokens=MAX_TOKENS)
    d: list = []

    def after(inst, _so):
        if inst.steps == 1 and not d:  # the failed batch ran; its output is still queued
            d.append(inst.add_request("d", d_prompt, max_tokens=2))

    try:
        engine_loop(b, on_step=after)
    finally:
        b.close()
    c = PoolInstance(pool, name="C", tp=tp)
    try:
        c.add_request("c", d_prompt + list(range(7000, 7016)), max_tokens=1)
        engine_loop(c)
    finally:
        c.close()
    return dict(
        reference=reference_outputs({"d": d_prompt}, max_tokens=2)["d"],
        tokens=list(d[0].output_token_ids),
        preempted=d[0].num_preemptions,
        wrong=[r for kind in ("gdn", "attn") for r in b.wrong_reads("d", kind=kind) if r.step >= 2],  # after the step in flight
        wrong_c=[r for kind in ("gdn", "attn") for r in c.wrong_reads("c", kind=kind)],
    )


@pytest.mark.parametrize("tp", [1, 2])
def test_same_prefix_in_the_step_in_flight_is_rolled_back_with_it(monkeypatch, tp):
    """The scheduler preempts d with b (``_failed_load.sharing_requests``, shared with 0.25's rollback):
    d's tokens are those of a run without the pool and nothing it reads later is wrong. Only that
    change off: vLLM rolls back b alone, d keeps computing on the state b computed from the unloaded
    one (a GDN failure: d holds none of the invalid blocks, only blocks computed from them)."""
    from ascend_layerwise_patch.patches import _failed_load

    on = _in_flight_hit("gdn", tp)
    assert on["preempted"] == 1 and on["tokens"] == on["reference"]
    assert on["wrong"] == [] and on["wrong_c"] == []
    monkeypatch.setattr(_failed_load, "sharing_requests", lambda *_a: [])
    off = _in_flight_hit("gdn", tp)
    differ = sum(x != y for x, y in zip(off["tokens"], off["reference"]))
    print(f"\nsharing off, tp{tp} async, GDN load failed, d arrives in flight: {len(off['wrong'])} wrong reads of d later, "
          f"{differ} of its 2 tokens differ, preempted {off['preempted']}; c {len(off['wrong_c'])} wrong reads")
    assert off["preempted"] == 0 and off["wrong"] and differ > 0
