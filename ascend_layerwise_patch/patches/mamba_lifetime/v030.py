"""Group ``mamba_lifetime`` on vllm-ascend 0.30.0rc2 (vLLM 0.29 / 0.30): its fix is upstream's; a stuck
send is warned about while the step waits for it (issue 34).

Target   vllm_ascend...ascend_store.pool_worker: KVPoolWorker._wait_for_final_layer_save (the end-of-step
         wait for every queued layerwise save copy) and pool_scheduler.KVPoolScheduler.touch_sending_mamba_blocks.
Versions vLLM >=0.29,<0.31; vllm-ascend 0.30.x (``V029_030``).
Why      0.30.0rc2 rewrote the send path the 0.25 / 0.26 members patch, and fixed what they fix:
         - the scheduler touches no block for a layerwise send (``touch_sending_mamba_blocks`` returns
           at ``if self.use_layerwise``): nothing to leak, no event to report;
         - ``save_kv_layer`` at the step's last layer waits, with no limit, until the sending queue is
           empty (``_wait_for_final_layer_save``: ``queue.unfinished_tasks``), so no send outlives its
           step: no block is freed or reallocated under a copy (finished, aborted, preempted), a slow
           store slows the engine to its pace without pinning blocks (no backlog to shed), and each
           layer's task list is built fresh every step (``process_layer_data``);
         - a failed or raising save copy kills the sending thread before ``batch_write_finish``: the
           engine stops, no key is finished with a layer slot never written.
         ``mamba_lifetime_030`` (vouched) reads those facts in the installed code and is skipped as
         fixed upstream; where they are gone the group fails with its risk. It also fails where
         ``VLLM_ASCEND_LW_DEFER_LAST_SAVE=1`` moved that wait to the next step's start: the step then
         returns with its copies in flight, and the runner zeroes and reuses blocks they still read
         (wrong bytes in the pool; tests/standins/test_send_path_030.py runs the scenarios on v0300).
         What 0.30 does not do: say anything while the wait hangs. A copy that never returns holds the
         whole engine in that wait, with one INFO line a minute ("save drain still waiting").
How      ``send_stuck_030``: the wait is wrapped to note when it began (one attribute write before, one
         after); one daemon thread per process (started with the first wait) looks at the open waits
         every ``STUCK_AFTER_S / 4`` (at most 1 s) and, for a wait longer than ``STUCK_AFTER_S``, logs a
         WARNING (repeated every ``STUCK_REPEAT_S``), counts ``stuck_sends`` once per wait and watches its
         age (``oldest_stuck_send_age_seconds``); both reach /metrics with the next step's stats (the
         step is held until the copy returns). When the wait ends after a warning: an INFO with its
         length.
Removal  When 0.30's wait warns by itself (detected: a ``logger.warning`` in ``_wait_for_final_layer_save``).
"""

from __future__ import annotations

import ast
import functools
import importlib
import threading
import time
import weakref

from ... import pool_events
from ...host import logger
from .._checks import expects as _expects
from .._checks import source as _source
from .._checks import syntax_tree as _syntax_tree
from .._targets import STORE
from .send_integrity import STUCK_AFTER_S as STUCK_AFTER_S
from .send_integrity import STUCK_REPEAT_S as STUCK_REPEAT_S

WAIT = f"{STORE}.pool_worker:KVPoolWorker._wait_for_final_layer_save"

_open: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # worker -> [since, warned at, counted]
_lock = threading.Lock()
_watchdog: list[threading.Thread] = []
_counts = {"stuck_sends_total": 0}


def counters() -> dict[str, int]:
    """This process's counts: final-layer waits stuck now, and ever."""
    now = time.monotonic()
    with _lock:
        stuck = sum(1 for since, _w, _c in _open.values() if now - since >= STUCK_AFTER_S)
    return {"stuck_sends": stuck, **_counts}


