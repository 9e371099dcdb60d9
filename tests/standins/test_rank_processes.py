"""The pool harness's own self-test: TP ranks as processes (``PoolInstance(processes=True)``).

What it must see as production does: each rank its own process and module state, a real gloo TP
group behind vLLM's ``get_tp_group()``, one rank's wrong byte reaching every rank through TP's
all-reduce, and a rank that skips a collective or never answers failing the step within a bound,
named -- never a hung run.
"""

from __future__ import annotations

import os
import time
import types

import pytest
import torch

from support import PAIR

PAIRS = ("v0251", "v0260", "v0300")
if PAIR not in PAIRS:
    pytest.skip(f"the pool harness runs on {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

import rank_procs  # noqa: E402
from harness_pool import PoolInstance, engine_loop, make_pool, next_token  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)
#: the harness's self-tests (processes, collectives, bounds, one wrong byte): no patch involved
SELF_TEST = pytest.mark.control("the harness's own self-test: no patch involved")
#: a whole save-and-hit at each layout needs the library's per-rank GDN keys and GDN layer waits on
#: vllm-ascend 0.25.1rc1 / 0.26.0rc1 (without it: wrong reads, or a load step that never ends); on
#: 0.30.0rc2 upstream does both itself
LAYOUT_MARKS = [pytest.mark.control("vllm-ascend 0.30.0rc2 keys GDN state per rank and waits per layer itself")] if PAIR == "v0300" else []

PROMPT = list(range(2000, 2040))  # 40 tokens


@pytest.fixture
def instances():
    made: list[PoolInstance] = []
    yield made
    for inst in made:
        inst.close()


# ---------------------------------------------------------------- functions run in a rank process
def _skip_collectives(rank) -> None:
    """Planted defect: this rank's layers never enter TP's all-reduce."""
    rank._all_reduce = types.MethodType(lambda self, layer, outputs: None, rank)


def _hang_rank_1(rank, seconds: float) -> int:
    if rank.rank == 1:
        time.sleep(seconds)
    return rank.rank


def _corrupt_states(rank, req_id: str, layer_name: str) -> int:
    """Flips one byte of every state block ``req_id`` holds for ``layer_name`` on this rank."""
    st = rank.requests[req_id]
    group = rank.inst.group_of[layer_name]
    conv = list.__iter__(rank.layers[layer_name].kv_cache).__next__()
    flipped = 0
    for block_id in st.block_ids[group]:
        if block_id:
            view = conv[block_id].view(-1).view(torch.uint8)
            view[0] ^= 0xFF
            flipped += 1
    return flipped


def _content(rank, req_id: str, layer_name: str, block_index: int):
    return rank.content(req_id, layer_name, block_index)


# ---------------------------------------------------------------- tests
@SELF_TEST
def test_each_rank_is_a_process_with_vllms_tp_group(instances):
    inst = PoolInstance(make_pool(), name="P", tp=4, kv_heads=2, processes=True)
    instances.append(inst)
    views = inst.on_ranks(rank_procs.tp_group_view)
    assert [(v["rank"], v["world"], v["cpu_group_size"]) for v in views] == [(r, 4, 4) for r in range(4)]
    pids = {v["pid"] for v in views}
    assert len(pids) == 4 and os.getpid() not in pids


@SELF_TEST
def test_module_state_is_per_process(instances):
    inst = PoolInstance(make_pool(), name="M", tp=2, kv_heads=2, processes=True)
    instances.append(inst)
    inst.procs.call(rank_procs.set_mark, "rank-1-was-here", ranks=[1])
    marks = [mark for mark, _pid in inst.on_ranks(rank_procs.get_mark)]
    assert marks == [None, "rank-1-was-here"]
    assert rank_procs.MARK is None  # nor in the engine core's process


@SELF_TEST
def test_a_rank_that_skips_the_collective_fails_the_step_in_bound(instances, monkeypatch):
    monkeypatch.setattr(rank_procs, "COLLECTIVE_TIMEOUT_S", 3.0)  # read by the ranks when they start
    inst = PoolInstance(make_pool(), name="S", tp=2, kv_heads=2, processes=True)
    instances.append(inst)
    inst.procs.call(_skip_collectives, ranks=[1])
    inst.add_request("s", PROMPT, max_tokens=1)
    start = time.monotonic()
    with pytest.raises(rank_procs.RankFailure) as failure:
        engine_loop(inst)
    assert time.monotonic() - start < rank_procs.REPLY_LIMIT_S
    text = str(failure.value)
    assert "TP ranks [0] failed" in text and "ranks [1] answered" in text, text
    assert "--- rank 0 raised" in text and "--- rank 1 raised" not in text


