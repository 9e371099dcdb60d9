"""Layerwise pool at TP > KV heads: every rank saves, keys and loads its own GDN slice.

Harness: tests/standins/harness_pool (``PoolInstance``: vLLM's real Scheduler, the AscendStore
connector halves from KVConnectorFactory, one worker half per TP rank, the real layer threads, a
byte-level MemCache). Every GDN state value names its layer, its token prefix and its TP slice, so a
rank that starts from another rank's slice reads a wrong state (``PoolInstance.wrong_reads``).
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ascend_layerwise_patch
from ascend_layerwise_patch.patches import gdn_tp_keys
from ascend_layerwise_patch.registry import APPLIED, SKIPPED

from support import PAIR, activate_skipping, library_off

PAIRS = ("v0251", "v0260")
if PAIR not in (*PAIRS, "v0300"):  # v0300: one control (vllm-ascend 0.30.0rc2 drains its sends itself)
    pytest.skip(f"for pairs {', '.join(PAIRS)} (and v0300); installed: {PAIR}", allow_module_level=True)

from harness_pool import PoolInstance, engine_loop, make_pool  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

PROMPT = list(range(2000, 2040))  # 2 full 16-token blocks + 8
HIT = 32
LAYOUTS = [(2, 1), (4, 2)]  # (tp, kv heads): put_step 2 in both
_NAMES = {s.name for s in gdn_tp_keys.SPECS if not s.name.endswith("_030")}
_STEP_END = {s.name for s in gdn_tp_keys.STEP_END_SPECS if not s.name.endswith("_030")}  # gdn_tp_keys_030: vllm-ascend 0.30 only


def _set(on: bool) -> None:
    """Every patch of the library, with (on) or without (off) this group: off is vllm-ascend's own
    GDN keying with everything else this library fixes in place, so only this group's effect shows."""
    reg = activate_skipping() if on else activate_skipping(gdn_tp_keys.GROUP)
    if not on:
        assert {st.state for st in reg.status() if st.name in _NAMES} == {SKIPPED}, reg.status()


def test_gdn_tp_keys_applies(library):
    """The group's state, on its own (the defect tests run as configured)."""
    library(True)
    ours = [st for st in ascend_layerwise_patch.REGISTRY.status() if st.name in _NAMES]
    # gdn_tp_finish is skipped as fixed upstream on vllm-ascend 0.26.0rc1
    assert all(st.state == APPLIED or st.reason.startswith("already fixed upstream") for st in ours), ours
    assert {st.name for st in ours if st.state == APPLIED} >= _NAMES - {"gdn_tp_finish"}, ours


@pytest.fixture
def library():
    yield _set
    _set(True)


