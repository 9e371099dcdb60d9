"""Layerwise send integrity: no pool key finished as ready with an unwritten layer slot.

Harness: tests/standins/harness_pool's ``PoolInstance`` (vLLM's real Scheduler, the AscendStore
halves from KVConnectorFactory, real layer threads, save_kv_layer's 10 s wait scaled to 30 ms)
driven by ``Lifetime`` (requests whose save copies misbehave on one layer: held at a gate, failing,
raising); the byte-level MemCache of byte_store records, per key, the layer slots written by copies
that returned 0 and each key's finish: ``Lifetime.stale_ready`` lists every key finished with
result 0 while a slot was unwritten.
"""

from __future__ import annotations

import random
import time

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.patches.mamba_lifetime import send_integrity
from ascend_layerwise_patch.registry import APPLIED, MARKER

from support import PAIR

#: Not v0260: there send_integrity_copy is skipped as fixed upstream (a failed or raising save copy
#: stops the sending thread before any key is finished: test_upstream_detectors.py proves it), and the
#: stuck-copy WARNING cannot fire (save_kv_layer waits for the step's last layer without a limit, so
#: no step runs while a copy hangs). send_integrity_own_arrays / _idle_steps are tested on v0260 in
#: test_send_pool.py.
#: Not v0250 either: no engine with the AscendStore pool can be built there for a hybrid model
#: (test_mamba_lifetime.py says why); the group's state on v0250 is checked in test_check.py.
PAIRS = ("v0251",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from harness_pool import TIME_SCALE, Lifetime, make_lifetime  # noqa: E402  (imports vllm-ascend's ascend_store)

pytestmark = pytest.mark.pairs(*PAIRS)


def test_send_integrity_applies(patched):
    """The group's state, on its own (the defect tests run as configured)."""
    states = {st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.group == send_integrity.GROUP and not st.name.endswith("_030")}
    assert states == {APPLIED}  # the group's 0.30 members: test_send_path_030.py


@pytest.fixture
def unpatched(monkeypatch):
    import harness_pool

    harness_pool.setup_runtime()  # before the revert: its plugin load would activate the library again
    monkeypatch.setenv("ASCEND_LAYERWISE_PATCH", "0")  # and nothing the test starts activates it
    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import kv_transfer

    assert not hasattr(vars(kv_transfer.KVCacheStoreLayerSendingThread)["_handle_request"], MARKER)
    yield
    monkeypatch.undo()
    reg.activate()


def _workload(kind: str, tp: int, seed: int = 1, n: int = 24) -> Lifetime:
    """``n`` requests, 30 % of them misbehaving (``kind``) on one random layer (all layers if slow)."""
    rnd = random.Random(seed)
    h = make_lifetime(tp=tp, num_blocks=256, chunk=8)
    try:
        for i in range(n):
            behaviour = kind if rnd.random() < 0.3 else "fast"
            layers = None if kind == "slow" else frozenset([rnd.randint(0, 3)])
            h.add(f"r{i}", rnd.randint(4, 24), rnd.randint(0, 2), behaviour, release_after=rnd.randint(1, 3), layers=layers)
            h.step()
        h.drain()
    finally:
        h.close()
    return h


def _summary(h: Lifetime) -> dict:
    finished = h.finished()
    return {
        "stale_ready": len(h.stale_ready()),
        "finished": len(finished),
        "failed": sum(1 for r in finished.values() if r != 0),
        "never_finished": len(h.unfinished()),
        "bad_reads": len(h.violations),
        "leaked": h.leaked(),
    }


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["slow", "fail", "raise"])
def test_no_key_ready_with_an_unwritten_slot(patched, kind, tp):
    h = _workload(kind, tp)
    s = _summary(h)
    print(f"\n{kind} tp={tp}: {s}")
    assert s["finished"] > 0
    assert h.stale_ready() == [], h.stale_ready()[:5]
    assert s["never_finished"] == 0  # every allocated key ends finished: ready only if complete
    assert s["bad_reads"] == 0 and s["leaked"] == 0 and h.held_blocks() == []
    if kind == "slow":  # a late send still writes every slot of its own keys: nothing is lost
        assert s["failed"] == 0


