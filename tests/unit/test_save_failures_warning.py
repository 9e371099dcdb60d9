"""pool_save_failures' WARNING under a full pool: one per WARN_EVERY_S (logical time), the rest DEBUG,
and the next WARNING says how many were held back."""

from __future__ import annotations

import logging

from ascend_layerwise_patch.patches import pool_save_failures as psf


def test_one_warning_per_interval_saying_how_many_were_held_back(monkeypatch, caplog):
    clock = [1000.0]
    monkeypatch.setattr(psf.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(psf, "_warned", {"at": None, "quiet": 0})
    caplog.set_level(logging.DEBUG)
    for step in range(5):  # five failed copies inside one interval
        clock[0] += 1.0
        psf._warn("save copy failed (%d)", -3102)
    clock[0] += psf.WARN_EVERY_S
    psf._warn("save copy failed (%d)", -3000)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    debugs = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "save copy failed" in r.getMessage()]
    assert warnings == ["save copy failed (-3102)", "save copy failed (-3000) (4 more such since the last warning)"]
    assert len(debugs) == 4
