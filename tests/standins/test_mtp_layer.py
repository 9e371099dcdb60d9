"""Issue 33: MTP speculative decoding with the layerwise pool -- the MTP layer and its drafter.

The pool harness with ``mtp=N`` carries vLLM's SpeculativeConfig for the checkpoint's MTP, the draft
model's attention layer ``mtp.layers.0.self_attn.attn`` in the KV cache (vLLM puts it in the target's
attention group) and a stand-in drafter that runs as the runners draft: after the target's forward,
inside the connector's bound metadata (``defer_finalize``), the MTP layer once per draft token, then
``finalize_kv_connector``; none in a step whose batch does not fit the drafter (the runners'
``input_fits_in_drafter`` rule: zeros are proposed). Its proposals are right only where its first
pass read right MTP KV (on every rank) and the target's hidden state was right. They are scheduled as
speculative tokens (sync scheduling: ``update_draft_token_ids`` after the step, as
``EngineCore.post_step``; async scheduling: the scheduler's placeholders, the runner's own drafts,
the rejected ones taken back at the next step) and verified as vLLM's rejection sampler does; the
GDN layers read and write their per-draft state slots and the align postprocess copies the accepted
state (``harness_pool.rank_step``). ``PoolInstance.acceptance`` counts each proposal's draft tokens
that the target's tokens confirm.

- A pool hit under MTP: A prefills 48 tokens (as vLLM chunks them, or in 16-token chunks), B asks them plus 5 on a
  second instance. B's tokens are those of a run without the pool, no GDN / attention / MTP read is
  wrong, and B's acceptance equals the run without the pool (deterministic drafter: equal counts).
- vllm-ascend 0.25.1rc1 keys the MTP layer as physical layer 0 (group ``mtp_layer`` off): its KV is
  saved when the target's first layer runs, before the drafter wrote it; B's MTP layer reads stale KV
  on the hit and its drafts are rejected.
- A step whose drafter did not run (a request reaching the model length): every pair's sending thread
  then finds the step's save events still set at the next save ("save failed"); ``mtp_step_end``
  finishes the MTP layer at the step's end.
"""

from __future__ import annotations

import logging

import pytest

from support import PAIR, library_off

PAIRS = ("v0251", "v0260", "v0300")
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from ascend_layerwise_patch.patches import mtp_layer  # noqa: E402
from harness_pool import PoolInstance, engine_loop, groups_skipped, make_pool  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

A = list(range(6000, 6048))  # 48 tokens, 16-token blocks
B = A + [1, 2, 3, 4, 5]
MAX_TOKENS = 12

#: where B resumes, by pair and A's chunk (0: as vLLM's scheduler chunks it under MTP -- 32 + 16, its
#: mamba-aligned split): 0.26 trims an MTP hit by a block (test_mtp_pool_hit.py) and resumes on the
#: state saved below it
RESUMED = {"v0251": {0: 48, 16: 48}, "v0260": {0: 32, 16: 32}, "v0300": {0: 48, 16: 48}}


def _reference(k: int, async_: bool = False) -> dict:
    """B alone on an instance without the pool, with the same drafter and scheduling."""
    ref = PoolInstance(None, name="reference", mtp=k, async_scheduling=async_)
    req = ref.add_request("b", B, max_tokens=MAX_TOKENS)
    engine_loop(ref)
    return {"tokens": list(req.output_token_ids), "acceptance": ref.acceptance("b")}


