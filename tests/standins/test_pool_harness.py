"""Smoke test of the pool harness (tests/standins/harness_pool, the ``PoolInstance`` part).

Real vLLM 0.25.1 / 0.26.0 Scheduler / KVCacheManager (align mode) + vllm-ascend's AscendStore connector
halves from KVConnectorFactory + real layer threads, over the byte-level MemCache stand-in.
"""

from __future__ import annotations

import pytest

from support import PAIR

PAIRS = ("v0251", "v0260")
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from harness_pool import PoolInstance, engine_loop, make_pool, next_token  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

PROMPT = list(range(1000, 1040))  # 40 tokens: 2 full 16-token blocks + 8


def _per_group(inst: PoolInstance, keys) -> dict:
    """Ready keys per kind of group ("attn" / "mamba"); keys are model@group@hash@rank."""
    kinds = {g: ("mamba" if grp.layer_names[0] in inst.gdn_layers else "attn") for g, grp in enumerate(inst.kv_cache_config.kv_cache_groups)}
    out = {"attn": 0, "mamba": 0}
    for key in keys:
        out[kinds[int(key.split("@")[1])]] += 1
    return out


def test_save_then_pool_hit_on_a_second_instance():
    pool = make_pool()
    a = PoolInstance(pool, name="A")
    a.add_request("a", PROMPT, max_tokens=2)
    steps = engine_loop(a)
    assert not a.has_work() and steps >= 2
    # the instance generated what the stand-in model samples, one token per step after the prompt
    first = next_token(PROMPT)
    assert a.outputs["a"] == [first, next_token(PROMPT + [first])]
    # A computed from its own states: every layer read what it had written
    assert a.reads_of("a") and a.wrong_reads("a") == [] and a.wrong_reads("a", kind="attn") == []
    # the pool holds the two full attention blocks and the mamba state after 32 tokens (block 1;
    # block 0 is vLLM's null block, published only by vllm-ascend as released), finished, every
    # layer slot written
    ready = pool.ready_keys()
    assert _per_group(a, ready) in ({"attn": 2, "mamba": 1}, {"attn": 2, "mamba": 2}), ready
    for key in ready:
        group = int(key.split("@")[1])
        layers = len(a.kv_cache_config.kv_cache_groups[group].layer_names)
        assert pool.written_slots(key, layers) == set(range(layers)), key
    assert pool.violations == []

    b = PoolInstance(pool, name="B")  # empty HBM, same pool
    b.add_request("b", PROMPT[:32] + [7, 8, 9, 10, 11], max_tokens=1)
    engine_loop(b)
    loads = [keys for direction, keys, res in pool.copy_log if direction == 1 and res == 0]
    assert loads, "B loaded nothing from the pool"
    first_step = b.first_step_of("b")
    attn = b.reads_of("b", kind="attn", step=first_step)
    assert attn and all(r.expected == 32 for r in attn if r.block_index == 1)
    assert b.wrong_reads("b", kind="attn") == []  # full attention KV came from the pool
    gdn = b.reads_of("b", step=first_step)
    assert {r.layer for r in gdn} == set(b.gdn_layers) and all(r.expected == 32 for r in gdn)
    assert pool.violations == []


@pytest.mark.control("no connector: vLLM's own prefix cache, no patch involved")
def test_local_prefix_hit_without_a_connector():
    """The control: no KV connector at all; vLLM's own prefix cache serves B's first 32 tokens."""
    inst = PoolInstance(None, name="local")
    inst.add_request("a", PROMPT, max_tokens=1)
    engine_loop(inst)
    inst.add_request("b", PROMPT[:32] + [7, 8, 9, 10, 11], max_tokens=1)
    engine_loop(inst)
    first_step = inst.first_step_of("b")
    gdn = inst.reads_of("b", step=first_step)
    assert gdn and all(r.expected == 32 for r in gdn)
    assert inst.wrong_reads("b") == [] and inst.wrong_reads("b", kind="attn") == []


def test_tensor_parallel_ranks_and_faults():
    """TP=2 (one KV head): two rank processes; an injected load error is seen (on
    v0260 as upstream's fail-fast error)."""
    pool = make_pool()
    a = PoolInstance(pool, name="A", tp=2, kv_heads=1)
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    assert a.wrong_reads("a") == [] and {r.rank for r in a.reads_of("a")} == {0, 1}
    # one KV head: attention keys of the leader rank only (rank field 0); GDN keys carry every
    # rank's own slice (gdn_tp_keys: rank field tp0 / tp1)
    ready = pool.ready_keys()
    counts = _per_group(a, ready)
    assert counts["attn"] == 2 and counts["mamba"] in (2, 4), ready
    kinds = {g: ("mamba" if grp.layer_names[0] in a.gdn_layers else "attn") for g, grp in enumerate(a.kv_cache_config.kv_cache_groups)}
    ranks = {kind: {k.rsplit("@", 1)[1] for k in ready if kinds[int(k.split("@")[1])] == kind} for kind in ("attn", "mamba")}
    assert ranks == {"attn": {"0"}, "mamba": {"tp0", "tp1"}}, ready

    fault = pool.add_fault("error", direction=1, times=1)
    b = PoolInstance(pool, name="B", tp=2, kv_heads=1)
    b.add_request("b", PROMPT[:32] + [7, 8, 9, 10, 11], max_tokens=1)
    if PAIR == "v0260":
        # vllm-ascend 0.26.0rc1 fails fast: the receiving thread stops and the worker of the rank whose
        # copy failed raises -- that rank only: the other waits in the layer's all-reduce for it (here
        # until the harness's gloo timeout; on an NPU, HCCL's operator timeout)
        import rank_procs

        with pytest.raises(rank_procs.RankFailure) as failure:
            engine_loop(b)
        assert fault.hits == 1
        raised = str(failure.value).split("--- rank ")[1:]
        assert len(raised) == 2, failure.value
        assert sum("KVCacheStoreLayerRecvingThread failed" in text for text in raised) == 1, failure.value
        assert sum("all_reduce" in text and "Timed out" in text for text in raised) == 1, failure.value
        return
    engine_loop(b)
    assert fault.hits == 1
    assert [res for direction, _keys, res in pool.copy_log if direction == 1].count(-1) == 1
    assert {r.rank for r in b.reads_of("b")} == {0, 1}


@pytest.mark.pairs("v0251")
def test_a_fault_aimed_at_one_rank_hits_only_that_rank_s_copies():
    """``Fault.caller`` (the simulation's faults aimed at one TP rank): a load error for every copy
    B's rank 1 makes fails exactly those copies, none of rank 0's."""
    pool = make_pool("bytes")
    a = PoolInstance(pool, name="A", tp=2)
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    a.close()
    b = PoolInstance(pool, name="B", tp=2)
    pids = [p.pid for p in b.procs.procs]
    loads: dict[int, int] = {}
    pool.observers.append(lambda direction, items, host: direction == 1 and loads.__setitem__(host.pid, loads.get(host.pid, 0) + 1))
    fault = pool.add_fault("error", direction=1, caller=lambda pid: pid == pids[1])
    try:
        b.add_request("b", PROMPT[:32] + [7, 8, 9], max_tokens=1)
        engine_loop(b)
    finally:
        pool.clear_faults()
        b.close()
    failed = [res for direction, _keys, res in pool.copy_log if direction == 1].count(-1)
    print(f"\nload copies by rank: {[loads.get(p, 0) for p in pids]}; failed {failed}, fault hits {fault.hits}")
    assert loads.get(pids[0], 0) > 0 and loads.get(pids[1], 0) > 0
    assert fault.hits == loads[pids[1]] == failed
