"""Issue 22: a layerwise pool key names the layout its bytes depend on; another layout reads a miss.

On the pool harness (tests/standins/harness_pool: vLLM's real Scheduler, the AscendStore halves
from KVConnectorFactory, one worker half per TP rank, the real layer threads, a byte-level
MemCache). Every state / KV block value names what it covers -- layer, token prefix, and the slice of
heads the rank holds (rank r of TP t for GDN, the KV heads for attention) -- so a rank that loads
bytes written under another TP layout reads a wrong state (``PoolInstance.wrong_reads``), while two
layouts whose ranks hold the same heads (attention at TP 4 and TP 8 with 2 KV heads) hold the same
bytes.

Each case runs with the library on, and with the groups that make keys off (``pool_key_layout``,
and where it matters ``gdn_tp_keys``): the off runs show the wrong reads, the foreign loads or the
miss that never recovers.

vllm-ascend 0.30.0rc2 (v0300, members ``pool_layout_keys_030`` / ``pool_gva_cache_030``): the checkpoint
cases and the GVA map's bound run there too; its keys name the stage (PP > 1 is served, not refused), so
there the PP case checks that the key names the PP size; TP layouts are ``pool_key_tp``'s
(tests/standins/test_pool_key_tp.py).
"""

from __future__ import annotations

import os

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.patches import pool_key_layout
from ascend_layerwise_patch.registry import APPLIED, SKIPPED
from support import PAIR

PAIRS = ("v0251", "v0260", "v0300")
BASE = ("v0251", "v0260")  #: the 0.25 / 0.26 members (namespace on the halves, PP refused)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from byte_store import G2L  # noqa: E402
from harness_pool import PoolInstance, checkpoint_dir, differing_tokens, engine_loop, make_pool, reference_outputs  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

PROMPT = list(range(3000, 3040))  # 2 full 16-token blocks + 8
HIT = 32
TAIL = [7, 8, 9, 10, 11]
_NAMES = {s.name for s in pool_key_layout.SPECS}
_030 = {"pool_layout_keys_030", "pool_gva_cache_030"}


def _set(*, off: tuple[str, ...] = (), library: bool = True) -> None:
    """Re-activate the library: whole, without the named groups, or not at all."""
    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    # this module's own switches only; the process's ASCEND_LAYERWISE_PATCH stays (=0: nothing applies,
    # so every defect test fails on its defect: scripts/library_off.py)
    env = {k: v for k, v in os.environ.items() if k == "ASCEND_LAYERWISE_PATCH" or not k.startswith("ASCEND_LAYERWISE_PATCH")}
    if not library:
        env["ASCEND_LAYERWISE_PATCH"] = "0"
    elif off:
        env["ASCEND_LAYERWISE_PATCH_SKIP"] = ",".join(off)
    reg.activate(environ=env)
    if (off and pool_key_layout.GROUP in off) or not library:
        assert {st.state for st in reg.status() if st.name in _NAMES} == {SKIPPED}, reg.status()


def test_pool_key_layout_applies(activate):
    """The group's state, on its own (the defect tests run as configured)."""
    activate()
    names = _030 if PAIR == "v0300" else _NAMES - _030
    assert {st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.name in names} == {APPLIED}


@pytest.fixture
def activate():
    yield _set
    _set()


def _loads(pool, start: int) -> list[str]:
    """Keys read by load copies (G2L) since copy-log position ``start``."""
    return [k for direction, keys, _res in pool.copy_log[start:] if direction == G2L for k in keys]


def _hit(pool, writer: dict, reader: dict, *, prompt=PROMPT, reader_prompt=None):
    """A (``writer`` options) serves ``prompt``; B (``reader`` options), on an empty cache, gets its
    first 32 tokens + 5 others. Returns (A, B, keys B loaded)."""
    a = PoolInstance(pool, name="A", **writer)
    a.add_request("a", prompt, max_tokens=1)
    engine_loop(a)
    start = len(pool.copy_log)
    b = PoolInstance(pool, name="B", **reader)
    b.add_request("b", reader_prompt or prompt[:HIT] + TAIL, max_tokens=2)
    engine_loop(b)
    return a, b, _loads(pool, start)


def _model_name(rank) -> str:
    return rank.connector.connector_worker.model_name


def _wrong(b: PoolInstance, pool) -> int:
    return len(b.wrong_reads("b")) + len(b.wrong_reads("b", kind="attn")) + len(pool.violations)


