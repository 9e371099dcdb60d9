"""Issue 34: group ``mamba_lifetime`` on vllm-ascend 0.30.0rc2 + vLLM 0.30.0 (v0300).

0.30 fixed what the group's 0.25 / 0.26 members fix (``mamba_lifetime/v030.py``): member
``mamba_lifetime_030`` vouches for that, and these tests run the defects' scenarios there with the
whole library off and find them clean -- no block leaks or is reused under a send (finished, aborted,
preempted; TP 1 and 2), a store slower than the model pins nothing and every request finishes, a
failed save copy finishes no key with a layer slot never written. The control shows the harness
would see a send outliving its step (0.30's end-of-step wait taken out). ``send_stuck_030`` is
applied: a send stuck in that wait is warned about while it holds the engine, and counted.

On the pool harness (tests/standins/harness_pool): ``Lifetime`` / ``BlockOwners`` (every save copy
checks the owner of each block it reads), ``soak`` / ``slow_store``. 0.30 holds the step until its
copies returned, so slow copies are delays (a gate would hold the step), not gates opened by a later step.
"""

from __future__ import annotations

import logging
import threading

import pytest

from support import PAIR, activate_skipping

PAIRS = ("v0300",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

import byte_store  # noqa: E402
from harness_pool import SOAK_SCENARIOS, PoolInstance, engine_loop, layer_slot_fault, make_lifetime, make_pool, slow_store, soak  # noqa: E402
from harness_pool.lifetime import ready_with_a_gap as _gaps  # noqa: E402

import ascend_layerwise_patch  # noqa: E402
import ascend_layerwise_patch.patches  # noqa: E402
from ascend_layerwise_patch.patches.mamba_lifetime import v030  # noqa: E402
from ascend_layerwise_patch.registry import APPLIED, FAILED, SKIPPED  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

GROUP = "mamba_lifetime"


@pytest.fixture
def library():
    """``library(True)``: as configured; ``library(False)``: every group skipped, nothing of ours applied
    (the scenarios' runs 'with the library off'); ``library(True, group)``: that group skipped."""

    def set_(on: bool, *skip: str):
        groups = skip if on else tuple({spec.group for spec in ascend_layerwise_patch.patches.SPECS})
        reg = activate_skipping(*groups)
        reg.apply_pending()
        if not on:
            assert [st.name for st in reg.status() if st.state == APPLIED] == []
        return reg

    yield set_
    set_(True)


def test_the_group_on_030(library):
    """Its 0.25 / 0.26 members read ``ported``; ``mamba_lifetime_030`` finds 0.30's fix; the stuck-send
    watch applies."""
    reg = library(True)
    ours = {st.name: st for st in reg.status() if st.group == GROUP}
    assert ours["mamba_lifetime_030"].state == SKIPPED and ours["mamba_lifetime_030"].reason.startswith("already fixed upstream")
    assert ours["send_stuck_030"].state == APPLIED
    others = [st for name, st in ours.items() if not name.endswith("_030")]
    assert others and all(st.reason.startswith("ported: ") and "mamba_lifetime_030" in st.reason for st in others)


def test_defer_last_save_fails_the_group(library, monkeypatch):
    """``VLLM_ASCEND_LW_DEFER_LAST_SAVE=1`` moves 0.30's end-of-step wait to the next step's start (a
    step returns with its copies in flight): the vouched fix is gone, the group fails with its risk."""
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import pool_worker

    monkeypatch.setattr(pool_worker, "_LW_DEFER_LAST_SAVE", True)
    reg = library(True)
    ours = {st.name: st for st in reg.status() if st.group == GROUP}
    assert ours["mamba_lifetime_030"].state == FAILED, ours["mamba_lifetime_030"]
    assert "VLLM_ASCEND_LW_DEFER_LAST_SAVE" in ours["mamba_lifetime_030"].reason
    assert "leaks in layerwise mode" in ours["mamba_lifetime_030"].reason  # the group's risk
    assert ours["send_stuck_030"].state != APPLIED  # all or nothing


# ------------------------------------------------------------------------------ block lifetime
def _slow(h, req_id: str, delay_s: float) -> byte_store.Fault:
    """Every save copy of ``req_id`` takes ``delay_s``."""
    hashes = {x.hex() for x in h.owners.requests[req_id].block_hashes}
    return h.pool.add_fault("delay", direction=byte_store.L2G, match=lambda key: key.split("@")[2] in hashes, delay=lambda: delay_s)


def _figures(h) -> dict:
    return dict(
        reads=h.owners.reads,
        violations=len(h.violations),
        wrong_reads=len(h.inst.wrong_reads()) + len(h.inst.wrong_reads(kind="attn")),
        stale_ready=len(h.stale_ready()),
        leaked=h.leaked(),
        held=len(h.held_blocks()),
        unfinished_keys=len(h.unfinished()),
    )


CLEAN = dict(violations=0, wrong_reads=0, stale_ready=0, leaked=0, held=0, unfinished_keys=0)


@pytest.mark.control("a vouch: vllm-ascend 0.30's own fix, run with the library off in the test")
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("how", ["finish", "abort", "preempt"])
def test_no_block_is_reused_under_a_send(library, how, tp):
    """a (20 tokens, decoding) with slow save copies (120 ms each) finishes, is aborted or preempted
    while b waits for blocks: b gets a's blocks in the very next step. Library off: every copy of a
    read a's own blocks (0.30 waits at the step's last layer for the queued copies), nothing leaked,
    held or left unfinished; then 10 more requests through the same instance."""
    library(False)
    h = make_lifetime(tp=tp, num_blocks=12, chunk=8)
    try:
        h.add("a", 20, decode_steps=0 if how == "finish" else 6)
        _slow(h, "a", 0.12)
        h.step()
        h.step()
        h.add("b", 24, decode_steps=1)
        h.step(**({"abort": ["a"]} if how == "abort" else {"preempt": ["a"]} if how == "preempt" else {}))
        h.step()
        h.step()
        h.drain()
        for i in range(10):  # the leak: a workload of distinct prompts, every block back at the end
            h.add(f"r{i}", 4 + (i % 3) * 4, decode_steps=i % 2)
            h.step()
        h.drain()
        figures = _figures(h)
    finally:
        h.close()
    print(f"\n{how}, TP {tp}, library off: {figures}")
    assert figures["reads"] > 0
    assert {k: figures[k] for k in CLEAN} == CLEAN


@pytest.mark.control("the harness's own check, library off: 0.30's end-of-step wait taken out by the test")
def test_the_harness_sees_a_send_outlive_its_step(library):
    """Control: with 0.30's ``_wait_for_final_layer_save`` made a no-op (a step returns with its copies
    in flight, as 0.25.1rc1 after its 10 s), a's held copies read blocks b was given meanwhile."""
    library(False)

    class Unchecked(threading.Event):
        """A save event whose ``is_set`` reads False: with no end-of-step wait, a's copies set their
        events after the step that cleared them, and 0.30's sending thread would stop on its own
        "save failed" assertion at b's first layer instead of running b's copies (seen in CI)."""

        def is_set(self) -> bool:
            return False

    def no_final_wait(rank) -> None:
        worker = rank.connector.connector_worker
        events = worker.layer_save_finished_events  # one list, shared with the rank's threads
        events[:] = [Unchecked() for _ in events]

        def skip(num_local, send_thread):
            for event in events[:num_local]:
                event.clear()

        worker._wait_for_final_layer_save = skip

    h = make_lifetime(tp=1, num_blocks=8, max_model_len=20)
    h.inst.on_ranks(no_final_wait)
    try:
        h.add("a", 8, decode_steps=0, behaviour="slow")
        h.step()  # a's copies wait at their gate; the step returns without waiting for them
        h.add("b", 16, decode_steps=0)
        h.step()
        h.step()  # a finished, b computed into the blocks a's copies still read
        h.release("a")
        try:
            h.drain()
        except Exception:  # noqa: BLE001 - 0.30's sending thread may stop on its own assertion afterwards
            pass
    finally:
        h.close()
    foreign = [v for v in h.violations if v.kind == "foreign"]
    print(f"\nno end-of-step wait: {len(foreign)} reads of blocks handed to another request")
    assert foreign


# ------------------------------------------------------------------------------ a slow store
@pytest.mark.control("a vouch: vllm-ascend 0.30's own fix, run with the library off in the test")
def test_a_slow_store_pins_nothing_and_every_request_finishes(library):
    """test_send_shedding's "slow" scenario (20 requests), library off: the engine runs at the store's
    pace; no block is held by a send after its step, every request finishes, every block comes back,
    nothing wrong is read or made ready."""
    library(False)
    inst_kw, soak_kw, slow_kw = SOAK_SCENARIOS["slow"]
    pool = make_pool()
    inst = PoolInstance(pool, max_model_len=512, **inst_kw)
    inst.scale_save_wait()
    fault = slow_store(pool, seed=0, **slow_kw)
    queued = []
    step = inst.step

    def step_and_look():
        try:
            return step()
        finally:  # what the rank's sending thread still has once the step returned
            queue = inst.ranks[0].connector.connector_worker.kv_send_thread.request_queue
            queued.append(queue.unfinished_tasks)

    inst.step = step_and_look
    try:
        f = soak(inst, seed=0, deadline_s=120.0, **{**soak_kw, "requests": 20})
    finally:
        fault.gate.set()
    f.pop("trace")
    print(f"\nslow store, library off: {fault.hits} slow copies, sends queued after a step (max) {max(queued)}: {f}")
    assert fault.hits > 0
    assert f["unfinished"] == 0 and f["stopped"] and f["used"] == 0  # every request done, every block back
    assert max(queued) == 0 and f["held_refs_max"] == 0  # no send outlives its step, none pins a block
    assert inst.wrong_reads() == [] and inst.wrong_reads(kind="attn") == []
    assert _gaps(pool, inst) == [] and pool.violations == []


# ------------------------------------------------------------------------------ a failed save copy
@pytest.mark.control("a vouch: vllm-ascend 0.30's own fix, run with the library off in the test")
@pytest.mark.parametrize("kind", ["raise", "error"])
@pytest.mark.parametrize("layer", [0, 3])  # GDN layer 0; attention layer 3, the step's last
def test_a_failed_save_copy_makes_no_key_ready_with_a_gap(library, kind, layer):
    """One save copy of a layer slot raises / returns an error, library off: 0.30's sending thread
    stops before the key is finished (the engine stops with it); no key is ready with that slot
    unwritten, and a second instance reads nothing wrong from the pool."""
    library(False)
    # the byte store as MemCache 1.3.0 shows keys: 0.30.0rc2 pins 1.2.0, which shows the stopped
    # writer's unfinished keys to B's lookup as hits whose loads fail (until MemCache's ~10 s
    # allocation lease drops them): test_memcache_writers' finding, not this vouch's subject
    pool = byte_store.PoolService(shows_writing=False)
    a = PoolInstance(pool, name="A")
    fault = pool.add_fault(kind, direction=byte_store.L2G, times=1, at=layer_slot_fault(a, [layer]))
    prompts = {"r0": list(range(20_000, 20_040)), "r1": list(range(21_000, 21_056))}
    for rid, prompt in prompts.items():
        a.add_request(rid, prompt, max_tokens=2)
    with pytest.raises(Exception) as info:  # 0.30 stops the engine on a failed save copy (by design)
        engine_loop(a)
    gaps = _gaps(pool, a)
    a.close()
    pool.clear_faults()
    b = PoolInstance(pool, name="B")
    for rid, prompt in prompts.items():
        b.add_request(rid + "b", prompt + [5, 6, 7], max_tokens=1)
    engine_loop(b)
    wrong = len(b.wrong_reads()) + len(b.wrong_reads(kind="attn"))
    print(f"\n{kind} at layer {layer}, library off: engine stopped ({type(info.value).__name__}), "
          f"{len(gaps)} keys ready with a gap, B: {wrong} wrong reads")
    assert fault.hits == 1 and gaps == [] and wrong == 0 and pool.violations == []


# ------------------------------------------------------------------------------ a stuck send
def _hang(monkeypatch, hold_s: float) -> list[logging.LogRecord]:
    """One request whose first save copy takes ``hold_s`` (the step waits for it), TP 1 in this process;
    the vLLM log records of the run."""
    monkeypatch.setattr(v030, "STUCK_AFTER_S", 0.12)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(logging.INFO)
    log = logging.getLogger("vllm")
    log.addHandler(handler)
    pool = make_pool()
    inst = PoolInstance(pool)
    fault = pool.add_fault("delay", direction=byte_store.L2G, delay=lambda: hold_s, times=1)
    inst.add_request("hung", list(range(30_000, 30_040)), max_tokens=1)
    try:
        engine_loop(inst)
    finally:
        log.removeHandler(handler)
    assert fault.hits == 1
    return records


def _stuck_warnings(records) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING and "layerwise KV send stuck" in r.getMessage()]


def test_a_stuck_send_is_warned_about_and_counted(library, monkeypatch):
    """A save copy that takes 1 s holds 0.30's end-of-step wait: send_stuck_030 logs a WARNING while it
    does (after ``STUCK_AFTER_S``), counts one stuck send, and an INFO once the wait returned. With the
    group off, the same second passes without a word."""
    library(True)
    stuck0 = v030.counters()["stuck_sends_total"]
    records = _hang(monkeypatch, 1.0)
    warnings = _stuck_warnings(records)
    print(f"\nstuck send, library on: {warnings[:1]}")
    assert len(warnings) == 1 and "tp rank 0" in warnings[0]
    assert v030.counters()["stuck_sends_total"] == stuck0 + 1
    assert any("returned after" in r.getMessage() for r in records)
    assert v030.counters()["stuck_sends"] == 0  # nothing open any more
    library(True, GROUP)
    records = _hang(monkeypatch, 1.0)
    assert _stuck_warnings(records) == []  # 0.30 by itself: silent for a second (an INFO a minute)
