"""Group ``pool_load_wait_bound`` (0.30, issue 32): the layerwise layer wait of vllm-ascend 0.30.0rc2
is bounded; a copy that never returns is reported and recovered instead of hanging the engine.

Why   ``KVPoolWorker.wait_for_layer_load`` waits for a layer's load event in an endless loop
      (``while not event.wait(timeout=10): raise_if_failed(); logger.info(... "keep waiting")``): a
      pool copy that never comes back (a store that lost it) hangs the engine forever, and at TP > 1
      the other ranks wait in the layer's collective behind it.
How   While the wrapped ``wait_for_layer_load`` runs, the worker's ``layer_load_finished_events``
      attribute is a view whose events wait at most ``WAIT_S`` in all for one layer (the 0.25
      library's bound, ``_failed_load.WAIT_S``, which ``load_failures.report`` takes too: one
      constant for both releases, read at each wait). The receiving thread keeps its own reference to the real list: nothing it sets or
      asserts changes. After the bound:
      - every load block of the step (every group's hit blocks of every request with a load task,
        ``worker._hit_blocks``) is reported (``_invalid_block_ids``): the scheduler half of
        ``pool_load_recovery`` rolls the requests back (preempt + recompute) as for any failed load;
      - those requests join the worker's failed set (``worker._FAILED``): the agreement
        (``pool_load_agreement``) has every TP rank drop their saves of this step at its final layer,
        and ``pool_load_report`` drops their saves in the steps already scheduled;
      - the step's remaining load work is abandoned: the queued tasks' lists are emptied (a queued
        ``LayerLoadTask`` then finds nothing to copy and sets its event), the worker gets fresh lists,
        and the step's read leases are released (not when the late layer is the final one: the late
        copy releases them when it returns, as upstream's final-layer bookkeeping does);
      - a WARNING says so, and the wait returns as if the event were set (upstream clears it); the
        step's remaining layers return at once (nothing submitted, nothing waited for).
      Late copy: the copy still inside MemCache writes into the blocks its load was given, which the
      rollback frees for vLLM to reuse. At the next ``prepare_layerwise_step`` (before the step
      computes) the late-copy fence (``_failed_load.late_copy_fence``, shared with 0.25) waits until
      the receiving thread is idle (no unfinished task: the thread sets a layer's event before
      ``task_done``), at most ``LATE_COPY_S`` (30 s), then every load event is cleared, so no late
      ``set()`` is taken for the new step's load and the thread's ``assert not ... is_set()`` never
      sees one. At TP > 1 the agreement tells every rank of an abandoned load on any rank and the
      ranks agree on the fence's outcome; a copy that never returns stops the engine on every rank.
Own group: a switch of its own (it changes how long the engine waits, and ``pool_load_recovery``
      stays useful without it); the control "only the bound off" is this group skipped.
Scope GVA layerwise transfer (``use_layerwise_transfer``) where the worker recovers failed loads
      (``worker.recovers``: with async scheduling at TP > 1 only with the agreement in force);
      elsewhere upstream's wait is kept. Key-major (block-key) layerwise stays upstream's.
Not done A layer of ``prefetch_layer_map`` (a load that reuses a save) is not waited for in an
      abandoned step.
"""

from __future__ import annotations

import functools
import time

from ... import pool_events
from ...host import logger
from .._checks import Counts
from .._checks import detect_at as _detect_at
from .._checks import expects as _expects
from .._checks import lookup as _lookup
from .._checks import source as _source
from .._targets import STORE
from .. import _failed_load  # WAIT_S, shared with vLLM 0.25's bound (load_failures.report)
from ._common import WAIT_BOUND_GROUP
from .worker import _FAILED, WORKER, _hit_blocks, recovers

_STEP = "_ascend_layerwise_patch_wait_step"  # worker: _Step of the step being executed

COUNTS = Counts("waits_timed_out", "blocks_reported", "stale_events_cleared", "late_copies_fenced")


class _Step:
    """The step's load work, as the worker prepared it."""

    __slots__ = ("requests", "late")

    def __init__(self, requests: list) -> None:
        self.requests = requests  # ReqMeta s with a load task this step (metadata order)
        self.late = False  # its loads were abandoned (or a late copy still occupies the thread)