# ----------------------------------------------------------------------------------- TP layouts
# (writer TP, reader TP, groups off in the control). With 2 KV heads:
# - 4 -> 8: upstream keys GDN by KV head; with gdn_tp_keys alone the TP 8 reader asks for tp0..tp7
#   and TP 4 wrote tp0..tp3 (a miss), so the control turns both key groups off (upstream keys);
# - 8 -> 4: gdn_tp_keys alone is not enough: the TP 4 reader finds tp0..tp3, written by TP 8 ranks
#   0..3, which hold other GDN heads;
# - 2 -> 1: put_step 1, every rank keyed by its rank: the TP 1 reader asks for rank 0's keys, which
#   TP 2's rank 0 wrote with half the heads.
TP_CASES = [(4, 8, ("pool_key_layout", "gdn_tp_keys")), (8, 4, ("pool_key_layout",)), (2, 1, ("pool_key_layout",))]


@pytest.mark.pairs(*BASE)
@pytest.mark.parametrize("w,r,off", TP_CASES, ids=[f"tp{w}-to-tp{r}" for w, r, _ in TP_CASES])
def test_another_tp_layout_reads_a_miss(activate, w, r, off):
    reference = reference_outputs({"b": PROMPT[:HIT] + TAIL}, max_tokens=2)
    activate()
    pool = make_pool()
    a, b, loaded = _hit(pool, dict(tp=w, kv_heads=2), dict(tp=r, kv_heads=2))
    assert a.wrong_reads("a") == [] and _wrong(b, pool) == 0
    assert loaded == []  # a miss: B computes from token 0
    assert differing_tokens(b.outputs, reference) == 0
    activate(off=off)
    pool = make_pool()
    try:
        _a, b, loaded = _hit(pool, dict(tp=w, kv_heads=2), dict(tp=r, kv_heads=2))
    except RuntimeError as exc:  # vllm-ascend 0.26.0rc1 stops the engine on a failed load (by design)
        assert PAIR == "v0260" and pool.violations, exc
        print(f"\nTP {w} -> TP {r}, {', '.join(off)} off: the engine stopped on a load out of the blob ({exc})")
        return
    wrong = _wrong(b, pool)
    differ = differing_tokens(b.outputs, reference)
    print(f"\nTP {w} -> TP {r}, {', '.join(off)} off: {len(b.wrong_reads('b'))} wrong GDN reads, "
          f"{len(b.wrong_reads('b', kind='attn'))} wrong attention reads, {len(pool.violations)} out-of-blob copies, "
          f"{len(loaded)} keys loaded, {differ} of B's 2 tokens differ from a run without the pool")
    assert loaded and wrong > 0 and differ > 0


def test_same_layout_still_hits_with_the_right_bytes(activate):
    """The namespace changes no hit of an unchanged layout: TP 2 -> TP 2 hits 32 tokens, every
    rank loads its own GDN slice and the attention blocks it wrote."""
    activate()
    pool = make_pool()
    _a, b, loaded = _hit(pool, dict(tp=2, kv_heads=2), dict(tp=2, kv_heads=2))
    assert loaded and _wrong(b, pool) == 0
    if PAIR == "v0300":  # the key builder is bound with the namespace (upstream's key names the stage)
        (ns,) = {k.split("@")[0] for k in pool.ready_keys()}
        assert ns.startswith(f"alp{pool_key_layout.FORMAT}.") and ns.endswith(".tp2.pp1"), ns
        return
    names = set(b.on_ranks(_model_name))  # every rank's worker half, in its process
    assert len(names) == 1 and {k.split("@")[0] for k in pool.ready_keys()} == names
    (ns,) = names
    assert ns.startswith(f"alp{pool_key_layout.FORMAT}.") and ".tp2.pp1s0" in ns
    assert b.scheduler.connector.connector_scheduler.model_name == ns


# -------------------------------------------------------------------- a pool of older processes
@pytest.mark.pairs(*BASE)  # 0.30: keys without the library name no TP size (pool_key_tp): test_pool_upgrade.py
def test_a_pool_written_without_the_library_is_never_read(activate):
    """A writes with the library off (null mamba blocks published under real hashes, upstream keys);
    B reads with it on: a miss, 0 wrong reads. Control: B with everything but pool_key_layout reads
    A's keys."""
    activate(library=False)
    pool = make_pool()
    a = PoolInstance(pool, name="A", tp=1, kv_heads=2)
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    assert pool.ready_keys()
    for off, expect_loads in (((), False), (("pool_key_layout",), True)):
        activate(off=off)
        start = len(pool.copy_log)
        b = PoolInstance(pool, name="B" + "".join(off), tp=1, kv_heads=2)
        b.add_request("b", PROMPT[:16] + list(range(7, 28)), max_tokens=2)  # only block 0 shared
        engine_loop(b)
        loaded = _loads(pool, start)
        print(f"\nlibrary-off pool read with {off or 'nothing'} off: {len(loaded)} keys loaded, "
              f"{len(b.wrong_reads('b'))} wrong GDN reads, {len(b.wrong_reads('b', kind='attn'))} wrong attention reads")
        if expect_loads:  # the old keys are served: block 0's GDN key holds the null block's bytes
            assert loaded and b.wrong_reads("b")
        else:
            assert loaded == [] and _wrong(b, pool) == 0