def _hit(k: int, chunk: int, tp: int = 1, async_: bool = False, **kw) -> dict:
    kw["async_scheduling"] = async_
    if async_:  # two steps' sends open at once: a block pool of 64 sheds A's last chunk (send_shedding's
        kw.setdefault("num_blocks", 128)  # bound, half the pool: MTP 3's speculative blocks count too)
    pool = make_pool()
    a = PoolInstance(pool, name="A", mtp=k, tp=tp, long_prefill_token_threshold=chunk, **kw)
    try:
        a.add_request("a", A, max_tokens=1)
        engine_loop(a)
    finally:
        a.close()
    b = PoolInstance(pool, name="B", mtp=k, tp=tp, **kw)
    try:
        req = b.add_request("b", B, max_tokens=MAX_TOKENS)
        engine_loop(b)
    finally:
        b.close()
    first = b.reads_of("b", kind="attn", step=0)
    mtp_first = [r for r in first if r.layer in b.mtp_layers]
    return {
        "resumed": max((r.expected for r in b.reads_of("b", step=0)), default=0),
        "wrong": {kind: len(b.wrong_reads("b", kind=kind)) for kind in ("gdn", "attn")},
        "wrong_mtp": len([r for r in b.wrong_reads("b", kind="attn") if r.layer in b.mtp_layers]),
        "hit_mtp_reads": (sum(r.ok for r in mtp_first), len(mtp_first)),
        "tokens": list(req.output_token_ids),
        "acceptance": b.acceptance("b"),
    }


#: on v0300 the hit cases vouch for 0.30's own MTP layer index (mtp_layer_030): they pass with the
#: library off there too (test_030_... below runs one with it off)
_VOUCH = pytest.mark.control("v0300: vllm-ascend 0.30.0rc2 keys the MTP layer after the target's itself (mtp_layer_030)")
CASES = [
    pytest.param(k, chunk, tp, async_, id=f"mtp{k}-chunk{chunk or 'vllm'}-tp{tp}" + ("-async" if async_ else ""), marks=[_VOUCH] if PAIR == "v0300" else [])
    for k, chunk, tp, async_ in [
        (1, 0, 1, False), (1, 16, 1, False), (1, 16, 2, False), (3, 0, 1, False), (3, 16, 1, False), (3, 16, 2, False),
        (3, 0, 1, True), (3, 16, 2, True),
        (3, 16, 8, True),  # the shape users serve: TP 8 over 2 KV heads, async scheduling, MTP 3
    ]
]


@pytest.mark.parametrize("k,chunk,tp,async_", CASES)
def test_an_mtp_pool_hit_serves_what_the_run_without_the_pool_serves(k, chunk, tp, async_):
    """Sync scheduling and async scheduling (vLLM's default), TP 1 and 2 (one process per rank)."""
    ref = _reference(k, async_)
    on = _hit(k, chunk, tp, async_)
    how = "vLLM's chunks" if not chunk else f"{chunk}-token chunks"
    print(f"\n{PAIR}, MTP {k}, A prefilled in {how}, TP {tp}, {'async' if async_ else 'sync'} scheduling: "
          f"B resumed at {on['resumed']}, MTP reads on the hit right {on['hit_mtp_reads'][0]} of {on['hit_mtp_reads'][1]}, "
          f"wrong reads {on['wrong']}, acceptance {on['acceptance']} (without the pool {ref['acceptance']})")
    assert on["resumed"] == RESUMED[PAIR][chunk], on
    assert on["wrong"] == {"gdn": 0, "attn": 0}, on
    if on["resumed"]:
        assert on["hit_mtp_reads"][1] == tp * on["resumed"] // 16, on  # every rank's draft layer read every hit block
    assert on["tokens"] == ref["tokens"]
    assert on["acceptance"] == ref["acceptance"] and ref["acceptance"]["accepted"] > 0


