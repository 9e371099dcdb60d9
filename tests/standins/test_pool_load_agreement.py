"""Issue 32 on vllm-ascend 0.30.0rc2 + vLLM 0.30.0 (``pool_load_agreement``): a failed pool load on ONE
TP rank under async scheduling is recovered on every rank -- no stop, no hang -- and nothing computed
on it is published by any rank. The scenario is ``test_pool_load_recovery.Run`` (A fills the pool
with two prompts, B asks b1 / b2 with a 32-token hit each) at TP 2 / TP 4 with 2 KV heads, ranks as
processes with a real gloo TP group: rank 1's GDN keys are evicted between B's schedule and its load
(``rank1``) or rank 1's first GDN load copy returns an error (``copy1``).
"""

from __future__ import annotations

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.registry import APPLIED

from support import PAIR

PAIRS = ("v0300",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from ascend_layerwise_patch.patches import pool_load_recovery  # noqa: E402
from test_pool_load_recovery import TWO, Run, reference  # noqa: E402,F401  (fixture)
from vllm.v1.request import RequestStatus  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)


def _counts(rank) -> dict:
    return dict(rank=rank.rank, **pool_load_recovery.agreement.COUNTS.snapshot())


def test_pool_load_agreement_applies():
    states = {st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.group == pool_load_recovery.AGREEMENT_GROUP}
    assert states == {APPLIED}


CASES = [("rank1", 2), ("copy1", 2), ("rank1", 4), ("copy1", 4)]


@pytest.mark.parametrize("evict,tp", CASES, ids=[f"{e}-tp{t}" for e, t in CASES])
def test_async_failed_load_on_one_rank_is_recovered_on_every_rank(reference, evict, tp):
    run = Run(evict, scheduling="async", tp=tp)
    try:
        counts = run.b.on_ranks(_counts)
    finally:
        run.b.close()
    print(f"\n{evict} tp{tp} async: {len(run.evicted)} keys evicted, {run.fault.hits if run.fault else 0} copies failed; "
          f"per rank {counts}; failed-step keys {len(run.failed_step_keys)}, ready {len(run.ready_failed_step_keys())}; "
          f"wrong reads after the failed step {len(run.wrong_after_failed_step())}")
    assert run.evicted or run.fault.hits == 1
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in run.reqs), [r.status for r in run.reqs]
    assert run.tokens == {r: reference[r + "-async"] for r in TWO}  # as a run without the pool hit
    assert run.wrong_after_failed_step() == [] and run.b.null_writes == []
    assert run.ready_failed_step_keys() == [] and run.leases() == 0
    assert sum(c["failed_elsewhere"] > 0 for c in counts) == tp - 1, counts  # every other rank learnt it


@pytest.mark.parametrize("tp", [2, 4])
def test_without_the_agreement_a_recovery_would_publish_the_step_in_flight(reference, monkeypatch, tp):
    """``pool_load_agreement`` skipped and the recovery forced on anyway (``worker.recovers``, read in
    the rank processes): rank 1 recovers, but the other ranks never learn of the failure; the step
    in flight (scheduled before the failure was known, computed on rank 1's unloaded state through
    the all-reduce) saves on them, and those keys are published: c on a new instance reads them."""
    from harness_pool import groups_skipped

    monkeypatch.setattr(pool_load_recovery.worker, "recovers", lambda _worker: True)
    with groups_skipped(pool_load_recovery.AGREEMENT_GROUP):
        run = Run("rank1", scheduling="async", tp=tp)
        try:
            wrong = run.then_c()
        finally:
            run.b.close()
            run.d.close()
    ready = {}
    for key in run.ready_failed_step_keys():
        ready[key.rsplit("@", 1)[1]] = ready.get(key.rsplit("@", 1)[1], 0) + 1
    wrong_by_rank = {}
    for r in wrong:
        wrong_by_rank[(r.instance, r.rank)] = wrong_by_rank.get((r.instance, r.rank), 0) + 1
    differ = sum(x != y for x, y in zip(run.tokens["c-d"], reference["c-async"]))
    print(f"\nagreement off, recovery forced, rank1 tp{tp} async: ready keys of the steps computed on the failure by "
          f"suffix {dict(sorted(ready.items()))}; c's wrong reads by (instance, rank) {dict(sorted(wrong_by_rank.items()))}; "
          f"{differ} of D's c tokens differ")
    assert ready and (wrong or differ)
