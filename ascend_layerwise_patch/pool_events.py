"""Neutral counters the patch groups bump and the ``pool_metrics`` group reads (issue 26).

A group must not import another group; every group may import this module. It holds plain integer
counts keyed by name, per process, with no heavy imports. ``bump`` is called on fault paths only (a
failed load, a shed save, a stuck send ...); ``drain`` is called once per step by the connector's
``get_kv_connector_stats`` and costs one dict truth test when nothing happened since the last call.

Names in use (the ``pool_metrics`` group maps them to Prometheus metrics; unknown names are still
carried to the KV-transfer log line):

- ``load_failed`` / ``load_raised`` / ``load_late``: layerwise load copies that returned an error,
  raised, or a layer wait that timed out (load_failures).
- ``requests_rolled_back``: requests preempted to recompute after a failed load (load_failures_rollback).
- ``pool_keys_failed``: pool keys finished as failed instead of published (send_integrity, pool_save_failures,
  load_failures_saves).
- ``stuck_sends``: layer sends found in flight past save_kv_layer's wait (send_integrity).
- ``saves_shed``: request saves shed by the send backlog bound (send_shedding).
- ``tokens_recomputed``: tokens a rolled-back request computes again (load_failures_rollback).
- ``hits_cut_back``: layerwise pool hit checks moved down to a block where every mamba group's state
  is saved (mamba_pool_hit; counted per hit check: a waiting request may be checked again).
- ``mamba_state_bytes_loaded``: bytes of mamba-group (GDN state) blocks whose layerwise load copy
  (pool -> device) returned success (pool_metrics' own load wrappers).

Ages (gauges, seconds; :func:`watch_age`, read by :func:`take`):

- ``oldest_stuck_send_age_seconds``: how long the oldest layer send still in flight past
  save_kv_layer's wait has been in flight (send_integrity); 0 once none is.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

_lock = threading.Lock()
_counts: dict[str, int] = {}
_ages: dict[str, list[Callable[[], float]]] = {}  # gauge -> start readers of what it watches
_zeros: dict[str, int] = {}  # gauge whose readers all ended -> takes left that still report its 0

#: an ended age is reported as 0 by this many takes: a take earlier in the same step (another TP rank
#: or the scheduler in this process) may have reported it live, and vLLM aggregates gauges by max
ZERO_TAKES = 8


def bump(name: str, n: int = 1) -> None:
    """Add ``n`` to the count ``name`` (any thread)."""
    if n:
        with _lock:
            _counts[name] = _counts.get(name, 0) + n


def drain() -> dict[str, int] | None:
    """The counts since the last drain (then zeroed), or ``None`` if nothing was bumped."""
    if not _counts:  # the per-step path: no lock when nothing happened
        return None
    with _lock:
        out = dict(_counts)
        _counts.clear()
    return out


def watch_age(name: str, started: Callable[[], float]) -> None:
    """Report the gauge ``name`` as ``now - started()`` (the largest of all it watches) at every
    :func:`take` while ``started()`` is non-zero; a reader that returns 0 (its item ended) is dropped,
    and once none is left the gauge is reported as 0. ``started`` reads live state (monotonic
    seconds), so an item that ends needs no call here (any thread). Once none is left, the gauge is
    reported as 0 by the next ``ZERO_TAKES`` takes (see there)."""
    with _lock:
        _ages.setdefault(name, []).append(started)


def take() -> tuple[dict[str, int], dict[str, float]] | None:
    """The counts since the last call (then zeroed) and the watched ages now, or ``None`` if there is
    nothing to report (the per-step path: two truth tests, no lock). An age whose readers all ended
    is reported as 0 by the next ``ZERO_TAKES`` takes, then forgotten."""
    if not _counts and not _ages:
        return None
    with _lock:
        counts = dict(_counts)
        _counts.clear()
        gauges: dict[str, float] = {}
        if _ages:
            now = time.monotonic()
            for name, readers in list(_ages.items()):
                starts = [(f, f()) for f in readers]  # each read once: the item may end meanwhile
                live = [(f, t0) for f, t0 in starts if t0]
                if live:
                    _ages[name] = [f for f, _t0 in live]
                    _zeros.pop(name, None)
                    gauges[name] = round(max(now - t0 for _f, t0 in live), 3)
                    continue
                gauges[name] = 0.0
                left = _zeros.get(name, ZERO_TAKES) - 1
                if left > 0:
                    _ages[name], _zeros[name] = [], left
                else:
                    del _ages[name]
                    _zeros.pop(name, None)
    return counts, gauges


def pending() -> dict[str, int]:
    """The counts not drained yet (for tests and ``status()``); drains nothing."""
    with _lock:
        return dict(_counts)