@pytest.mark.pairs("v0251")
@pytest.mark.parametrize("k", [1, 3])
def test_without_mtp_layer_a_hit_loads_draft_kv_saved_before_the_drafter_wrote_it(k):
    """vllm-ascend 0.25.1rc1 as released: the MTP layer is physical layer 0, saved with the target's
    first layer. B's draft layer reads every hit block wrong; the target verifies, so B's tokens are
    right and only its acceptance drops."""
    ref = _reference(k)
    with groups_skipped("mtp_layer"):
        off = _hit(k, 16)
    print(f"\nmtp_layer off, MTP {k}: MTP reads on the hit right {off['hit_mtp_reads'][0]} of {off['hit_mtp_reads'][1]}, "
          f"{off['wrong_mtp']} wrong MTP reads in all, acceptance {off['acceptance']} (without the pool {ref['acceptance']})")
    assert off["resumed"] == 48 and off["hit_mtp_reads"] == (0, 3)
    assert off["wrong"]["gdn"] == 0 and off["wrong_mtp"] == off["wrong"]["attn"] > 0  # only the draft layer
    assert off["tokens"] == ref["tokens"]
    assert off["acceptance"]["accepted"] < ref["acceptance"]["accepted"]


# ------------------------------------------------------------------ a step the drafter skips
def _to_the_model_length(vllm_log) -> dict:
    """A request that reaches the model length (64): its last steps do not fit the drafter (48 + 16
    tokens, 3 draft tokens), then another request on the same instance."""
    pool = make_pool()
    a = PoolInstance(pool, name="A", mtp=3, max_model_len=64, long_prefill_token_threshold=16)
    out: dict = {"error": None}
    try:
        long = a.add_request("long", A, max_tokens=16)
        engine_loop(a, max_steps=60)
        after = a.add_request("after", [7, 8, 9] * 10, max_tokens=4)
        engine_loop(a, max_steps=60)
    except Exception as exc:  # noqa: BLE001 - the engine's stop, reported
        cause = exc.__cause__ or exc.__context__
        out["error"] = f"{type(exc).__name__}: {str(exc)[:200]}" + (f" (from {type(cause).__name__}: {str(cause)[:200]})" if cause else "")
        long = after = None
    out["tokens"] = (len(long.output_token_ids), len(after.output_token_ids)) if long is not None else None
    out["save_failed"] = len([r for r in vllm_log.records if r.levelno >= logging.ERROR and "save failed" in r.getMessage()])
    return out


def test_a_step_without_a_draft_finishes_its_layers(vllm_log):
    before = mtp_layer.counters()["steps_without_draft"]
    on = _to_the_model_length(vllm_log)
    skipped = mtp_layer.counters()["steps_without_draft"] - before
    print(f"\n{PAIR}, a request to the model length under MTP 3: {skipped} steps without a draft, {on}")
    assert on == {"error": None, "tokens": (16, 4), "save_failed": 0}
    assert skipped >= 1


@pytest.mark.control("pins upstream's defect with mtp_step_end's check made to answer 'drafted': the library off has it too")
def test_without_mtp_step_end_a_step_without_a_draft_breaks_the_sending_thread(vllm_log, monkeypatch):
    """``mtp_step_end`` off (its check answers "drafted" always): the step's final layer (the MTP
    layer) never saves, the step's save events stay set, and the next step's first layer save stops
    the layer sending thread on its "save failed" assertion (0.30 raises it into the engine)."""
    monkeypatch.setattr(mtp_layer, "undrafted", lambda worker: False)
    off = _to_the_model_length(vllm_log)
    print(f"\n{PAIR}, mtp_step_end off: {off}")
    assert off["save_failed"] > 0 or (off["error"] and "save failed" in off["error"]), off


@pytest.mark.pairs("v0300")
@pytest.mark.control("vouches 0.30.0rc2's own MTP layer index (mtp_layer_030): the library is off in the test")
def test_030_an_mtp_hit_reads_the_draft_kv_the_drafter_wrote_with_the_library_off(monkeypatch):
    """vLLM 0.30 + vllm-ascend 0.30.0rc2, library off: the MTP layer is physical layer
    ``num_hidden_layers`` there, saved after the drafter; B's draft layer reads its hit blocks right
    and B's acceptance is the run without the pool's. (On 0.26 the library has no MTP code on this
    path either -- mtp_layer_026 applies nothing -- and the hit test above reads right there; the
    whole library off, 0.26's GDN layers do not wait for their load and the hit cannot run.)"""
    ref = _reference(3)
    with library_off():
        off = _hit(3, 16)
    print(f"\nv0300, library off, MTP 3: MTP reads on the hit right {off['hit_mtp_reads'][0]} of {off['hit_mtp_reads'][1]}, "
          f"acceptance {off['acceptance']} (without the pool {ref['acceptance']})")
    assert off["resumed"] == 48 and off["hit_mtp_reads"] == (3, 3) and off["wrong"] == {"gdn": 0, "attn": 0}
    assert off["tokens"] == ref["tokens"] and off["acceptance"] == ref["acceptance"]


