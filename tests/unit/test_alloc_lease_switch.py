"""pool_alloc_lease's switch: which allocation lease a layerwise save asks MemCache for."""

from __future__ import annotations

import logging

import pytest

from ascend_layerwise_patch.patches import pool_alloc_lease as pal

UPSTREAM_MS = 5 * 60 * 1000  # what vllm-ascend 0.30.0rc2 asks


@pytest.mark.parametrize(
    ("value", "asked"),
    [
        ("", 0),  # unset: none asked, MemCache's configured lease applies (as on 0.25 / 0.26)
        ("off", UPSTREAM_MS),  # upstream's
        ("30", 30_000),  # a bound below upstream's
        ("600", UPSTREAM_MS),  # a bound above it changes nothing
        ("0", 0),
    ],
)
def test_the_lease_a_save_asks(value, asked):
    assert pal.capped(UPSTREAM_MS, pal.bound_ms({pal.ENV: value})) == asked


def test_a_call_that_asks_no_lease_is_left_alone():
    for value in ("", "off", "30"):
        assert pal.capped(0, pal.bound_ms({pal.ENV: value})) == 0


def test_a_value_that_is_not_seconds_is_named_and_the_store_lease_used(caplog):
    caplog.set_level(logging.WARNING)
    assert pal.bound_ms({pal.ENV: "5min"}) == 0
    assert any(pal.ENV in r.getMessage() and "'5min'" in r.getMessage() for r in caplog.records)
