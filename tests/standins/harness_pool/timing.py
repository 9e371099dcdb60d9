"""The pool harness's timing knobs and the events whose timed waits they scale.

The harness reads every knob from this module when it needs it: a test sets one here
(``monkeypatch.setattr(harness_pool.timing, "LOAD_WAIT_SCALE", 0.05)``), not on the package.
"""

from __future__ import annotations

import threading


TIME_SCALE = 0.003  # save_kv_layer's 10 s wait -> 30 ms
GATE_LIMIT_S = 20.0  # Lifetime.drain waits at most this long for the sending threads to go quiet
#: PoolInstance.step: a step taking longer fails the test (watchdog). vllm-ascend 0.25.1rc1 may wait
#: 10 s for each layer whose load never comes (unpatched runs), so a legitimate step can take 20 s+.
STEP_LIMIT_S = 60.0
#: when set, every rank's layer-load events time their waits out after ``timeout x LOAD_WAIT_SCALE``
#: (vllm-ascend 0.25.1rc1's ``wait_for_layer_load`` waits 10 s for a load that never comes when
#: the library is off: a library-off control can shorten that without changing what it shows)
LOAD_WAIT_SCALE: float | None = None


class ScaledEvent(threading.Event):
    """``threading.Event`` whose timed waits are scaled by ``TIME_SCALE`` (the worker waits 10 s)."""

    def wait(self, timeout=None):
        return super().wait(None if timeout is None else timeout * TIME_SCALE)


class _ScaledWait(threading.Event):
    """``threading.Event`` whose timed waits last ``timeout x scale``."""

    def __init__(self, scale: float, set_: bool = False):
        super().__init__()
        self.scale = scale
        if set_:
            self.set()

    def wait(self, timeout=None):
        return super().wait(None if timeout is None else timeout * self.scale)