def _graph_hits() -> dict:
    """A drafts as a graph (its MTP layer computes, no connector hook runs around it); C (hooks as
    usual) and D (drafting as a graph) hit A's keys."""
    before = mtp_layer.counters()["steps_without_draft"]
    pool = make_pool()
    a = PoolInstance(pool, name="A", mtp=3, long_prefill_token_threshold=16, draft_graph=True)
    a.add_request("a", A, max_tokens=MAX_TOKENS)
    engine_loop(a)
    out = {"finished": mtp_layer.counters()["steps_without_draft"] - before, "steps": a.steps, "a_gdn_wrong": len(a.wrong_reads(kind="gdn"))}
    for name, graph in (("C", False), ("D", True)):
        inst = PoolInstance(pool, name=name, mtp=3, draft_graph=graph)
        inst.add_request("b", B, max_tokens=MAX_TOKENS)
        engine_loop(inst)
        hit = [r for r in inst.reads_of("b", kind="attn", step=0) if r.layer in inst.mtp_layers]
        out[name] = {
            "hit_mtp_reads": (sum(r.ok for r in hit), len(hit)),
            "wrong": {kind: len(inst.wrong_reads("b", kind=kind)) for kind in ("gdn", "attn")},
            "tokens": inst.outputs["b"],
            "acceptance": inst.acceptance("b"),
        }
    return out


def test_a_draft_replayed_as_a_graph_waits_for_its_load_and_pools_its_kv():
    """The drafter replayed as a captured graph. ``mtp_step_end`` waits for the MTP layer's load once
    the target's last layer is saved (before the draft reads it) and finishes its save at the step's
    end (after the draft wrote it), in every step: C and D read right draft KV on the hit and keep
    the run without the pool's acceptance."""
    ref = _reference(3)
    out = _graph_hits()
    print(f"\n{PAIR}, drafting as a graph, MTP 3: {out}")
    assert out["finished"] >= out["steps"] - 1 and out["a_gdn_wrong"] == 0
    n = RESUMED[PAIR][16] // 16
    for name in "CD":
        got = out[name]
        assert got["hit_mtp_reads"] == (n, n) and got["wrong"] == {"gdn": 0, "attn": 0}, (name, got)
        assert got["tokens"] == ref["tokens"] and got["acceptance"] == ref["acceptance"], (name, got)


@pytest.mark.pairs("v0251")
def test_without_the_early_load_wait_a_graph_draft_reads_its_hit_before_the_load(monkeypatch):
    """``mtp_step_end``'s early wait off (its check answers "not yet" always): on 0.25.1rc1 the MTP
    layer's load is submitted by its own wait, so D, drafting as a graph, reads the hit's MTP blocks
    before their load; its tokens stay right, its drafts fail. (0.26 / 0.30 prefetch the layer during
    the target's last one: there the draft races the load's copy, which lands first on the harness.)"""
    ref = _reference(3)
    monkeypatch.setattr(mtp_layer, "target_done", lambda worker: False)
    out = _graph_hits()
    print(f"\n{PAIR}, drafting as a graph, early load wait off: D {out['D']} (without the pool {ref['acceptance']})")
    assert out["D"]["hit_mtp_reads"][0] < out["D"]["hit_mtp_reads"][1]
    assert out["D"]["tokens"] == ref["tokens"] and out["D"]["acceptance"]["accepted"] < ref["acceptance"]["accepted"]
