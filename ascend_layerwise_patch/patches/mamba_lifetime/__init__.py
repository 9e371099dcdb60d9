"""Mamba block lifetime: layerwise sends hold the blocks they read, and let go when they are done.

Target   vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store:
         pool_scheduler.KVPoolScheduler.touch_sending_mamba_blocks        (scheduler half)
         pool_worker.KVPoolWorker.start_load_kv, .save_kv_layer,
         .build_connector_worker_meta                                      (worker half)
         kv_transfer.KVCacheStoreLayerSendingThread._handle_request,
         kv_transfer.KVCacheStoreKeyLayerSendingThread._handle_request     (worker half;
         both reached as pool_worker's names for these classes)
Versions vLLM >=0.25.0,<0.27; vllm-ascend >=0.25.1,<0.27 (base releases). vllm-ascend 0.26.0rc1
         still leaks the same way; its ``save_kv_layer`` waits for the step's last layer without a
         limit and a failed copy stops the sending thread (the worker raises), so there a send no
         longer outlives its step through the 10 s timeout described below.
Why      For hybrid models the scheduler gives every saving request's mamba blocks an extra
         reference under a new ``event_id`` and frees them once every worker reports that event in
         ``completed_events``. Only the non-layerwise sending thread reports; with
         ``use_layerwise=True`` nothing does, so every touched block leaks until the pool is
         exhausted. Skipping the touch (the seed change) stops the leak but leaves nothing holding
         the blocks while the layer sending thread copies them: ``save_kv_layer`` gives up waiting
         after 10 s, the request finishes or is preempted, and its blocks are handed to another
         request while the old send still reads them -- silent corruption of the KV pool.
How      The scheduler keeps touching (and records the blocks under the event, as before). Each
         worker notes the event ids of the metadata it is bound to (``start_load_kv``); after the
         step's last layer has been queued (``save_kv_layer``) it queues a release marker on the
         same FIFO as the layer copies. The sending thread is the only consumer, so when it reaches
         the marker every copy of that step is over -- done, failed, or raised. It then marks the
         events completed; ``build_connector_worker_meta`` reports them, and the scheduler's own
         ``update_connector_output`` frees the blocks once all ``_expected_worker_count`` workers
         have. A worker that sent nothing reaches the marker at once; a step with no forward keeps
         its events for the next step's marker (tasks it built are sent then). A layer whose copy
         raises has its task list cleared (upstream only clears it when the copy returns, so those
         tasks would be re-sent every later step, after their blocks were released). Hot paths
         stay plain functions: one comparison per layer, one ``type() is`` per queued item.
Full attention after a save timeout
         ``request_finished`` / ``request_finished_all_groups`` free every block at once in layerwise
         mode, so full-attention blocks have the same exposure: after a save timeout, a finished,
         aborted or preempted request's attention blocks can be reallocated and overwritten while
         the send still reads them (tests/standins/test_mamba_lifetime.py shows it). By default this
         patch gives them the same guarantee: the scheduler half also touches, under the same
         event, the non-null blocks of every other group from the first block this step may save
         (``save_start_token`` over the group's effective block size) to the end. Setting
         ``ASCEND_LAYERWISE_PATCH_MAMBA_HOLD_ATTENTION=0`` holds mamba blocks only (upstream's
         scope); risk: full-attention blocks can again be reused under a send that timed out.
         Nothing here waits: a send that never finishes keeps its blocks held (safe, not live).
Integrity ``send_integrity.py`` (same group, hooked into these wrappers) adds: keys are finished as
         written only with every layer slot written; each queued layer keeps its own task list and
         arrays; the engine keeps stepping while events are open; stuck copies are reported.
         ``send_shedding.py`` (same group) bounds the block references open sends hold: past the
         bound a step's new saves are shed (hooked into the touch below).
Removal  When vllm-ascend's worker reports completed events for layerwise sends itself (the
         fixed-upstream detector then skips the whole group). The group applies all or nothing:
         if the worker half cannot apply, the scheduler half does not either, and vllm-ascend's own
         behaviour remains -- touched mamba blocks leak in layerwise mode (see ``status()``).
"""

from __future__ import annotations

import functools
import importlib
import os
import threading

from .._targets import STORE
from .._checks import expects as _expects
from .._checks import source as _source
from . import send_integrity as _integrity
from . import send_shedding as _shedding
from . import v030 as _v030
from .._ranges import V029_030
from ._group import GROUP
from ._group import RISK as RISK  # the group's risk line, read by tests

ENV_HOLD_ATTENTION = "ASCEND_LAYERWISE_PATCH_MAMBA_HOLD_ATTENTION"

_PENDING = "_ascend_layerwise_patch_pending_events"  # worker: event ids not yet behind a marker
_DONE = "_ascend_layerwise_patch_done_events"  # worker: _Done, filled by the sending thread


