"""A failed layerwise load costs time, never tokens: what the failed step saved is never published.

Harness: tests/standins/harness_pool (``PoolInstance``: vLLM's real Scheduler, the AscendStore
connector halves, the real layer threads, a byte-level MemCache with faults). Instance A fills the
pool with a 40-token prompt (2 full blocks of 16 tokens). Instance B (policy ``recompute``) hits
those 32 tokens for a prompt with 16 new tokens after them, and its first GDN load fails: the copy
returns an error, raises, stays blocked past the wait, or the key is evicted between the
scheduler's hit check and the worker's load. B's failed step computes tokens 32..48 on the state
that was never loaded and saves block 2 of every group (the chunk-end GDN state included).
Instance C then asks for the same 48 tokens plus 16 more: a hit on a key saved in B's failed step
would load state computed from garbage (``PoolInstance.wrong_reads``).
"""

from __future__ import annotations

import os

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.patches import load_failures, mamba_pool_hit
from ascend_layerwise_patch.patches import _failed_load
from ascend_layerwise_patch.registry import APPLIED, SKIPPED

from support import PAIR

PAIRS = ("v0251",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from byte_store import G2L  # noqa: E402
from harness_pool import PoolInstance, differing_tokens, engine_loop, hit_after_chunked_prefill, make_pool  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

PROMPT = list(range(3000, 3040))
NEW = list(range(6000, 6016))  # one full block after the 32-token hit: the failed step saves it
B_PROMPT = PROMPT[:32] + NEW + [1, 2, 3, 4, 5]
C_PROMPT = PROMPT[:32] + NEW + list(range(7000, 7016))
#: async scheduling: B prefills in 16-token chunks, so the step after the failed one (scheduled before
#: the failure is known, 48..64) saves a full block computed on the failed state too
NEW_ASYNC = list(range(6000, 6032))
B_PROMPT_ASYNC = PROMPT[:32] + NEW_ASYNC + [1, 2, 3, 4, 5]
C_PROMPT_ASYNC = PROMPT[:32] + NEW_ASYNC + list(range(7000, 7016))
E_PROMPT = list(range(5000, 5021))  # another request in B's batch, nothing in the pool
MAX_TOKENS = 3
_ALL = {
    load_failures.GROUP,
    load_failures.SAVES_GROUP,
    load_failures.AGREEMENT_GROUP,
    load_failures.ROLLBACK_GROUP,
    mamba_pool_hit.RESUME_LOAD_GROUP,
}
_GROUPS = {
    "on": set(),
    "off": _ALL,  # the library's load-failure handling off
    # only the dropped saves off: load_failures_saves, and the agreement (it finishes every marked
    # request's keys of the step as failed too, the failing rank's own included)
    "saves_off": {load_failures.SAVES_GROUP, load_failures.AGREEMENT_GROUP},
    "agreement_off": {load_failures.AGREEMENT_GROUP},  # only the TP ranks' agreement off (issue 32)
    "rollback_off": {load_failures.ROLLBACK_GROUP},  # only the preempting rollback off
    "resume_load_off": {mamba_pool_hit.RESUME_LOAD_GROUP},
}


def _set(mode: str) -> None:
    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    skip = _GROUPS[mode]
    reg.activate(environ={**os.environ, "ASCEND_LAYERWISE_PATCH_SKIP": ",".join(sorted(skip))} if skip else dict(os.environ))
    for st in reg.status():
        if st.group in skip:
            assert st.state == SKIPPED, (st.name, st.state, st.reason)


@pytest.fixture
def library():
    yield _set
    _set("on")


def test_load_failure_groups_apply(library):
    """The groups' state, on its own (the defect tests run as configured)."""
    library("on")
    # the 0.30 members (mamba_pool_resume_load_030) are out of range here
    assert {st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.group in _ALL and not st.name.endswith("_030")} == {APPLIED}


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    """Tokens of runs without any pool (vLLM's own prefix caching only)."""
    inst = PoolInstance(None, name="control")
    reqs = [inst.add_request("b", B_PROMPT, max_tokens=MAX_TOKENS), inst.add_request("c", C_PROMPT, max_tokens=2)]
    reqs += [inst.add_request("b_async", B_PROMPT_ASYNC, max_tokens=MAX_TOKENS)]
    reqs += [inst.add_request("c_async", C_PROMPT_ASYNC, max_tokens=2)]
    reqs += [inst.add_request("e", E_PROMPT, max_tokens=MAX_TOKENS)]
    engine_loop(inst)
    assert inst.wrong_reads() == [] and inst.wrong_reads(kind="attn") == []
    return {r.request_id: list(r.output_token_ids) for r in reqs}


def rank_suffix(tp: int, rank: int, kv_heads: int = 2) -> str:
    """How GDN keys of TP rank ``rank`` end: ``@tp<rank>`` where ranks share a KV head (put_step > 1,
    ``gdn_tp_keys.rank_key``), else ``@<rank>`` (upstream's ``head_or_tp_rank``)."""
    return f"@tp{rank}" if tp > kv_heads else f"@{rank}"


class Run:
    """A fills the pool, B's first GDN load fails (``fault``), then C hits the same prefix.

    ``tp``: every instance's TP size (2 KV heads; ranks are processes at TP > 1); ``rank``: the fault
    hits that TP rank's GDN keys only (None: the first GDN load of any rank)."""

    def __init__(
        self,
        fault: str,
        policy: str = "recompute",
        scheduling: str = "sync",
        with_other: bool = False,
        tp: int = 1,
        rank: int | None = None,
        between: bool = False,
        store: str | None = None,  # make_pool's store (default: the pair's)
    ):
        asy = scheduling == "async"
        b_prompt, c_prompt = (B_PROMPT_ASYNC, C_PROMPT_ASYNC) if asy else (B_PROMPT, C_PROMPT)
        self.tp = tp
        self.pool = pool = make_pool(store)
        a = PoolInstance(pool, name="A", tp=tp)
        a.add_request("a", PROMPT, max_tokens=1)
        engine_loop(a)
        a.close()
        self.b = b = PoolInstance(
            pool,
            name="B",
            tp=tp,
            kv_load_failure_policy=policy,
            async_scheduling=asy,
            long_prefill_token_threshold=16 if asy else 0,
        )
        group = str(b.group_of[b.gdn_layers[0]])
        on_rank = "" if rank is None else rank_suffix(tp, rank)
        is_gdn = lambda key: key.split("@")[1] == group and key.endswith(on_rank)  # noqa: E731
        self.fault = None
        if fault == "evict":
            # after the scheduler's hit check, before the worker's load: the state B resumes from goes
            def evict(inst, _so):
                if inst.steps == 0:
                    self.evicted = pool.evict(lambda key: is_gdn(key) and pool.blobs[key].state == "ready")

            b.after_schedule = evict
        else:
            self.fault = pool.add_fault(fault, direction=G2L, times=1, match=is_gdn)
        self.free_at_start = b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        self.req_b = b.add_request("b", b_prompt, max_tokens=MAX_TOKENS)
        self.req_e = b.add_request("e", E_PROMPT, max_tokens=MAX_TOKENS) if with_other else None
        before = dict(pool.blobs)
        self.failed_step_keys: dict = {}

        #: executed batches on the failed state (async: the next one too, scheduled before the report)
        self.computed_on_failure = computed_on_failure = 2 if asy else 1

        def after(inst, _so):
            if inst.steps == computed_on_failure:  # the keys those batches allocated (and saved)
                self.failed_step_keys = {k: blob for k, blob in pool.blobs.items() if before.get(k) is not blob}
            if inst.steps >= 1 and self.fault is not None:
                self.fault.gate.set()

        engine_loop(b, on_step=after)
        self.req_d = None
        if between:  # a clean request with C's prompt on a fourth instance first (it re-saves what it misses)
            d = PoolInstance(pool, name="D", tp=tp)
            try:
                self.req_d = d.add_request("d", c_prompt, max_tokens=2)
                engine_loop(d)
                self.wrong_d = [r for kind in ("gdn", "attn") for r in d.wrong_reads("d", kind=kind)]
            finally:
                d.close()
        self.c = c = PoolInstance(pool, name="C", tp=tp)
        self.req_c = c.add_request("c", c_prompt, max_tokens=2)
        engine_loop(c)

    def close(self) -> None:
        """Ends B's and C's rank processes (TP > 1)."""
        self.b.close()
        self.c.close()

    def ready_failed_step_keys(self) -> list[str]:
        """Keys of b saved in the batches computed on its failed load that are ready."""
        from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import pool_worker

        b_hashes = {pool_worker.block_hash_to_str(h) for h in self.req_b.block_hashes}
        return [k for k, blob in self.failed_step_keys.items() if blob.state == "ready" and k.split("@")[2] in b_hashes]

    def ready_by_suffix(self) -> dict[str, int]:
        """:meth:`ready_failed_step_keys` counted by the key's last field (GDN: ``tp<rank>`` or the
        rank; attention: the KV head its saving rank holds)."""
        counts: dict[str, int] = {}
        for key in self.ready_failed_step_keys():
            suffix = key.rsplit("@", 1)[1]
            counts[suffix] = counts.get(suffix, 0) + 1
        return dict(sorted(counts.items()))

    def wrong_reads_b(self) -> list:
        """B's reads after the batches computed on the failed load (their outputs are discarded)."""
        return [
            r for kind in ("gdn", "attn") for r in self.b.wrong_reads("b", kind=kind) if r.step >= self.computed_on_failure
        ]

    def wrong_reads_c(self) -> list:
        return [r for kind in ("gdn", "attn") for r in self.c.wrong_reads("c", kind=kind)]

    def check_clean_end(self) -> None:
        assert not self.b.has_work() and not self.c.has_work()
        assert self.pool.violations == []
        assert all(blob.leases == 0 for blob in self.pool.blobs.values())  # every read lease released
        assert not [k for k, blob in self.pool.blobs.items() if blob.state == "writing"]  # every key finished
        assert self.b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == self.free_at_start  # no leak


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("fault", ["error", "raise", "gate", "evict"])
def test_failed_step_saves_are_never_published(library, expected, monkeypatch, fault, scheduling):
    library("on")
    monkeypatch.setattr(_failed_load, "WAIT_S", 0.3)  # upstream's 10 s, shortened for the gate fault
    run = Run(fault, scheduling=scheduling)
    sfx = "_async" if scheduling == "async" else ""
    assert run.fault is None or run.fault.hits == 1
    assert run.b.kv_outputs[0].invalid_block_ids  # reported in the failed step
    assert run.failed_step_keys  # the failed step did save (a full block of each group)
    assert run.ready_failed_step_keys() == []
    assert run.wrong_reads_b() == [] and run.wrong_reads_c() == []
    # token by token as without the pool, no extra token (async: none from the step after the failure)
    assert list(run.req_b.output_token_ids) == expected["b" + sfx]
    assert list(run.req_c.output_token_ids) == expected["c" + sfx]
    assert run.req_b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    run.check_clean_end()


@pytest.mark.parametrize("mode", [pytest.param("off", marks=pytest.mark.control("the library's load-failure handling off in the test: vllm-ascend as released, the same with the library off")), "saves_off"])
@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_without_the_fix_the_failed_step_poisons_the_pool(library, expected, mode, scheduling):
    """The library's load-failure handling off (vllm-ascend as released, policy ``fail`` since it
    refuses ``recompute`` for hybrids), or only the dropped saves off (``load_failures_saves`` and
    ``load_failures_agreement``): B's failed step
    publishes its keys, and C computes on them."""
    library(mode)
    run = Run("error", policy="fail" if mode == "off" else "recompute", scheduling=scheduling)
    ready, wrong = run.ready_failed_step_keys(), run.wrong_reads_c()
    sfx = "_async" if scheduling == "async" else ""
    differ = differing_tokens({"c": list(run.req_c.output_token_ids)}, {"c": expected["c" + sfx]})
    print(f"\n{mode}, {scheduling}: {len(ready)} keys saved in the failed step published ready; {len(wrong)} wrong reads of C "
          f"({len(run.wrong_reads_b())} of B after its failed step); {differ} of C's {len(expected['c' + sfx])} tokens differ")
    assert ready and wrong and differ > 0  # C's tokens come from the poisoned keys


# ------------------------------------------------------------------ rollback (load_failures_rollback)
X = list(range(3100, 3180))
Y = list(range(4100, 4180))
TWO = {"b1": X[:64] + list(range(6100, 6132)), "b2": Y[:64] + list(range(7100, 7132))}


@pytest.fixture(scope="module")
def expected_two() -> dict[str, list[int]]:
    inst = PoolInstance(None, name="control2")
    reqs = [inst.add_request(r, p, max_tokens=2) for r, p in TWO.items()]
    engine_loop(inst)
    return {r.request_id: list(r.output_token_ids) for r in reqs}


def _two_failing(fault: str, scheduling: str = "sync"):
    """A (prefill in 32-token chunks) saves GDN states at 32, 64 and 80 of X and Y; B hits 64 tokens
    of each for b1 / b2 (32 new tokens each) and both loads fail in the same step. ``evict``: every
    GDN key of the pool goes between B's hit check and its load, so the rolled-back requests find no
    pool hit again and recompute 0..96 in 3 chunks of 32."""
    pool = make_pool()
    a = PoolInstance(pool, name="A", max_num_batched_tokens=64, long_prefill_token_threshold=32)
    a.add_request("x", X, max_tokens=1)
    a.add_request("y", Y, max_tokens=1)
    engine_loop(a)
    asy = scheduling == "async"
    b = PoolInstance(
        pool,
        name="B",
        kv_load_failure_policy="recompute",
        max_num_batched_tokens=64,
        long_prefill_token_threshold=32,
        async_scheduling=asy,
    )
    group = str(b.group_of[b.gdn_layers[0]])
    is_gdn = lambda key: key.split("@")[1] == group  # noqa: E731
    if fault == "evict":

        def evict(inst, _so):
            if inst.steps == 0:
                assert len(pool.evict(is_gdn)) >= 4

        b.after_schedule = evict
    else:
        pool.add_fault(fault, direction=G2L, times=2, match=is_gdn)  # the first GDN load of b1 and of b2
    free = b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    reqs = [b.add_request(r, p, max_tokens=2) for r, p in TWO.items()]
    engine_loop(b)
    assert set(b.kv_outputs[0].invalid_block_ids)  # both reported in the same step
    assert b.first_step_of("b1") == b.first_step_of("b2") == 0
    assert pool.violations == [] and all(blob.leases == 0 for blob in pool.blobs.values())
    assert b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
    on_failure = 2 if asy else 1  # batches computed on the failed state (async: the next one too)
    wrong = [r for r in b.wrong_reads() if r.step >= on_failure]
    null = [r for r in b.reads_of() if r.block_id == 0]
    return b, reqs, wrong, null


@pytest.mark.parametrize("fault,scheduling", [("evict", "sync"), ("error", "sync"), ("evict", "async")])
def test_two_rolled_back_requests_never_share_a_state_block(library, expected_two, fault, scheduling):
    library("on")
    b, reqs, wrong, null = _two_failing(fault, scheduling)
    assert wrong == [] and null == []
    assert {r.request_id: list(r.output_token_ids) for r in reqs} == expected_two
    if fault == "evict":  # recomputed from the start, 32 tokens per step
        chunks = {r: len({x.step for x in b.reads_of(r, kind="attn") if x.step > 0 and x.block_index == 0} | {0}) for r in TWO}
        assert all(n >= 3 for n in chunks.values()), chunks


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_rolled_back_in_place_runs_gdn_in_the_null_block(library, scheduling):
    """``load_failures_rollback`` off: the rollback rewinds ``num_computed_tokens`` in place and the
    recompute runs its GDN state in the null block, shared by both requests."""
    library("rollback_off")
    b, _reqs, wrong, _null = _two_failing("evict", scheduling)
    if scheduling == "async":
        # worse: align mode freed the loaded state block when the next step was scheduled, so the
        # in-place handler finds no request holding the invalid block and rolls nothing back: the
        # next step, computed on the failed state, is delivered (max_tokens=2: both finish there)
        assert not any(r.num_preemptions for r in _reqs)
        wrong = [r for r in b.wrong_reads() if r.step >= 1]
    print(f"\nrollback_off, {scheduling}, two requests failing in one step: {len(wrong)} wrong GDN reads in "
          "batches whose output is delivered")
    assert wrong


def _same_prefix_right_after(
    mode: str, scheduling: str = "sync", layer: str = "attn", shared: int = 48, in_flight: bool = False, tp: int = 1
):
    """B's attention (or GDN) load fails for b (rolled back); d with b's first ``shared`` tokens arrives
    right after the failed step -- once b's rollback is done, or (``in_flight``, async scheduling)
    while the failed step's output is still in the batch queue: then d is scheduled in the step in
    flight with a local hit on b's blocks, before the failure reaches the scheduler. B recomputes in
    16-token chunks, so a local hit of d on b's blocks reads blocks b has not recomputed yet. At
    ``tp`` > 1 the load fails on rank 1 only. Returns d's wrong reads in steps whose output is
    delivered, d's tokens, and the wrong reads of c on a third instance (d's prompt + 16 tokens)."""
    _set(mode)
    pool = make_pool()
    a = PoolInstance(pool, name="A", tp=tp)
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    a.close()
    asy = scheduling == "async"
    b = PoolInstance(
        pool, name="B", tp=tp, kv_load_failure_policy="recompute", long_prefill_token_threshold=16, async_scheduling=asy
    )
    group = str(b.group_of[(b.attn_layers if layer == "attn" else b.gdn_layers)[0]])
    on_rank = rank_suffix(tp, 1) if tp > 1 else ""
    pool.add_fault("error", direction=G2L, times=1, match=lambda key: key.split("@")[1] == group and key.endswith(on_rank))
    b.add_request("b", B_PROMPT, max_tokens=MAX_TOKENS)
    arrive = 1 if in_flight else (2 if asy else 1)  # in flight: before the failed step's output is handled
    d_prompt = B_PROMPT[:shared] + [9, 9, 9]
    d: list = []

    def after(inst, _so):
        if inst.steps == arrive and not d:
            d.append(inst.add_request("d", d_prompt, max_tokens=2))

    try:
        engine_loop(b, on_step=after)
    finally:
        b.close()
    assert b.reads_of("d", kind="attn")
    first = 2 if in_flight else 0  # the step in flight's output is dropped with d's rollback
    wrong = [r for kind in ("gdn", "attn") for r in b.wrong_reads("d", kind=kind) if r.step >= first]
    c = PoolInstance(pool, name="C", tp=tp)
    c.add_request("c", d_prompt + list(range(7000, 7016)), max_tokens=1)
    try:
        engine_loop(c)
    finally:
        c.close()
    return wrong, list(d[0].output_token_ids), [r for kind in ("gdn", "attn") for r in c.wrong_reads("c", kind=kind)]


@pytest.mark.parametrize(
    "scheduling,layer,shared",
    [
        ("sync", "attn", 48),
        ("async", "attn", 48),
        # async: align mode freed b's (unloaded) GDN state block at 32 when the next step was
        # scheduled; it stays cached unless the rollback evicts the blocks the failed step held
        ("async", "gdn", 32),
    ],
)
def test_same_prefix_right_after_the_rollback_reads_no_invalid_block(library, scheduling, layer, shared):
    assert _same_prefix_right_after("on", scheduling, layer, shared)[0] == []
    off = _same_prefix_right_after("rollback_off", scheduling, layer, shared)[0]
    print(f"\nrollback_off, {scheduling}, {layer} load failed, d shares {shared} tokens: {len(off)} wrong reads of d")
    assert off


IN_FLIGHT = [("gdn", 48, 1), ("attn", 48, 1), ("gdn", 32, 1), ("gdn", 48, 4)]


@pytest.mark.parametrize("layer,shared,tp", IN_FLIGHT, ids=[f"{x}-{n}-tp{t}" for x, n, t in IN_FLIGHT])
def test_same_prefix_in_the_step_in_flight_is_rolled_back_with_it(library, layer, shared, tp):
    """Async scheduling (issue 32): d arrives while b's failed step is in flight and is scheduled with a
    local hit on b's blocks -- computed from (or being) the never-loaded ones -- before the failure
    reaches the scheduler. With the library d is preempted with b (its output of the step in flight
    dropped) and its saves of that step are finished as failed on every rank: d's tokens are those of a
    run without the pool, nothing read later is wrong, and c on a third instance reads 0 wrong states.
    ``load_failures_rollback`` off: d keeps the token computed on b's damaged blocks."""
    from harness_pool import reference_outputs

    reference = reference_outputs({"d": B_PROMPT[:shared] + [9, 9, 9]}, max_tokens=2)["d"]
    wrong, tokens, wrong_c = _same_prefix_right_after("on", "async", layer, shared, in_flight=True, tp=tp)
    assert (wrong, tokens, wrong_c) == ([], reference, [])
    off, off_tokens, off_c = _same_prefix_right_after("rollback_off", "async", layer, shared, in_flight=True, tp=tp)
    differ = sum(x != y for x, y in zip(off_tokens, reference))
    print(f"\nrollback_off, async, {layer} load failed at tp{tp}, d shares {shared} tokens and arrives in flight: {len(off)} "
          f"wrong reads of d later, {differ} of its {len(reference)} tokens differ; {len(off_c)} wrong reads of c")
    assert differ > 0


def test_async_rollback_in_place_computes_on_wrong_state(library):
    """Async scheduling, ``load_failures_rollback`` off: the in-place rewind keeps the align layout,
    and the resumed prefill of b reads GDN states that are not its own."""
    library("rollback_off")
    run = Run("error", scheduling="async")
    wrong = run.wrong_reads_b()
    print(f"\nrollback_off, async: {len(wrong)} wrong reads of b after the batches computed on the failure")
    assert wrong


# ------------------------------------------------------------------ cost (mamba_pool_resume_load)
def _mamba_g2l_on_a_16_block_hit(mode: str) -> tuple[dict[str, int], int]:
    """harness_pool.hit_after_chunked_prefill under ``mode``: B's G2L bytes per GDN-group key, and the
    size of one key."""
    _set(mode)
    pool = make_pool()
    b, read = hit_after_chunked_prefill(pool)
    assert b.wrong_reads() == [] and b.wrong_reads(kind="attn") == []
    assert b.reads_of("b")[0].expected == 256  # resumed from the pool at the 16th block
    return read, max(len(pool.blobs[k].data) for k in read)


def test_a_pool_hit_loads_only_the_mamba_state_it_resumes_from(library):
    read, size = _mamba_g2l_on_a_16_block_hit("on")
    assert len(read) == 1 and sum(read.values()) == size  # one state per GDN layer of this rank
    off, _ = _mamba_g2l_on_a_16_block_hit("resume_load_off")
    print(f"\nmamba-group G2L on a 16-block hit: {sum(read.values())} bytes ({len(read)} key) on, "
          f"{sum(off.values())} bytes ({len(off)} keys) with mamba_pool_resume_load off")
    assert len(off) == 4 and sum(off.values()) == 4 * size


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_fail_policy_ends_only_that_request(library, expected, scheduling):
    library("on")
    run = Run("error", policy="fail", scheduling=scheduling, with_other=True)
    assert run.req_b.status == RequestStatus.FINISHED_ERROR
    assert run.req_e.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert list(run.req_e.output_token_ids) == expected["e"]
    assert run.b.wrong_reads("e") == [] and run.b.wrong_reads("e", kind="attn") == []
    assert run.ready_failed_step_keys() == [] and run.wrong_reads_c() == []
    run.check_clean_end()


# ------------------------------------------------------------------ the late-copy fence (issue 32 §4)
E_LONG = list(range(9000, 9096))  # arrives right after b's failed step; no pool hit, 6 chunks of 16


def _landed_blocks(rank, layers, items) -> set[int]:
    """The block ids (rows of the rank's attention caches) a copy's host addresses fall in."""
    blocks = set()
    for _key, _off, addr, _size in items:
        for name in layers:
            for t in rank.layers[name].kv_cache:
                base, n = t.data_ptr(), t.numel() * t.element_size()
                if base <= addr < base + n:
                    blocks.add((addr - base) // (t.stride(0) * t.element_size()))
    return blocks


def _late_copy(monkeypatch, fence: bool, scheduling: str) -> dict:
    """b's first attention load copy is held inside the store (a gate) past the 0.3 s wait: the load is
    abandoned and b rolled back (its blocks freed, every one: the attention blocks were the ones not
    loaded). e arrives right after, in a KV cache of 16 blocks, and is given b's freed blocks. The
    gate opens when the step after the failure enters the fence (``fence`` on), or 3 steps later
    (``fence`` off: the copy then writes into e's blocks, already computed). Events and step counts
    decide when it opens, never a timer. Returns what the copy hit."""
    import threading

    _set("on")
    monkeypatch.setattr(_failed_load, "WAIT_S", 0.3)
    landed = threading.Event()
    opened: list = []  # the gate, once made: the fence opens it
    if fence:
        real_fence = load_failures.report._fence

        def fence_opens_gate(*args):
            opened[0].gate.set()  # the step waits in the fence: now the late copy may return
            return real_fence(*args)

        monkeypatch.setattr(load_failures.report, "_fence", fence_opens_gate)
    else:  # only the fence off: the rest of the library's load-failure handling on
        monkeypatch.setattr(load_failures.report, "_fence", lambda *_a: None)
    pool = make_pool()
    a = PoolInstance(pool, name="A")
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    asy = scheduling == "async"
    b = PoolInstance(
        pool, name="B", kv_load_failure_policy="recompute", long_prefill_token_threshold=16, async_scheduling=asy,
        num_blocks=16, max_model_len=160,
    )
    group = str(b.group_of[b.attn_layers[0]])
    match = lambda key: key.split("@")[1] == group  # noqa: E731
    fault = pool.add_fault("gate", direction=G2L, times=1, match=match)
    opened.append(fault)
    out: dict = {"landed_at": None}

    def observe(direction, items, _host):
        if direction == G2L and fault.gate.is_set() and out["landed_at"] is None and any(match(k) for k, *_ in items):
            blocks = _landed_blocks(b.ranks[0], b.attn_layers, items)
            sched = b.scheduler
            held = {r.request_id for r in sched.running if r.request_id != "b" and any(x in blocks for ids in sched.kv_cache_manager.get_block_ids(r.request_id) for x in ids)}
            out.update(landed_at=b.steps, blocks=sorted(blocks), held_by=sorted(held))
            landed.set()

    pool.observers.append(observe)
    req_b = b.add_request("b", B_PROMPT, max_tokens=MAX_TOKENS)
    e: list = []
    failed_at = 2 if asy else 1  # executed batches when the failure reaches the scheduler

    def after(inst, _so):
        if inst.steps == failed_at and not e:
            e.append(inst.add_request("e", E_LONG, max_tokens=4))
        if inst.steps == failed_at + 3 and not fault.gate.is_set():
            fault.gate.set()
            assert landed.wait(30), "the released copy never reached the store's observer"

    try:
        engine_loop(b, on_step=after)
    finally:
        fault.gate.set()
    assert fault.hits == 1 and out["landed_at"] is not None
    out.update(
        e_tokens=list(e[0].output_token_ids),
        b_tokens=list(req_b.output_token_ids),
        e_wrong=[r for kind in ("gdn", "attn") for r in b.wrong_reads("e", kind=kind)],
        free_ok=b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
    )
    return out


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_late_copy_never_writes_into_a_reused_block(library, monkeypatch, scheduling):
    from harness_pool import reference_outputs

    reference = reference_outputs({"e": E_LONG, "b": B_PROMPT}, max_tokens=4)
    on = _late_copy(monkeypatch, True, scheduling)
    monkeypatch.undo()
    off = _late_copy(monkeypatch, False, scheduling)
    print(f"\n{scheduling}: fence on: the late copy landed at executed batch {on['landed_at']} into blocks {on['blocks']} "
          f"(allocated to {on['held_by']}, not yet computed); e: {len(on['e_wrong'])} wrong reads. Fence off: landed at "
          f"batch {off['landed_at']} into blocks {off['blocks']} held by {off['held_by']}; e: {len(off['e_wrong'])} wrong "
          f"reads, {sum(x != y for x, y in zip(off['e_tokens'], reference['e']))} of its 4 tokens differ")
    # with the fence the copy lands before the batch after the failed one computes (async: the one in
    # flight, scheduled before the rollback; sync: the first one scheduled after it)
    assert on["landed_at"] == 1
    assert on["e_wrong"] == [] and on["e_tokens"] == reference["e"]
    assert on["b_tokens"] == reference["b"][:MAX_TOKENS]
    assert off["held_by"] == ["e"] and off["e_wrong"] and off["e_tokens"] != reference["e"]
