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
- ``pool_keys_failed``: pool keys finished as failed instead of published (send_integrity,
  load_failures_saves).
- ``stuck_sends``: layer sends found in flight past save_kv_layer's wait (send_integrity).
- ``saves_shed``: request saves shed by the send backlog bound (send_shedding).
- ``tokens_recomputed``: tokens a rolled-back request computes again (load_failures_rollback).
- ``hits_cut_back``: layerwise pool hit checks moved down to a block where every mamba group's state
  is saved (mamba_pool_hit; counted per hit check: a waiting request may be checked again).
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_counts: dict[str, int] = {}


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


def pending() -> dict[str, int]:
    """The counts not drained yet (for tests and ``status()``); drains nothing."""
    with _lock:
        return dict(_counts)