class _Done:
    """Event ids the sending thread has finished with; drained by ``build_connector_worker_meta``."""

    __slots__ = ("lock", "ids")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ids: list[int] = []

    def add(self, ids: list[int]) -> None:
        with self.lock:
            self.ids.extend(ids)

    def take(self) -> list[int]:
        with self.lock:
            ids, self.ids = self.ids, []
        return ids


class _Release:
    """Queued behind a step's last layer; the sending thread reaching it ends that step's reads."""

    __slots__ = ("event_ids", "done")

    def __init__(self, event_ids: list[int], done: _Done) -> None:
        self.event_ids = event_ids
        self.done = done


def _hold_attention(environ=None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV_HOLD_ATTENTION, "1")
    return value.strip().lower() not in {"0", "false", "no", "off"}


# ---------------------------------------------------------------------------------- scheduler half
def make_touch(original, hold_attention: bool | None = None):
    """``touch_sending_mamba_blocks`` for layerwise mode; other modes call ``original``."""
    hold = _hold_attention() if hold_attention is None else hold_attention

    @functools.wraps(original)
    def touch_sending_mamba_blocks(self, req_meta):
        if not self.use_layerwise:
            return original(self, req_meta)
        mamba = self.mamba_group_ids
        if not self.use_hybrid or not mamba or not req_meta.can_save:
            return None
        held: list[int] = []
        for group_id, block_ids in enumerate(req_meta.block_ids_by_group):
            if group_id in mamba:
                held.extend(b for b in block_ids if b > 0)
            elif hold:
                first = req_meta.save_start_token // self._get_effective_group_block_size(group_id)
                if req_meta.partial_block_index is not None:
                    first = min(first, req_meta.partial_block_index)
                held.extend(b for b in block_ids[first:] if b > 0)
        if not _shedding.admit(self, req_meta, len(held)):
            return None  # shed (send_shedding.py): can_save cleared, nothing held
        pool = self._block_pool
        assert pool is not None, "bind_gpu_block_pool() was not called"
        event_id = self.get_sending_event_id()
        req_meta.event_id = event_id
        pool.touch([pool.blocks[b] for b in held])
        self.sending_events[event_id] = 0
        self.sending_blocks[event_id] = held
        return None

    return touch_sending_mamba_blocks


# ------------------------------------------------------------------------------------- worker half
def make_start_load_kv(original):
    @functools.wraps(original)
    def start_load_kv(self, metadata):
        if self.use_layerwise:
            _integrity.bind(self)
            ids = [r.event_id for r in metadata.requests if r.event_id is not None]
            if ids:
                self.__dict__.setdefault(_PENDING, []).extend(ids)
        return original(self, metadata)

    return start_load_kv


def _queue_release(worker) -> None:
    ids = worker.__dict__.pop(_PENDING, None)
    if not ids:
        return
    done = worker.__dict__.get(_DONE)
    if done is None:
        done = worker.__dict__.setdefault(_DONE, _Done())
    thread = worker.kv_send_thread
    if thread is None:
        done.add(ids)  # no sending thread on this worker: nothing reads the blocks
    else:
        thread.request_queue.put(_Release(ids, done))


def make_save_kv_layer(original):
    @functools.wraps(original)
    def save_kv_layer(self, connector_metadata):
        layer = self.current_layer
        last = layer == self.num_layers - 1
        queued = layer < self.num_layers and bool(self.layer_save_tasks[layer])
        original(self, connector_metadata)
        if queued:
            self.layer_save_tasks[layer] = []  # the sending thread owns the queued list now
        if last:
            _queue_release(self)
            _integrity.check_stuck(self)

    return save_kv_layer


def make_build_connector_worker_meta(original):
    meta_cls = original.__globals__["AscendStoreKVConnectorWorkerMetadata"]

    @functools.wraps(original)
    def build_connector_worker_meta(self):
        meta = original(self)
        if self.use_layerwise:
            _integrity.check_stuck(self)
        done = self.__dict__.get(_DONE)
        ids = done.take() if done is not None and done.ids else None
        if not ids:
            return meta
        if meta is None:
            meta = meta_cls()
        for event_id in ids:
            meta.completed_events[event_id] = 1  # one report per worker, as upstream
        return meta

    return build_connector_worker_meta


def make_handle_request(original):
    @functools.wraps(original)
    def _handle_request(self, transfer_tasks):
        if type(transfer_tasks) is _Release:
            transfer_tasks.done.add(transfer_tasks.event_ids)
            self.request_queue.task_done()
            return None
        try:
            return _integrity.handle(self, transfer_tasks, original)
        except Exception:
            # Upstream clears a layer's task list (the worker's own list object) only when the
            # copy returns; after a raise the same tasks would be sent again with every later
            # step, long after their blocks were released. Drop them, as a failed copy is.
            transfer_tasks.clear()
            raise

    return _handle_request


