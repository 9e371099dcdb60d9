"""Async scheduling races (issue 23), forced on the pool harness: library off shows them, on does not.

Race 2 (``async_fences``): on a kv_producer with async scheduling, a request aborted while its last
step is still on the device has its blocks freed at once (vLLM defers frees for kv_consumer roles
only), a pool-hit request gets them as layerwise load targets, and the in-flight step's writes land
on the loaded bytes. The device is stood in for by ``harness_pool.InFlightWrites``: the writes of
the batch in flight land at the next batch's first layer compute (after its layer loads started) or
when the batch's output is processed, whichever comes first. On vLLM 0.30 + vllm-ascend 0.30.0rc2
(v0300, member ``async_free_fence_030``) the KV cache groups overlay one allocation: the aborted
request's in-flight attention write lands on a GDN state the pool hit loaded into the same bytes.
"""

from __future__ import annotations

import os

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.patches import async_fences
from ascend_layerwise_patch.patches.gdn_layerwise import mamba_precopy
from ascend_layerwise_patch.registry import APPLIED, SKIPPED

from support import PAIR, activate_skipping

PAIRS = ("v0251", "v0260", "v0300")
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from harness_pool import DelayedUploads, InFlightWrites, PoolInstance, engine_loop, make_pool  # noqa: E402
from harness_pool.async_drivers import block_spans, overlaps  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

PREFIX = list(range(3000, 3040))  # 2 full blocks of 16 in the pool (saved by another instance)
HIT = PREFIX[:32] + [1, 2, 3, 4, 5]
OTHER = list(range(5000, 5020))  # the request aborted while its step is in flight


_MEMBER = "async_free_fence_030" if PAIR == "v0300" else "async_free_fence"  #: the member in range


def _set(on: bool) -> None:
    reg = activate_skipping() if on else activate_skipping(async_fences.GROUP)
    if not on:
        assert {st.state for st in reg.status() if st.group == async_fences.GROUP} == {SKIPPED}


def test_async_fences_applies(library):
    """The group's state, on its own (the defect tests below run as configured: under
    ASCEND_LAYERWISE_PATCH=0 they fail on the defect, this one on the state)."""
    library(True)
    states = {st.name: st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.group == async_fences.GROUP}
    assert states[_MEMBER] == APPLIED, states


@pytest.fixture
def library():
    yield _set
    _set(True)


def _abort_in_flight(on: bool, role: str = "kv_producer") -> dict:
    pool = make_pool()
    b = PoolInstance(pool, name="B")
    b.add_request("fill", PREFIX, max_tokens=1)
    engine_loop(b)
    a = PoolInstance(pool, name="A", kv_role=role, async_scheduling=True)
    fenced = a.scheduler.defer_block_free
    writes = InFlightWrites(a)
    a.add_request("r", OTHER, max_tokens=40)
    for _ in range(4):  # r prefilled and decoding
        a.step()
    writes.hold_next()
    a.step()  # r's next batch is on the device, its output not processed yet
    assert writes.pending and writes.batch is not None
    r_blocks = {b for ids in a.scheduler.kv_cache_manager.get_block_ids("r") for b in ids if b}
    # the client went away; r's blocks without a hash (the ones its decode steps write) go to the
    # head of vLLM's free queue: the next allocation takes them first
    a.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    a.add_request("p", HIT, max_tokens=2)
    p_blocks: set[tuple[int, int]] = set()
    loaded = []

    def seen(inst, so):
        if so is not None and "p" in inst.scheduler.requests:
            ids = inst.scheduler.kv_cache_manager.get_block_ids("p")
            p_blocks.update((g, b) for g, group in enumerate(ids) for b in group if b)
        if so is not None and so.kv_connector_metadata is not None:
            loaded.extend(r.req_id for r in so.kv_connector_metadata.requests if r.load_spec is not None)

    engine_loop(a, on_step=seen)
    # layers of different groups share memory (vLLM's hybrid layout): compare byte ranges
    groups = a.kv_cache_config.kv_cache_groups
    p_memory = [span for g, b in p_blocks for n in groups[g].layer_names for span in block_spans(a, n, b)]
    overwritten = [(layer, b) for layer, b in writes.landed if overlaps(block_spans(a, layer, b), p_memory)]
    a.add_request("q", HIT[:32] + [9, 9, 9], max_tokens=2)  # a local hit on p's (loaded) blocks
    engine_loop(a)
    return {
        "fenced": fenced,
        "reused": len({b for _, b in p_blocks} & r_blocks),
        "overwritten": len(overwritten),
        "wrong": sum(len(a.wrong_reads(r)) + len(a.wrong_reads(r, kind="attn")) for r in ("p", "q")),
        "loaded": "p" in loaded,
        "outputs": a.outputs.get("p"),
    }


