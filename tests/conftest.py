"""Pytest hooks for the version matrix; the helpers live in tests/support.py."""

from __future__ import annotations

import pytest

from support import PAIR


def pytest_configure(config):
    config.addinivalue_line("markers", "pairs(*names): run only on these pairs of scripts/pairs.txt")
    config.addinivalue_line(
        "markers",
        "control(why): passes with the library off too, and says why (scripts/library_off.py checks that "
        "exactly these do)",
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("pairs")
        if marker and PAIR not in marker.args:
            item.add_marker(pytest.mark.skip(reason=f"for pairs {', '.join(marker.args)}; installed: {PAIR}"))