# ----------------------------------------------------------------------------- checks on targets
def _scheduler_ok(original) -> str | None:
    problem = _expects(["self", "req_meta"], needs=("sending_events", "sending_blocks", "get_sending_event_id"))(
        original
    )
    if problem:
        return problem
    cls = original.__globals__.get("KVPoolScheduler")
    for name in ("update_connector_output", "get_sending_event_id", "_get_effective_group_block_size"):
        if not callable(getattr(cls, name, None)):
            return f"KVPoolScheduler.{name} is gone"
    freeing = _source(cls.update_connector_output)
    if freeing and not all(n in freeing for n in ("completed_events", "_expected_worker_count", "free_blocks")):
        return "KVPoolScheduler.update_connector_output no longer frees on completed_events from every worker"
    return None


def _upstream_reports_layerwise(_original) -> str | None:
    """Skip the whole group once vllm-ascend's layer sending thread reports completed events."""
    kv_transfer = importlib.import_module(f"{STORE}.kv_transfer")
    thread = getattr(kv_transfer, "KVCacheStoreLayerSendingThread", None)
    if thread is not None and "completed_events" in _source(thread):
        return "KVCacheStoreLayerSendingThread reports completed events itself"
    return None


#: what this module's patches share (send_integrity's and send_shedding's have their own)
_LIFETIME = dict(
    why="layerwise sends hold the blocks they read (mamba and full attention) until the sending "
    "thread is done with them, then release them",
    fixed_upstream=_upstream_reports_layerwise,
)


_TASKS = ["self", "transfer_tasks"]
# The thread classes are reached through pool_worker's names for them (the same class objects as
# kv_transfer's): pool_worker imports kv_transfer, so a target *in* kv_transfer would have this group
# resolve while pool_worker is still half-imported whenever pool_worker is the first one imported.

SPECS = (
    GROUP.spec(
        "mamba_worker_events",
        f"{STORE}.pool_worker:KVPoolWorker.start_load_kv",
        make_start_load_kv,
        precondition=_expects(["self", "metadata"], needs=("use_layerwise", "current_layer")),
        **_LIFETIME,
    ),
    GROUP.spec(
        "mamba_worker_release",
        f"{STORE}.pool_worker:KVPoolWorker.save_kv_layer",
        make_save_kv_layer,
        precondition=_expects(
            ["self", "connector_metadata"], needs=("current_layer", "num_layers", "kv_send_thread", "layer_save_tasks")
        ),
        **_LIFETIME,
    ),
    GROUP.spec(
        "mamba_worker_report",
        f"{STORE}.pool_worker:KVPoolWorker.build_connector_worker_meta",
        make_build_connector_worker_meta,
        precondition=_expects(["self"], globals_=("AscendStoreKVConnectorWorkerMetadata",)),
        **_LIFETIME,
    ),
    GROUP.spec(
        "mamba_thread_marker",
        f"{STORE}.pool_worker:KVCacheStoreLayerSendingThread._handle_request",
        make_handle_request,
        precondition=_expects(_TASKS, needs=("request_queue.task_done",)),
        **_LIFETIME,
    ),
    GROUP.spec(
        "mamba_key_thread_marker",
        f"{STORE}.pool_worker:KVCacheStoreKeyLayerSendingThread._handle_request",
        make_handle_request,
        precondition=_expects(_TASKS, needs=("request_queue.task_done",)),
        **_LIFETIME,
    ),
    GROUP.spec(
        "mamba_scheduler_touch",
        f"{STORE}.pool_scheduler:KVPoolScheduler.touch_sending_mamba_blocks",
        make_touch,
        precondition=_scheduler_ok,
        **_LIFETIME,
    ),
    # vllm-ascend 0.30.0rc2 (v030.py): its own fix, vouched; and the stuck-send warning it lacks
    GROUP.vouched(
        "mamba_lifetime_030",
        _v030.WAIT,
        _v030.sends_end_with_their_step,
        ranges=V029_030,
        what="vllm-ascend 0.30.0rc2's end-of-step wait for every layerwise save copy (with "
        "VLLM_ASCEND_LW_DEFER_LAST_SAVE unset) and its untouched layerwise blocks",
    ),
    GROUP.spec(
        "send_stuck_030",
        _v030.WAIT,
        _v030.make_wait,
        ranges=V029_030,
        precondition=_v030.WAIT_EXPECTS,
        fixed_upstream=_v030.warns_itself,
        after=("mamba_lifetime_030",),
        why="a layerwise send that holds the step's last-layer wait is warned about and counted (0.30 waits silently)",
        risk="a stuck layerwise send holds the engine without a WARNING or a /metrics figure",
    ),
)