def check(now: float | None = None) -> None:
    """Warn (rate-limited) and count every wait open longer than ``STUCK_AFTER_S`` (the watchdog's turn)."""
    now = time.monotonic() if now is None else now
    with _lock:
        items = list(_open.items())
    for worker, entry in items:
        since, warned, counted = entry
        if now - since < STUCK_AFTER_S or (warned and now - warned < STUCK_REPEAT_S):
            continue
        entry[1] = now
        if not counted:
            entry[2] = True
            _counts["stuck_sends_total"] += 1
            pool_events.bump("stuck_sends")
            pool_events.watch_age("oldest_stuck_send_age_seconds", _age_reader(worker, since))
        thread = getattr(worker, "kv_send_thread", None)
        queue = getattr(thread, "request_queue", None)
        logger().warning(
            "ascend_layerwise_patch: layerwise KV send stuck: tp rank %s has waited %.3g s at the step's last "
            "layer for %s queued save copy(ies); the engine holds this step until they return (vllm-ascend "
            "0.30 waits without a limit)",
            getattr(worker, "tp_rank", "?"),
            now - since,
            getattr(queue, "unfinished_tasks", "?"),
        )


def _age_reader(worker, since: float):
    """The wait's start while that same wait is open, else 0.0 (pool_events' age gauge)."""

    def started() -> float:
        entry = _open.get(worker)
        return since if entry is not None and entry[0] == since else 0.0

    return started


def _watch() -> None:
    while True:
        time.sleep(max(0.01, min(1.0, STUCK_AFTER_S / 4)))
        try:
            check()
        except Exception:  # noqa: BLE001 - a watchdog never dies of a report
            logger().exception("ascend_layerwise_patch: the stuck-send watchdog failed a check")


def _ensure_watchdog() -> None:
    with _lock:
        if not _watchdog:
            thread = threading.Thread(target=_watch, name="alp-stuck-send-watchdog", daemon=True)
            thread.start()
            _watchdog.append(thread)


def make_wait(original):
    @functools.wraps(original)
    def _wait_for_final_layer_save(self, *args, **kwargs):
        if not _watchdog:
            _ensure_watchdog()
        entry = [time.monotonic(), 0.0, False]
        _open[self] = entry
        try:
            return original(self, *args, **kwargs)
        finally:
            _open.pop(self, None)
            if entry[2]:
                logger().info(
                    "ascend_layerwise_patch: layerwise KV send on tp rank %s returned after %.3g s",
                    getattr(self, "tp_rank", "?"),
                    time.monotonic() - entry[0],
                )

    return _wait_for_final_layer_save


# ----------------------------------------------------------------------------- checks on targets
def _returns_early_for_layerwise(touch) -> bool:
    """``touch_sending_mamba_blocks`` has ``if self.use_layerwise: return`` (no block touched)."""
    tree = _syntax_tree(touch)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and ast.unparse(node.test) == "self.use_layerwise"
            and len(node.body) == 1
            and isinstance(node.body[0], ast.Return)
        ):
            return True
    return False


def sends_end_with_their_step(original) -> str | None:
    """The vouched member's detector: 0.30's own fix of the group's defects, found in its code."""
    worker_mod = importlib.import_module(f"{STORE}.pool_worker")
    scheduler_mod = importlib.import_module(f"{STORE}.pool_scheduler")
    wait = _source(original)
    save = _source(worker_mod.KVPoolWorker.save_kv_layer)
    if getattr(worker_mod, "_LW_DEFER_LAST_SAVE", False):
        return None  # the wait moved to the next step: copies outlive their step (the group fails, with why)
    if not ("unfinished_tasks" in wait and "all_tasks_done" in wait and "_wait_for_final_layer_save" in save):
        return None
    if "raise_if_failed" not in save:
        return None
    if not _returns_early_for_layerwise(scheduler_mod.KVPoolScheduler.touch_sending_mamba_blocks):
        return None
    return (
        "vllm-ascend touches no block for a layerwise send and waits at each step's last layer for every "
        "queued save copy (no send outlives its step; a failed copy stops the engine before any key is finished)"
    )


WAIT_EXPECTS = _expects(["self", "num_local", "send_thread"])


def warns_itself(original) -> str | None:
    tree = _syntax_tree(original)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("logger.warning", "logger.warn"):
            return "vllm-ascend's end-of-step save wait warns about a send that does not return"
    return None