@SELF_TEST
def test_a_rank_that_never_answers_is_named(instances):
    inst = PoolInstance(make_pool(), name="H", tp=2, kv_heads=2, processes=True)
    instances.append(inst)
    inst.procs.reply_limit = 2.0
    start = time.monotonic()
    with pytest.raises(rank_procs.RankFailure, match=r"ranks \[1\] did not come back within 2 s\nranks \[0\] answered") as failure:
        inst.procs.call(_hang_rank_1, 30.0)
    assert time.monotonic() - start < 10.0
    assert "--- rank 1 is at:" in str(failure.value) and "_hang_rank_1" in str(failure.value)  # where it hangs


@SELF_TEST
@pytest.mark.parametrize("processes", [True, False], ids=["processes", "one-process"])
def test_one_wrong_byte_on_one_rank_reaches_every_rank(instances, processes):
    """Rank 1's GDN state of layer 0 is damaged between two chunks. Rank 1 reads it wrong, rank 0
    reads its own right; the token sampled is not the clean one. Only with the ranks as processes
    does TP's all-reduce carry the damage into rank 0's later layers (its layer-2 GDN state is
    written from the damaged hidden state) -- in one process each rank's layers see only its own."""
    inst = PoolInstance(None, name="W", tp=2, kv_heads=2, max_num_batched_tokens=16, processes=processes)
    instances.append(inst)
    inst.add_request("w", PROMPT, max_tokens=1)
    inst.step()  # the first 16 tokens
    gdn0, gdn2 = inst.gdn_layers
    if processes:
        assert inst.procs.call(_corrupt_states, "w", gdn0, ranks=[1]) == [1]
    else:
        assert _corrupt_states(inst.ranks[1], "w", gdn0) == 1
    inst.step()  # tokens 16-32: rank 1 starts from the damaged state
    wrong = inst.wrong_reads("w")
    assert {(r.rank, r.layer) for r in wrong} == {(1, gdn0)}
    later = inst.on_ranks(_content, "w", gdn2, 1)  # the state after 32 tokens, layer 2, each rank
    if processes:
        assert later == ["other", "other"]
    else:
        assert later == [32, "other"]
    engine_loop(inst)
    assert inst.outputs["w"] != [next_token(PROMPT)]


#: (TP size, KV heads) the harness serves with ranks as processes; TP 8 over 2 KV heads is the
#: production shape (put_step 4: attention keys from ranks 0 and 4 only)
LAYOUTS = [(1, 2), (2, 1), (2, 4), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]


@pytest.fixture(scope="module")
def reference():
    from harness_pool import reference_outputs

    return reference_outputs({"b": PROMPT[:32] + [7, 8, 9, 10, 11]}, max_tokens=2)


@pytest.mark.parametrize("tp,kv_heads", [pytest.param(t, k, marks=LAYOUT_MARKS) for t, k in LAYOUTS],
                         ids=[f"tp{t}-kv{k}" for t, k in LAYOUTS])
def test_layout_saves_and_hits(instances, reference, tp, kv_heads):
    """A saves, B (same layout, empty cache) hits 32 tokens: every rank of B reads every state and
    KV block right and B samples the tokens of a run without the pool; the pool holds a GDN key of
    every rank and attention keys of min(TP, KV heads) saving ranks."""
    pool = make_pool()
    a = PoolInstance(pool, name="A", tp=tp, kv_heads=kv_heads, processes=True)
    instances.append(a)
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    a.close()
    groups = a.kv_cache_config.kv_cache_groups
    mamba = {g for g, grp in enumerate(groups) if grp.layer_names[0] in a.gdn_layers}
    ranks = {"attn": set(), "mamba": set()}
    for key in pool.ready_keys():
        ranks["mamba" if int(key.split("@")[1]) in mamba else "attn"].add(key.rsplit("@", 1)[1])
    assert len(ranks["attn"]) == min(tp, kv_heads) and len(ranks["mamba"]) == tp, ranks

    b = PoolInstance(pool, name="B", tp=tp, kv_heads=kv_heads, processes=True)
    instances.append(b)
    b.add_request("b", PROMPT[:32] + [7, 8, 9, 10, 11], max_tokens=2)
    engine_loop(b)
    reads = b.reads_of("b", step=b.first_step_of("b"))
    assert {r.rank for r in reads} == set(range(tp)) and all(r.expected == 32 for r in reads)
    assert b.wrong_reads("b") == [] and b.wrong_reads("b", kind="attn") == []
    assert b.outputs == reference