def wait_s() -> float:
    return float(_failed_load.WAIT_S)


def _bounded(worker) -> bool:
    return (
        bool(getattr(worker, "use_layerwise_transfer", False))
        and getattr(worker, "kv_recv_thread", None) is not None
        and getattr(worker, "layer_load_finished_events", None) is not None
        and recovers(worker)
    )


def _loading(worker) -> list:
    seen: dict[int, object] = {}
    for tasks in worker.layer_load_tasks:
        for task in tasks:
            for rng in task.block_ranges:
                seen.setdefault(id(rng.request), rng.request)
    return list(seen.values())


def _give_up(worker, step: _Step, late_layer: int) -> list[int]:
    """Report every load block of the step, mark its requests failed, drop its queued loads and
    release its leases (unless the late copy is the final layer's: it releases them itself)."""
    blocks: set[int] = set()
    for request in step.requests:
        blocks.update(_hit_blocks(worker, request))
    if blocks:
        with worker._invalid_block_ids_lock:
            worker._invalid_block_ids.update(blocks)
    worker.__dict__.setdefault(_FAILED, set()).update(r.req_id for r in step.requests)
    for tasks in worker.layer_load_tasks:
        tasks.clear()  # a queued LayerLoadTask holds this list: it now copies nothing
    worker.layer_load_tasks = [[] for _ in range(worker.num_layers)]
    thread = worker.kv_recv_thread
    if late_layer != getattr(thread, "final_layer_id", worker.num_layers - 1):
        keys = list(dict.fromkeys(k for r in step.requests for k in (getattr(r, "load_keys", None) or ())))
        if keys:
            worker.m_store.batch_remove_lease(keys)
        for request in step.requests:
            if getattr(request, "is_last_chunk", False):
                thread.set_finished_request(request.req_id)
    step.late = True
    COUNTS.add("blocks_reported", len(blocks))
    return sorted(blocks)


class _BoundedEvent:
    """One layer's load event seen by the wrapped wait: at most ``WAIT_S`` of waiting in all."""

    __slots__ = ("_view", "_event")

    def __init__(self, view, event) -> None:
        self._view = view
        self._event = event

    def wait(self, timeout=None):
        view = self._view
        left = wait_s() - view.waited
        span = left if timeout is None else min(timeout, left)
        start = time.monotonic()
        if self._event.wait(max(span, 0.0)):
            return True
        view.waited += time.monotonic() - start
        if view.waited < wait_s():
            return False
        view.timed_out()
        return True  # upstream's loop ends; it clears the (unset) event

    def is_set(self):
        return self._event.is_set()

    def set(self):
        self._event.set()

    def clear(self):
        self._event.clear()


class _BoundedEvents:
    """The worker's ``layer_load_finished_events`` during one wrapped wait."""

    def __init__(self, worker, events, step: _Step) -> None:
        self.worker, self.events, self.step = worker, events, step
        self.waited = 0.0

    def __getitem__(self, index):
        return _BoundedEvent(self, self.events[index])

    def __len__(self):
        return len(self.events)

    def __iter__(self):
        return iter(self.events)

    def timed_out(self) -> None:
        worker, step = self.worker, self.step
        layer = worker.current_layer
        blocks = _give_up(worker, step, layer)
        COUNTS.add("waits_timed_out")
        pool_events.bump("load_late")  # pool_metrics: vllm:ascend_pool_load_failures_total{kind="late"}
        logger().warning(
            "ascend_layerwise_patch: KV pool layerwise load of layer %d did not finish within %.1f s "
            "(requests %s); every load block of the step (%s) is reported as failed and the step's "
            "remaining loads are abandoned (leases released): vLLM recomputes the requests "
            "(kv_load_failure_policy=recompute) or ends them with an error (fail)",
            layer,
            wait_s(),
            sorted(r.req_id for r in step.requests),
            blocks,
        )