# ---------------------------------------------------------------- checkpoints of the same name
def test_two_checkpoints_in_folders_of_the_same_name_share_no_key(activate):
    one, two = checkpoint_dir("GAGA", 2, "Qwen3-Next"), checkpoint_dir("GAGA", 2, "Qwen3-Next")
    assert one != two and os.path.basename(one) == os.path.basename(two)
    for off in ((), ("pool_key_layout",)):
        activate(off=off)
        pool = make_pool()
        a, _b, loaded = _hit(pool, dict(model_dir=one), dict(model_dir=two))
        written = {k.split("@")[0] for k in pool.ready_keys()}
        print(f"\nsame folder name, {off or 'nothing'} off: key prefixes {sorted(written)}, B loaded {len(loaded)} of A's keys")
        if off:
            assert loaded and len(written) == 1  # B reads the other checkpoint's bytes
        else:
            assert loaded == [] and len(written) == 2  # each checkpoint under its own keys


def test_the_model_id_switch_names_one_checkpoint_under_two_paths(activate, monkeypatch):
    """Instances mounting one checkpoint under different paths share keys when they name it."""
    monkeypatch.setenv(pool_key_layout.ENV_MODEL_ID, "qwen3-next-80b-a3b@rev1")
    activate()
    one, two = checkpoint_dir("GAGA", 2, "ckpt-a"), checkpoint_dir("GAGA", 2, "ckpt-b")
    pool = make_pool()
    _a, b, loaded = _hit(pool, dict(model_dir=one), dict(model_dir=two))
    assert loaded and _wrong(b, pool) == 0


# ------------------------------------------------------------------------------ pipeline stages
@pytest.mark.pairs(*BASE)
def test_pipeline_parallel_is_refused_at_startup(activate):
    """PP = 2 with the layerwise MemCache pool: vLLM's start-up stops with the reason."""
    activate()
    with pytest.raises(ValueError, match="refused with pipeline_parallel_size=2") as info:
        PoolInstance(make_pool(), name="PP", pp=2)
    assert "stage" in str(info.value) and "--pipeline-parallel-size 1" in str(info.value)


@pytest.mark.pairs(*BASE)
def test_without_the_group_two_stages_write_the_same_keys(activate):
    """Control: with pool_key_layout off, the PP = 2 instance starts, and the worker halves of its
    two stages build the same key for the same block (stage 1 overwrites / reads stage 0's layers)."""
    activate(off=("pool_key_layout",))
    inst = PoolInstance(make_pool(), name="PPoff", pp=2)
    stage0, stage1 = inst.stage_workers()
    assert (stage0.pp_rank, stage1.pp_rank) == (0, 1)
    assert stage0._make_layerwise_gva_key(1, "ab") == stage1._make_layerwise_gva_key(1, "ab")
    activate()
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        inst.stage_workers()


@pytest.mark.pairs("v0300")
def test_030_keys_name_the_pp_size(activate):
    """vllm-ascend 0.30.0rc2 names the stage in its keys but not the PP size: stage 0 of PP 2 and
    stage 0 of PP 4 (other layer ranges in one blob) build the same key without the group. The real
    builder, as both pool halves bind it (``bind_layerwise_keys``), for one checkpoint at PP 2 and 4."""
    from types import SimpleNamespace

    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import memcache_backend

    def key(pp: int, stage: int) -> str:
        parallel = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=pp)
        config = SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace(model="/ckpt/Qwen3-Next", revision=None))
        builder = memcache_backend.bind_layerwise_keys(  # looked up now: the patched one when applied
            vllm_config=config, kv_cache_config=None, model_name="Qwen3-Next", use_hybrid=True, grouped_block_size=[16, 16]
        )
        return builder.make_full_key(1, "ab", 0, stage)

    for off in (("pool_key_layout",), ()):
        activate(off=off)
        keys = {(pp, stage): key(pp, stage) for pp in (2, 4) for stage in range(2)}
        print(f"\n{off or 'nothing'} off: {keys}")
        assert keys[(2, 0)] != keys[(2, 1)]  # upstream names the stage either way
        if off:
            assert keys[(2, 0)] == keys[(4, 0)] and keys[(2, 1)] == keys[(4, 1)]  # PP 2 and PP 4 share keys
        else:
            assert len(set(keys.values())) == 4
            assert all(keys[(pp, s)].split("@")[0].endswith(f".tp2.pp{pp}") for pp, s in keys)  # the namespace