def test_a_kv_producer_defers_frees_while_a_step_is_in_flight(library):
    library(False)
    off = _abort_in_flight(False)
    library(True)
    on = _abort_in_flight(True)
    print({"off": off, "on": on})
    assert off["loaded"] and on["loaded"], (off, on)  # p is a pool hit in both
    assert not off["fenced"] and on["fenced"]
    assert off["reused"] > 0 and off["overwritten"] > 0 and off["wrong"] > 0, off  # the race, library off
    assert on["overwritten"] == 0 and on["wrong"] == 0, on
    assert on["outputs"] is not None and len(on["outputs"]) == 2


# Race 1 (``mamba_precopy``, group gdn_layerwise): the align pre-copy's pinned pointer rows are
# uploaded non-blocking after execute_model's input-prep event; the next step's preprocess_mamba
# rewrites them. No pool needed: 16-token chunks make every step of a prefill pre-copy (4 rows each).


def _prefill_in_chunks(monkeypatch, on: bool) -> DelayedUploads:  # 0.25 / 0.26 (0.30: fixed upstream)
    import torch

    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    env = dict(os.environ)
    if not on:
        env["ASCEND_LAYERWISE_PATCH_SKIP"] = mamba_precopy.GROUP
    reg.activate(environ=env)
    inst = PoolInstance(None, name="U", async_scheduling=True, max_num_batched_tokens=16)
    uploads = DelayedUploads(inst)
    # not monkeypatch.setattr: torch.npu is a MagicMock stand-in whose attributes live outside its
    # __dict__, so pytest's undo would delete Event (a deleted mock attribute raises for every later test)
    saved = torch.npu.Event
    torch.npu.Event = uploads.event
    try:
        inst.add_request("long", list(range(7000, 7100)), max_tokens=2)
        engine_loop(inst)
    finally:
        torch.npu.Event = saved
    uploads.execute()
    assert inst.wrong_reads() == []  # the harness itself copies at once
    return uploads


@pytest.mark.pairs("v0251", "v0260")  # 0.30: the runner hands the align copy to the connector (fixed upstream)
def test_the_next_step_waits_for_the_pre_copy_upload(monkeypatch, library):
    off = _prefill_in_chunks(monkeypatch, False)
    on = _prefill_in_chunks(monkeypatch, True)
    print({"off": (off.wrong_rows, off.rows), "on": (on.wrong_rows, on.rows)})
    assert off.rows > 0 and on.rows == off.rows
    assert off.wrong_rows > 0  # the device would copy the next step's rows (library off)
    assert on.wrong_rows == 0


@pytest.mark.control("the fence detectors read the installed scheduler: no patch involved")
def test_the_fence_checks_read_the_installed_scheduler(monkeypatch):
    """Precondition and fixed-upstream detector on the installed source, and on edited copies of it."""
    import ast

    assert async_fences._precondition(None) is None
    assert async_fences._fixed_upstream(None) is None  # kv_consumer only: not fixed
    init, tree = async_fences._fence_init()
    text = ast.unparse(tree)
    assert "kv_transfer_config.is_kv_consumer" in text
    widened = ast.parse(text.replace("kv_transfer_config.is_kv_consumer", "kv_transfer_config.is_kv_transfer_instance"))
    monkeypatch.setattr(async_fences, "_fence_init", lambda: (init, widened))
    assert "already defers" in async_fences._fixed_upstream(None)  # a producer is fenced upstream: skip
    drifted = ast.parse(text.replace("self.deferred_frees", "self.pending_frees"))
    monkeypatch.setattr(async_fences, "_fence_init", lambda: (init, drifted))
    assert "deferred_frees" in async_fences._precondition(None)
    monkeypatch.setattr(async_fences, "_fence_init", lambda: (None, None))
    assert "sets defer_block_free" in async_fences._precondition(None)