def _save_then_hit(tp: int, kv_heads: int, pool=None):
    """A saves PROMPT; B, on an empty cache, hits its first 32 tokens. Returns what every rank of B
    holds in the loaded GDN state block (index 32 // block_size - 1) right after B's first step:
    ``{(rank, layer): tokens covered}`` (this rank's slice), or "other" (another slice)."""
    pool = pool or make_pool()
    a = PoolInstance(pool, name="A", tp=tp, kv_heads=kv_heads)
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    assert a.wrong_reads("a") == [] and {r.rank for r in a.reads_of("a")} == set(range(tp))
    b = PoolInstance(pool, name="B", tp=tp, kv_heads=kv_heads)
    b.add_request("b", PROMPT[:HIT] + [7, 8, 9, 10, 11], max_tokens=1)
    held = {}

    def after(inst, _so):
        if not held:
            held.update(inst.contents("b", inst.gdn_layers, HIT // inst.block_size - 1))

    engine_loop(b, on_step=after)
    return pool, a, b, held


def _groups(inst: PoolInstance) -> tuple[set[int], set[int]]:
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = inst.kv_cache_config.kv_cache_groups
    mamba = {g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, MambaSpec)}
    return mamba, set(range(len(inst.kv_cache_config.kv_cache_groups))) - mamba


def _keys(pool, groups: set[int]) -> dict[str, bytes]:
    return {k: pool.read(k) for k in pool.ready_keys() if int(k.split("@")[1]) in groups}


@pytest.mark.parametrize("tp,kv_heads", LAYOUTS)
def test_every_rank_loads_its_own_gdn_slice(library, tp, kv_heads):
    library(True)
    pool, a, b, held = _save_then_hit(tp, kv_heads)
    # every GDN layer of every rank of B holds, from the pool, its own slice after 32 tokens
    assert held == {(rank, name): HIT for rank in range(tp) for name in b.gdn_layers}
    assert b.wrong_reads("b", kind="attn") == []
    mamba, _attn = _groups(a)
    gdn_keys = _keys(pool, mamba)
    # one finished key per rank for every block that holds a saved state (mamba_pool_hit publishes
    # no key for a null mamba block)
    by_rank: dict[str, set[str]] = {}
    for key in gdn_keys:
        by_rank.setdefault(key.rsplit("@", 1)[1], set()).add(key.split("@")[2])
    assert set(by_rank) == {f"tp{r}" for r in range(tp)}
    assert all(hashes == by_rank["tp0"] for hashes in by_rank.values()) and 1 <= len(by_rank["tp0"]) <= HIT // a.block_size
    assert pool.violations == []


@pytest.mark.parametrize("tp,kv_heads", LAYOUTS)
def test_unpatched_ranks_load_another_ranks_slice(library, tp, kv_heads):
    library(False)
    _pool, _a, b, held = _save_then_hit(tp, kv_heads)
    put_step = tp // kv_heads
    wrong = {k for k, v in held.items() if v != HIT}
    # every GDN layer of every follower rank holds its leader's slice; leaders hold their own
    assert wrong == {(rank, name) for rank in range(tp) if rank % put_step for name in b.gdn_layers}
    assert all(held[k] == "other" for k in wrong)
    print(f"\nunpatched TP={tp}, {kv_heads} KV heads: {len(wrong)} of {len(held)} (rank, GDN layer) states "
          f"loaded from another rank's slice")


@pytest.mark.parametrize("tp,kv_heads", [(2, 1)])
@pytest.mark.control("attention keys are upstream's with or without the group (a compatibility control)")
def test_full_attention_keys_unchanged(library, tp, kv_heads):
    """Attention keys and bytes are what upstream writes: existing pools stay valid."""
    library(False)
    before, a0, _b, _h = _save_then_hit(tp, kv_heads)
    library(True)
    after, a1, _b, _h = _save_then_hit(tp, kv_heads)
    _m0, attn0 = _groups(a0)
    _m1, attn1 = _groups(a1)
    assert attn0 == attn1
    old, new = _keys(before, attn0), _keys(after, attn1)
    assert old and old == new


def test_old_gdn_keys_count_as_misses(library):
    """GDN keys written before the upgrade (leader ranks only) are never loaded by other ranks."""
    tp, kv_heads = 2, 1
    library(False)
    pool = make_pool()
    a = PoolInstance(pool, name="A", tp=tp, kv_heads=kv_heads)
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    old = set(pool.ready_keys())
    start = len(pool.copy_log)
    library(True)
    b = PoolInstance(pool, name="B", tp=tp, kv_heads=kv_heads)
    b.add_request("b", PROMPT[:HIT] + [7, 8, 9, 10, 11], max_tokens=1)
    engine_loop(b)
    assert b.wrong_reads("b") == [] and b.wrong_reads("b", kind="attn") == []
    mamba, _attn = _groups(b)
    assert {k for k in old if int(k.split("@")[1]) in mamba}
    # no rank's GDN key of the old layout is asked for: a miss, so B loads nothing and computes
    assert [keys for direction, keys, _res in pool.copy_log[start:] if direction == 1] == []
    assert b.outputs["b"]


def test_a_block_hits_only_when_every_rank_key_is_ready(library):
    """Rank 1's GDN saves fail (on v0260: are evicted, since a failed save copy stops vllm-ascend
    0.26.0rc1's engine): no block is a hit for B (no rank loads a partial set of slices)."""
    library(True)
    from byte_store import L2G

    pool = make_pool()
    rank1 = lambda key: key.endswith("@tp1")  # noqa: E731
    if PAIR != "v0260":
        pool.add_fault("error", direction=L2G, match=rank1)
    a = PoolInstance(pool, name="A", tp=2, kv_heads=1)
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    if PAIR == "v0260":
        assert pool.evict(rank1)
    ready = pool.ready_keys()
    assert ready and not [k for k in ready if k.endswith("@tp1")]
    start = len(pool.copy_log)
    b = PoolInstance(pool, name="B", tp=2, kv_heads=1)
    b.add_request("b", PROMPT[:HIT] + [7, 8, 9, 10, 11], max_tokens=2)
    engine_loop(b)
    assert [keys for direction, keys, _res in pool.copy_log[start:] if direction == 1] == []
    assert b.wrong_reads("b") == [] and b.wrong_reads("b", kind="attn") == []


@settings(
    max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, phases=(Phase.generate,)
)
@given(
    layout=st.sampled_from([(2, 1), (4, 2), (4, 1)]),
    prompt_len=st.integers(33, 63),
    extra=st.integers(3, 9),  # B computes a few tokens past the hit
)
def test_tensor_parallel_invariants_soak(layout, prompt_len, extra):
    """Random TP layouts and prefixes: every rank's loaded GDN state is its own slice at the hit,
    every GDN block is either ready for every rank or for none, attention keys stay per KV head."""
    _set(True)
    tp, kv_heads = layout
    base = 10_000 * (prompt_len + 100 * extra) + tp * 10 + kv_heads
    prompt = list(range(base, base + prompt_len))
    pool = make_pool()
    a = PoolInstance(pool, name="A", tp=tp, kv_heads=kv_heads)
    a.add_request("a", prompt, max_tokens=1)
    engine_loop(a)
    hit = prompt_len // a.block_size * a.block_size  # A (one chunk) keeps the GDN state of its last full block
    b = PoolInstance(pool, name="B", tp=tp, kv_heads=kv_heads)
    b.add_request("b", prompt[:hit] + list(range(7, 7 + extra)), max_tokens=2)
    held = {}

    def after(inst, _so):
        if not held:
            held.update(inst.contents("b", inst.gdn_layers, hit // inst.block_size - 1))

    engine_loop(b, on_step=after)
    assert held == {(r, name): hit for r in range(tp) for name in b.gdn_layers}
    assert b.wrong_reads("b", kind="attn") == [] and a.wrong_reads("a") == []
    mamba, attn = _groups(a)
    by_block: dict[tuple[str, str], set[str]] = {}
    for key in _keys(pool, mamba):
        _model, group, block, rank = key.split("@")
        by_block.setdefault((group, block), set()).add(rank)
    assert by_block and all(ranks == {f"tp{r}" for r in range(tp)} for ranks in by_block.values())
    heads = {key.rsplit("@", 1)[1] for key in _keys(pool, attn)}
    assert heads == {str(h) for h in range(min(tp, kv_heads))}
    assert pool.violations == []


# ------------------------------------------------- a non-leader rank's step ends after its GDN copies
#: Two inter-process events, made before an instance forks its rank processes: the gate of rank 1's
#: first GDN save copy, and whether that gate was opened by rank 1's step returning to the engine.
_GATE: dict[str, object] = {}


class _FinalSaveEvent(threading.Event):
    """The final layer's save event of rank 1: a wait on it while it is not set means the step waits
    for the rank's queued copies -- the gate opens (logical time: no timing decides the order)."""

    def wait(self, timeout=None):
        if not self.is_set():
            _GATE["open"].set()
        return super().wait(timeout)


class _DrainWait(threading.Condition):
    """The sending queue's ``all_tasks_done`` of rank 1 (its lock is the queue's): a wait on it is a
    drain of the queued copies (vllm-ascend 0.30.0rc2's final-layer wait) -- the gate opens."""

    def wait(self, timeout=None):
        _GATE["open"].set()
        return super().wait(timeout)


def _watch_rank_1(rank) -> None:
    if rank.rank != 1:
        return
    worker = rank.connector.connector_worker
    events = worker.layer_save_finished_events  # one list, shared with the rank's threads
    last = worker.num_layers - 1
    watched = _FinalSaveEvent()
    if events[last].is_set():
        watched.set()
    events[last] = watched
    queue = worker.kv_send_thread.request_queue
    queue.all_tasks_done = _DrainWait(queue.mutex)
    execute = rank.execute

    def execute_then_open(so):
        try:
            return execute(so)
        finally:
            if not _GATE["open"].is_set():  # the step returned with its copy still held
                _GATE["by_step_end"].set()
                _GATE["open"].set()

    rank.execute = execute_then_open


#: rank 1's GDN keys at TP 2 over 1 KV head: ``gdn_tp_keys.rank_key`` (0.25 / 0.26); 0.30.0rc2 keys
#: them by TP rank itself (``...@1``; its attention keys, the leader's, end ``@0``)
RANK_1_GDN = "@1" if PAIR == "v0300" else "@tp1"


def _held_copy_run(tp: int = 2, kv_heads: int = 1) -> dict:
    """A prefills PROMPT in 16-token chunks at TP 2 over 1 KV head (rank 1 saves its GDN slices, not
    the attention layers); rank 1's first GDN save copy is held until rank 1's step either waits for
    it at its final layer or returns without it. Then B hits the first 32 tokens."""
    from byte_store import L2G

    import rank_procs

    ctx = multiprocessing.get_context("fork")
    _GATE.update(open=ctx.Event(), by_step_end=ctx.Event())
    pool = make_pool()
    fault = pool.add_fault("gate", direction=L2G, match=lambda key: key.endswith(RANK_1_GDN), times=1)
    fault.gate = _GATE["open"]
    out = {"stopped": None}
    a = PoolInstance(pool, name="A", tp=tp, kv_heads=kv_heads, long_prefill_token_threshold=16)
    try:
        a.on_ranks(_watch_rank_1)
        a.add_request("a", PROMPT, max_tokens=2)
        try:
            engine_loop(a)
        except (RuntimeError, rank_procs.RankFailure) as exc:
            out["stopped"] = str(exc)
    finally:
        _GATE["open"].set()
        a.close()
    out["held"] = fault.hits
    out["step_ended_first"] = _GATE["by_step_end"].is_set()
    if out["stopped"] is None:
        b = PoolInstance(pool, name="B", tp=tp, kv_heads=kv_heads)
        try:
            b.add_request("b", PROMPT[:HIT] + [7, 8, 9, 10, 11], max_tokens=1)
            held = {}
            engine_loop(b, on_step=lambda inst, _so: held or held.update(inst.contents("b", inst.gdn_layers, HIT // inst.block_size - 1)))
            out["own_slices"] = sum(v == HIT for v in held.values()), len(held)
            out["wrong"] = len(b.wrong_reads("b"))
        finally:
            b.close()
    return out


def test_a_non_leader_rank_s_step_ends_after_its_gdn_copies(library):
    """At TP > KV heads rank 1 saves its GDN layers but not the final (attention) layer. Its step must
    not end before its GDN copies have: vllm-ascend 0.26.0rc1 set the final layer's event itself and
    cleared the step's events under the copies (the sending thread then stopped on "save failed" at
    the rank's next save of that layer; in CI: test_mtp_layer's TP 8 case). ``gdn_tp_step_end`` (0.26)
    and ``gdn_tp_finish`` (0.25) queue a final-layer task behind the rank's copies. Held by logical
    events: rank 1's copy lands only once its step waits for it, or once the step returned without it."""
    library(True)
    out = _held_copy_run()
    print(f"\n{PAIR} TP 2 over 1 KV head, rank 1's first GDN copy held: {out}")
    assert out["held"] == 1 and out["stopped"] is None, out
    assert not out["step_ended_first"], out  # rank 1's step waited for its copy
    assert out["own_slices"] == (2 * 2, 2 * 2) and out["wrong"] == 0, out  # 2 ranks x 2 GDN layers


@pytest.mark.pairs("v0260")
def test_without_gdn_tp_step_end_a_non_leader_rank_s_step_ends_under_its_copies():
    """The same run with group ``gdn_tp_step_end`` skipped: rank 1's step returns with its copy held."""
    reg = activate_skipping(gdn_tp_keys.STEP_END_GROUP)
    try:
        assert {st.state for st in reg.status() if st.name in _STEP_END} == {SKIPPED}
        out = _held_copy_run()
    finally:
        activate_skipping()
    print(f"\n{PAIR} without gdn_tp_step_end: {out}")
    assert out["held"] == 1 and out["step_ended_first"], out


@pytest.mark.pairs("v0300")
@pytest.mark.control("vllm-ascend 0.30.0rc2 saves GDN per rank and drains its sends at the last layer (gdn_tp_step_end_030)")
def test_030_a_non_leader_rank_s_step_ends_after_its_gdn_copies():
    with library_off():
        out = _held_copy_run()
    print(f"\n{PAIR} library off, TP 2 over 1 KV head, rank 1's first GDN copy held: {out}")
    assert out["held"] == 1 and out["stopped"] is None and not out["step_ended_first"], out
    assert out["own_slices"] == (2 * 2, 2 * 2) and out["wrong"] == 0, out