# ------------------------------------------------------------------------ evictions, GVA cache
@pytest.mark.parametrize("how", ["evicted", "failed"])
def test_a_lost_prefix_is_saved_again(activate, how):
    """A saves PROMPT; MemCache evicts A's keys (or every save copy fails, so they are finished as
    failed); A (its prefix cache reset) serves PROMPT again: saved again, so B hits it. Without the
    group, vllm-ascend 0.25.1rc1's GVA cache still lists the keys: nothing is saved and B misses for
    the worker's lifetime (0.26.0rc1 refreshes its cache itself: it recovers there without the
    group; a failed save copy stops its engine, so "failed" runs on 0.25 only)."""
    if how == "failed" and PAIR in ("v0260", "v0300"):
        pytest.skip(f"vllm-ascend on {PAIR} stops the engine at a failed save copy (no failed finish to refresh from)")
    from byte_store import L2G

    for off in ((), ("pool_key_layout",)):
        activate(off=off)
        # the failed case re-saves at once: MemCache refuses the same client's allocation of a key for
        # ~2 s after it finished that key with a failure (test_store_conformance), so it runs on the
        # byte store, which hands the key out again at once as MemCache does after that while
        pool = make_pool("bytes" if how == "failed" else None)
        a = PoolInstance(pool, name="A", tp=1, kv_heads=2)
        if how == "failed":
            pool.add_fault("error", direction=L2G)
        a.add_request("a1", PROMPT, max_tokens=1)
        engine_loop(a)
        if how == "failed":
            pool.clear_faults()
            assert pool.ready_keys() == [] and a.ranks[0].connector.connector_worker._allocated_gvas
        else:
            assert pool.evict(lambda key: True)
        assert a.scheduler.reset_prefix_cache()
        a.add_request("a2", PROMPT, max_tokens=1)
        engine_loop(a)
        start = len(pool.copy_log)
        b = PoolInstance(pool, name="B", tp=1, kv_heads=2)
        b.add_request("b", PROMPT[:HIT] + TAIL, max_tokens=2)
        engine_loop(b)
        loaded = _loads(pool, start)
        print(f"\n{how} prefix, {off or 'nothing'} off: {len(pool.ready_keys())} keys ready after the second "
              f"serve, B loaded {len(loaded)}")
        if off and PAIR == "v0251":
            assert loaded == []  # the miss that never recovers: the evicted keys are never saved again
        else:
            assert loaded and _wrong(b, pool) == 0
        assert pool.violations == []


if PAIR in ("v0260", "v0300"):  # both save an evicted key again by themselves: 0.25.1rc1's defect, as a control
    test_a_lost_prefix_is_saved_again = pytest.mark.control(
        "vllm-ascend 0.26 / 0.30 refresh their saved-key map from MemCache themselves: the prefix is saved again without the group"
    )(test_a_lost_prefix_is_saved_again)


def test_the_gva_cache_stays_bounded(activate, monkeypatch):
    """Many distinct prefixes through one instance: the worker's GVA map never holds more than the
    bound (set small here); without the group it holds a key per saved block and group."""
    monkeypatch.setenv(pool_key_layout.ENV_GVA_MAX, "40")
    sizes = {}
    for off in ((), ("pool_key_layout",)):
        activate(off=off)
        inst = PoolInstance(make_pool(), name="soak", tp=1, kv_heads=2, max_num_seqs=64, num_blocks=256,
                            max_num_batched_tokens=2048)
        worker = inst.ranks[0].connector.connector_worker
        peak = 0
        n = SOAK_REQUESTS
        for i in range(n):
            inst.add_request(f"r{i}", list(range(100_000 + 20 * i, 100_000 + 20 * i + 17)), max_tokens=1)
            if i % 64 == 63 or i == n - 1:
                engine_loop(inst, on_step=lambda *_: None)
                peak = max(peak, len(worker._allocated_gvas))
        sizes[off] = (peak, len(worker._allocated_gvas))
        assert not inst.has_work()
    print(f"\nGVA map over {SOAK_REQUESTS} requests (peak, end): on {sizes[()]}, group off {sizes[('pool_key_layout',)]}")
    assert sizes[()][0] <= 40
    assert sizes[("pool_key_layout",)][1] >= SOAK_REQUESTS  # one key per request at least, never trimmed


SOAK_REQUESTS = int(os.environ.get("ALP_GVA_SOAK_REQUESTS", "1000"))
