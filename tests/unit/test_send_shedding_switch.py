"""send_shedding's switch and admission rule, without vLLM (the behaviour on the real engine:
tests/standins/test_send_shedding.py)."""

from __future__ import annotations

from types import SimpleNamespace

from ascend_layerwise_patch.patches.mamba_lifetime import send_shedding as ss

ENV = ss.ENV_BACKLOG


def test_the_switch_reads_a_fraction_of_the_pool():
    assert ss.fraction({}) == ss.DEFAULT_FRACTION == 0.25
    assert ss.fraction({ENV: "0.5"}) == 0.5
    assert ss.fraction({ENV: " 2 "}) == 1.0  # at most the whole pool
    for off in ("off", "OFF", "0", "none", "-1"):
        assert ss.fraction({ENV: off}) is None, off  # unbounded, as upstream
    assert ss.fraction({ENV: "a quarter"}) == ss.DEFAULT_FRACTION  # logged, default kept


def test_admission_sheds_what_would_pass_the_bound_and_nothing_else():
    sched = SimpleNamespace()
    metas = [SimpleNamespace(can_save=True) for _ in range(4)]
    assert ss.admit(sched, metas[0], 1000)  # no budget (the bound is not applied): always admitted
    sched.__dict__[ss._STEP] = budget = ss._Budget(limit=10, held=4)
    assert ss.admit(sched, metas[1], 6) and budget.held == 10  # up to the bound, inclusive
    assert not ss.admit(sched, metas[2], 1) and metas[2].can_save is False  # one more: shed
    assert ss.admit(sched, metas[3], 0)  # a save that holds nothing never is
    assert budget.shed == 1 and [m.can_save for m in metas] == [True, True, False, True]
    sched.__dict__[ss._STEP] = ss._Budget(limit=10, held=0)
    big = SimpleNamespace(can_save=True)
    assert ss.admit(sched, big, 25)  # nothing held: the first save goes whatever its size ...
    assert not ss.admit(sched, SimpleNamespace(can_save=True), 1)  # ... and the bound applies after it


def test_the_step_switch_and_steps_in_flight():
    assert ss.steps_limit({}) == ss.DEFAULT_STEPS == 3
    assert ss.steps_limit({ss.ENV_STEPS: "1"}) == 1
    assert ss.steps_limit({ss.ENV_STEPS: "off"}) is None and ss.steps_limit({ss.ENV_STEPS: "0"}) is None
    sched = SimpleNamespace(sending_events={})
    steps = [3, 5, 9]  # last event id of three steps
    assert ss.steps_in_flight(sched, steps) == 0 and steps == []  # nothing open: nothing in flight
    steps = [3, 5, 9]
    sched.sending_events = {4: 0, 5: 0, 6: 0, 9: 0}  # the first step's events (0-3) are closed
    assert ss.steps_in_flight(sched, steps) == 2 and steps == [5, 9]
    sched.__dict__[ss._STEP] = ss._Budget(limit=100, held=0, behind=True)
    meta = SimpleNamespace(can_save=True)
    assert not ss.admit(sched, meta, 1) and meta.can_save is False  # too many steps behind: shed