def make_wait(original):
    """The layer wait, bounded (see the module docstring); a step whose loads were abandoned returns
    at once (upstream's layer counter kept)."""
    names = original.__globals__

    @functools.wraps(original)
    def wait_for_layer_load(self):
        step = self.__dict__.get(_STEP)
        if step is None or self.current_layer >= self.num_layers or not _bounded(self):
            return original(self)
        if step.late:
            self.kv_recv_thread.raise_if_failed()
            names["reset_attention_compute_start_gate"]()
            if hasattr(self, "kv_role") and not names["is_kv_save_role"](self.kv_role, getattr(self, "consumer_is_to_put", False)):
                self.current_layer += 1
            return None
        events = self.layer_load_finished_events
        self.layer_load_finished_events = _BoundedEvents(self, events, step)
        try:
            return original(self)
        finally:
            self.layer_load_finished_events = events

    return wait_for_layer_load


def make_prepare_step(original):
    """Notes the step's load work; after a late step (here or, told by the agreement, on another
    rank), waits in the late-copy fence until the receiving thread is idle, then clears stale load
    events."""

    @functools.wraps(original)
    def prepare_layerwise_step(self, metadata):
        old = self.__dict__.get(_STEP)
        result = original(self, metadata)
        if not _bounded(self):
            self.__dict__[_STEP] = None
            return result
        step = _Step(_loading(self))
        self.__dict__[_STEP] = step
        if (old is not None and old.late) or self.__dict__.get(_failed_load.LATE_ANYWHERE):
            # the late-copy fence: the late copy returns before this step computes anything (it would
            # otherwise write into blocks the rollback freed and vLLM reused); raises when it never does
            if _failed_load.late_copy_fence(self, self.kv_recv_thread) > 0.001:
                COUNTS.add("late_copies_fenced")
            stale = [ev for ev in self.layer_load_finished_events if ev.is_set()]
            for ev in stale:
                ev.clear()
            COUNTS.add("stale_events_cleared", len(stale))
        return result

    return prepare_layerwise_step


_RECV = f"{STORE}.kv_transfer:KVCacheStoreLayerRecvingThread"


def _wait_ok(original) -> str | None:
    problem = _expects(
        ["self"],
        needs=(
            "self.layer_load_finished_events[self.current_layer].wait(timeout=",
            "self.layer_load_finished_events[self.current_layer].clear()",
            "raise_if_failed",
            "_submit_ready_layer_loads",
            "is_kv_save_role",
            "self.current_layer += 1",
        ),
        globals_=("reset_attention_compute_start_gate", "is_kv_save_role"),
    )(original)
    if problem:
        return problem
    worker = _source(_lookup(WORKER))
    for name in ("_invalid_block_ids_lock", "layer_load_tasks", "load_keys", "self.layer_load_finished_events,"):
        if name not in worker:
            return f"KVPoolWorker no longer has {name}"
    handle = _source(_lookup(f"{_RECV}._handle_request"))
    sets = handle.rfind("self.layer_load_finished_events[layer_id].set()")
    done = handle.rfind("self.request_queue.task_done()")
    if sets < 0 or done < 0 or sets > done or "transfer_tasks = data.transfer_tasks" not in handle:
        return "the layer receiving thread no longer sets a layer's event before task_done, reading the worker's task list"
    return None


def _upstream_bounded(original) -> str | None:
    if "keep waiting" not in _source(original):
        return "KVPoolWorker.wait_for_layer_load no longer waits for a layer's load without end"
    return None


SPECS = (
    WAIT_BOUND_GROUP.spec(
        "pool_load_wait_step",
        f"{WORKER}.prepare_layerwise_step",
        make_prepare_step,
        precondition=_expects(["self", "metadata"], needs=("process_layer_data",)),
        fixed_upstream=_detect_at(f"{WORKER}.wait_for_layer_load", _upstream_bounded),
        why="after a timed-out layer load, stale load events are cleared, or the next step's loads abandoned",
        after=("pool_load_report_step", "pool_load_agree_step"),
    ),
    WAIT_BOUND_GROUP.spec(
        "pool_load_wait_bound",
        f"{WORKER}.wait_for_layer_load",
        make_wait,
        precondition=_wait_ok,
        fixed_upstream=_upstream_bounded,
        counters=COUNTS.snapshot,
        after=("load_fail_wait",),  # vLLM 0.25's group: never both in range
        why="a layer load that never finishes is reported after WAIT_S and recovered, instead of hanging the engine",
    ),
)
