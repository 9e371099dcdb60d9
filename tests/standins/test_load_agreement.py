"""One rank's failed layerwise load at TP > 1 costs time on every rank, never a poisoned key (issue 32).

The scenario is ``test_load_failures_pool.Run`` at TP 2 / 4 / 8 with 2 KV heads, each rank a process
with a real gloo TP group (``rank_procs``): A fills the pool, B hits 32 tokens and ONE rank's first
GDN load fails (its keys end with that rank's suffix), C then hits the same prefix plus 16 tokens.
At TP 4 rank 1 saves no attention block (put_step 2): its final-layer task is ``gdn_tp_keys``'
synthetic one, with no ranges. The other ranks' loads succeed, but TP's all-reduce carries the
failing rank's damage into their hidden states, so everything B's failed step saved is wrong on
every rank. ``load_failures_agreement`` makes every rank finish those keys as failed.
"""

from __future__ import annotations

import time
import types

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.patches import load_failures
from ascend_layerwise_patch.patches import _failed_load
from ascend_layerwise_patch.registry import APPLIED

from support import PAIR

PAIRS = ("v0251",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

import rank_procs  # noqa: E402
from harness_pool import PoolInstance, differing_tokens, engine_loop, make_pool  # noqa: E402
from test_load_failures_pool import PROMPT, Run, _set, expected, library, rank_suffix  # noqa: E402,F401  (fixtures)
from vllm.v1.request import RequestStatus  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

GROUP = load_failures.AGREEMENT_GROUP


def _counts(rank) -> dict:
    """This rank's agreement counts and the keys its sending thread finished as failed."""
    return dict(rank=rank.rank, **load_failures.agreement.COUNTS.snapshot())


def test_load_agreement_applies(library):
    library("on")
    assert {st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.group == GROUP} == {APPLIED}


def _run(monkeypatch, mode: str, tp: int, rank: int, fault: str, scheduling: str, between: bool = False, store=None) -> Run:
    _set(mode)
    monkeypatch.setattr(_failed_load, "WAIT_S", 0.3)  # read in the rank processes (forked later)
    return Run(fault, scheduling=scheduling, tp=tp, rank=rank, between=between, store=store)


def _summary(run: Run, expected: dict, sfx: str) -> tuple[dict, dict, int]:
    wrong_c: dict[int, int] = {}
    for r in run.wrong_reads_c():
        wrong_c[r.rank] = wrong_c.get(r.rank, 0) + 1
    differ = differing_tokens({"c": list(run.req_c.output_token_ids)}, {"c": expected["c" + sfx]})
    return run.ready_by_suffix(), dict(sorted(wrong_c.items())), differ


#: (TP, failing rank, fault, scheduling): TP 4 over 2 KV heads, a non-saver (rank 1, the issue's
#: case) and a saver (rank 0); TP 2 (every rank saves); TP 8 over 2 KV heads (put_step 4), rank 5
CASES = [
    (4, 1, "error", "sync"),
    (4, 1, "error", "async"),
    (4, 1, "raise", "sync"),
    (4, 0, "error", "async"),
    (4, 0, "raise", "sync"),
    (4, 1, "gate", "async"),  # the wait times out, the copy lands later: every rank passes the fence
    (4, 0, "evict", "sync"),  # the key goes between the hit check and the load
    (2, 1, "error", "async"),
    (8, 5, "error", "async"),
]


@pytest.mark.parametrize("tp,rank,fault,scheduling", CASES, ids=[f"tp{t}-rank{r}-{f}-{s}" for t, r, f, s in CASES])
def test_one_ranks_failed_load_is_dropped_on_every_rank(library, expected, monkeypatch, tp, rank, fault, scheduling):
    run = _run(monkeypatch, "on", tp, rank, fault, scheduling)
    try:
        sfx = "_async" if scheduling == "async" else ""
        assert run.evicted if fault == "evict" else run.fault.hits == 1
        assert run.b.kv_outputs[0].invalid_block_ids  # the failing rank reported it in the failed step
        assert run.failed_step_keys  # the failed step did save, on every rank
        suffixes = {k.rsplit("@", 1)[1] for k in run.failed_step_keys}
        assert {rank_suffix(tp, r)[1:] for r in range(tp)} <= suffixes  # every rank saved GDN keys
        assert run.ready_failed_step_keys() == []  # on no rank
        counts = run.b.on_ranks(_counts)
        print(f"\ntp{tp} rank {rank} {fault} {scheduling}: per rank {counts}")
        assert all(c["keys_dropped"] > 0 for c in counts), counts  # every rank dropped its own keys
        assert sum(c["failed_elsewhere"] > 0 for c in counts) == tp - 1, counts  # learnt by the others
        assert list(run.req_b.output_token_ids) == expected["b" + sfx]
        assert run.req_b.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert run.wrong_reads_b() == []
        ready, wrong_c, differ = _summary(run, expected, sfx)
        assert wrong_c == {} and differ == 0  # C: 0 wrong reads on every rank, the reference tokens
        assert list(run.req_c.output_token_ids) == expected["c" + sfx]
        run.check_clean_end()
    finally:
        run.close()


OFF_CASES = [(4, 1, "error", "sync"), (4, 1, "error", "async"), (4, 0, "error", "async")]


@pytest.mark.parametrize("tp,rank,fault,scheduling", OFF_CASES, ids=[f"tp{t}-rank{r}-{f}-{s}" for t, r, f, s in OFF_CASES])
def test_without_the_agreement_the_other_ranks_publish(library, expected, monkeypatch, tp, rank, fault, scheduling):
    """Only ``load_failures_agreement`` off: the ranks whose loads succeeded publish the failed step's
    keys (and at TP > KV heads a non-saver failing rank its own too), and C computes on them."""
    # on the byte store: on the real MemCache C read right in two of these cases (tp4 rank 1 error
    # sync, tp4 rank 0 error async: the failed step's keys ready, 0 wrong reads) and wrong in the
    # others (12-14 per rank) -- not explained yet; the control needs the defect in every case
    run = _run(monkeypatch, "agreement_off", tp, rank, fault, scheduling, store="bytes")
    try:
        ready, wrong_c, differ = _summary(run, expected, "_async" if scheduling == "async" else "")
    finally:
        run.close()
    print(f"\nagreement off, tp{tp} rank {rank} {fault} {scheduling}: ready poisoned keys by key suffix {ready}; "
          f"C's wrong reads by rank {wrong_c}; {differ} of C's tokens differ")
    others = {s: n for s, n in ready.items() if s != rank_suffix(tp, rank)[1:]}
    assert others and (sum(wrong_c.values()) > 0 or differ > 0)


# --------------------------------------------------------- a rank that fails before the collective
def _raise_at_final_save(rank) -> None:
    """Planted: this rank's worker raises at the final layer's save of a step with a pool load,
    before the agreement (an instance attribute in front of the patched class method)."""
    worker = rank.connector.connector_worker
    patched = type(worker).save_kv_layer

    def save_kv_layer(self, connector_metadata):
        last = self.current_layer == self.num_layers - 1
        if last and any(m.load_spec is not None and m.load_spec.can_load for m in connector_metadata.requests):
            raise RuntimeError("planted: this rank failed before its final layer's save")
        return patched(self, connector_metadata)

    worker.save_kv_layer = types.MethodType(save_kv_layer, worker)


def test_a_rank_failing_before_the_agreement_ends_the_step_on_every_rank(library, monkeypatch):
    library("on")
    monkeypatch.setattr(load_failures.agreement, "AGREE_S", 3.0)  # read in the rank processes
    pool = make_pool()
    a = PoolInstance(pool, name="A", tp=4)
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    a.close()
    b = PoolInstance(pool, name="B", tp=4, kv_load_failure_policy="recompute")
    try:
        b.procs.call(_raise_at_final_save, ranks=[2])
        b.add_request("b", PROMPT[:32] + [1, 2, 3], max_tokens=1)
        start = time.monotonic()
        with pytest.raises(rank_procs.RankFailure) as failure:
            engine_loop(b)
        took = time.monotonic() - start
    finally:
        b.close()
    text = str(failure.value)
    print(f"\nrank 2 raised before the agreement: the step ended on every rank after {took:.1f} s")
    assert "TP ranks [0, 1, 2, 3] failed" in text, text
    # the three healthy ranks ended on the agreement's own 3 s limit (not the gloo group's 15 s, nor a hang)
    assert text.count("did not complete within 3 s") >= 3 and "planted" in text, text


# ------------------------------------------------------- a clean request with the same prefix in between
@pytest.mark.parametrize("mode", ["on", "agreement_off"])
def test_a_clean_request_in_between_leaves_no_mixed_hit(library, expected, monkeypatch, mode):
    """TP 4, rank 1 (a non-saver) fails: d on a fourth instance asks C's prompt before C does. It misses
    what the failed step saved on rank 1 (dropped there) and re-saves it cleanly. Only the agreement
    off: the other ranks' keys of that step stay ready (they exist, so d does not re-save them) and C's
    complete hit mixes rank 1's clean keys with the others' poisoned ones. On: every rank's key of the
    failed step was failed, d re-saved them all, C reads 0 wrong states."""
    run = _run(monkeypatch, mode, 4, 1, "error", "sync", between=True)
    try:
        ready, wrong_c, differ = _summary(run, expected, "")
        wrong_d = run.wrong_d
    finally:
        run.close()
    print(f"\n{mode}, tp4 rank 1 error sync, a clean request in between: ready poisoned keys by suffix {ready}; "
          f"d's wrong reads {len(wrong_d)}; C's wrong reads by rank {wrong_c}; {differ} of C's tokens differ")
    if mode == "on":
        assert ready == {} and wrong_d == [] and wrong_c == {} and differ == 0
        assert list(run.req_d.output_token_ids) == expected["c"]
    else:
        assert ready and (sum(wrong_c.values()) > 0 or differ > 0)