@pytest.mark.control("the defect pinned with the group reverted in the test: passes in both modes by design (its fixed twin fails without the library)")
def test_unpatched_publishes_keys_with_unwritten_slots(unpatched):
    """vllm-ascend 0.25.1rc1 as released: a layer copy that raises leaves its slot unwritten and the
    key is still finished with result 0 after the final layer."""
    counts = {}
    for tp in (1, 2):
        h = _workload("raise", tp)
        counts[tp] = _summary(h)
        assert counts[tp]["stale_ready"] > 0
    print(f"\nunpatched, raising layer copies: {counts}")


def test_counted_in_status(patched):
    before = send_integrity.counters()["incomplete_keys_failed"]
    h = _workload("raise", 1)
    failed = _summary(h)["failed"]
    assert failed > 0
    row = {st.name: st for st in ascend_layerwise_patch.status()}["send_integrity_copy"]
    assert row.counters["incomplete_keys_failed"] - before > 0
    assert set(row.counters) == {"stuck_sends", "stuck_sends_total", "incomplete_keys_failed"}


# ------------------------------------------------------------------------------ stuck copies
HANG_S = 1.5  # the hung copy (~30 s scaled like save_kv_layer's wait, 10 s -> 30 ms, would be 0.09 s)


def _hung_copy(h: Lifetime) -> tuple[set[int], list[set[int]], float]:
    """Request "hung" finishes while its copy hangs; the engine keeps stepping for ``HANG_S``.
    Returns the blocks held after its step, those held after each later step, and the wall start."""
    h.add("hung", 8, decode_steps=0, behaviour="slow")
    wall, start = time.time(), time.monotonic()
    h.step()
    assert h.done("hung")
    held = set(h.held_blocks())
    during = []
    while time.monotonic() - start < HANG_S:
        time.sleep(0.02)
        h.step()  # no-forward steps (build_connector_worker_meta runs)
        during.append(set(h.held_blocks()))
    return held, during, wall


def test_stuck_copy_warns_and_holds(patched, vllm_log, monkeypatch):
    monkeypatch.setattr(send_integrity, "STUCK_AFTER_S", 10.0 * TIME_SCALE)  # save_kv_layer's wait, scaled
    monkeypatch.setattr(send_integrity, "STUCK_REPEAT_S", 60.0 * TIME_SCALE)
    total_before = send_integrity.counters()["stuck_sends_total"]
    h = make_lifetime(tp=1, num_blocks=32)
    try:
        held, during, started = _hung_copy(h)
        hung_for = time.time() - started
        stuck = send_integrity.counters()
        first = vllm_log.warnings_naming("hung")
        h.release("hung")
        h.drain()
    finally:
        h.close()
    assert held and all(d == held for d in during), "a block was freed while the stuck copy still reads it"
    assert stuck["stuck_sends"] == 1 and stuck["stuck_sends_total"] == total_before + 1
    assert first, "no WARNING named the stuck request"
    # the first one right after save_kv_layer's own wait gave up, in the step that started the copy
    assert first[0].created - started < 10.0 * TIME_SCALE + 0.5
    assert "in flight for" in first[0].getMessage()
    # repeated while stuck, at the lower rate
    assert 2 <= len(first) <= 2 + hung_for / (60.0 * TIME_SCALE)
    assert h.violations == [] and h.held_blocks() == [] and h.leaked() == 0
    assert send_integrity.counters()["stuck_sends"] == 0
    print(f"\nhung copy {hung_for:.2f} s: {len(first)} warnings, first: {first[0].getMessage()}")


@pytest.mark.control("the defect pinned with the group reverted in the test: passes in both modes by design (its fixed twin fails without the library)")
def test_unpatched_stuck_copy_is_silent(unpatched, vllm_log):
    h = make_lifetime(tp=1, num_blocks=32)
    try:
        _hung_copy(h)
        h.release("hung")
        h.drain()
    finally:
        h.close()
    assert vllm_log.warnings_naming("hung") == []
