"""Layerwise send integrity: no pool key ready with unwritten layers, idle steps until held blocks
are released, stuck copies reported.

Target   vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store:
         pool_worker:KVCacheStoreLayerSendingThread._batch_copy_with_limits    (the save copy)
         pool_worker:KVCacheStoreLayerSendingThread.build_shared_data          (per-step arrays)
         ascend_store_connector:AscendStoreConnector.has_pending_push_work     (scheduler side)
         and, through the ``mamba_lifetime`` wrappers of the same group, KVPoolWorker.start_load_kv,
         .save_kv_layer, .build_connector_worker_meta and both layer sending threads'
         ``_handle_request`` (one group: the two modules patch the same send path).
Versions vLLM >=0.25.0,<0.27; vllm-ascend >=0.25.1,<0.27 (base releases). On vllm-ascend 0.26.0rc1
         ``send_integrity_copy`` is skipped as fixed upstream (its sending thread stops at a failed or
         raising save copy before any key is finished, and the worker raises), and the stuck-copy
         WARNING cannot fire (``save_kv_layer`` waits for the step's last layer without a limit, so
         no step runs while a copy hangs). ``send_integrity_own_arrays`` and
         ``send_integrity_idle_steps`` apply: a rank that saves nothing at the last layer (at TP > KV
         heads with ``gdn_tp_keys``) does not wait for its own sends, which then outlive the step.
Why      1. With MemCache's GVA path a pool key is one object holding every layer slot of one
            rank's block; the layer sending thread publishes it (``batch_write_finish`` with 0)
            after the final layer, however its other layers went: a layer whose copy raised, or
            whose queued task list the next step rebuilt after ``save_kv_layer``'s 10 s wait gave
            up (the worker reuses the list objects it handed to the thread), never wrote its slot,
            and the key is still finished as written -- later hits load garbage for that layer.
         2. Held blocks are released through ``build_connector_worker_meta``, which only runs in a
            step; vLLM stops stepping when its last request finishes, so events still open then
            stay open, their blocks pinned, and ``reset_prefix_cache(reset_running_requests=True)``
            raises.
         3. A copy that never returns keeps its blocks held (safe) and nobody is told.
How      1. Each layer copy that returns 0 records, per key whose GVA it wrote, the slot (the layer's
            index in its KV cache group). When the final layer's copy returns, every key the thread
            is about to finish that lacks a slot of its group gets a failure result (upstream keeps
            the first failure per key), so MemCache finishes it as failed: a miss for
            ``batch_get_key_info`` and so for ``_get_layerwise_gva_hit_tokens``. If the final
            layer raises before its copy returned, the thread finishes that layer's keys as failed
            itself. A send still queued when the next step starts (after that wait gave up) keeps
            what it was built with: the worker hands each layer's task list over once (a fresh
            list is left in its place), and each step's block / GVA arrays are its own (upstream
            returns views of a per-group buffer that the next step's build overwrites).
            Tensor parallel: each rank writes and finishes its own ``@rank`` key and the lookup
            needs every rank's key, so a block hits only when every rank's key is complete. The
            key-per-layer variant (``put`` per layer key) is complete by construction: a missing
            layer is a missing key.
         2. ``AscendStoreConnector.has_pending_push_work`` (vLLM's own hook: it keeps
            ``Scheduler.has_requests()`` true, so ``EngineCoreProc`` keeps stepping, with no model
            run) is true while a layerwise send event is open and the oldest one has not been open
            longer than ``IDLE_STEP_LIMIT_S`` without progress; a copy stuck beyond that keeps its
            blocks held until the next step.
         3. The sending thread notes when its current copy began; the worker checks after the
            step's last layer and in ``build_connector_worker_meta`` (every step, no-forward steps
            too): a copy in flight longer than ``STUCK_AFTER_S`` (``save_kv_layer``'s own wait) is
            logged as a WARNING naming its requests and how long, again every
            ``STUCK_REPEAT_S`` while it stays stuck, and counted in ``counters()`` (shown by
            ``status()`` and ``check --json`` in this process). Nothing is freed for it.
Removal  When vllm-ascend finishes layerwise keys only after every slot was written and reports
         pending sends to the scheduler (detected: ``has_pending_push_work`` defined by
         AscendStoreConnector itself skips that patch).
"""

from __future__ import annotations

import functools
import re
import threading
import time
import weakref

from ... import pool_events
from ...host import logger
from .._checks import expects
from .._targets import STORE
from .._targets import save_keys as _save_keys
from .._checks import source as _source
from ._group import GROUP  # same group as the lifetime patch: one send path, all or nothing


INCOMPLETE = -1  #: the write result a key with an unwritten slot is finished with (non-zero: failed)
STUCK_AFTER_S = 10.0  #: save_kv_layer's own wait for the step's last layer
STUCK_REPEAT_S = 60.0  #: repeat the warning this often while the copy stays stuck
IDLE_STEP_LIMIT_S = 60.0  #: idle engine steps stop once the oldest open event made no progress this long

LEDGER = "_ascend_layerwise_patch_ledger"  # sending thread: its _Ledger
_WATCH = "_ascend_layerwise_patch_stuck_watch"  # worker: (seq warned about, last warning time)
_HEAD = "_ascend_layerwise_patch_oldest_event"  # scheduler: (oldest open event id, seen since)
_WRITTEN = "_ascend_layerwise_patch_written"  # a step's SharedBlockData: its _Written

_counts_lock = threading.Lock()
_counts = {"stuck_sends_total": 0, "incomplete_keys_failed": 0}
_ledgers: weakref.WeakSet = weakref.WeakSet()  # every sending thread's ledger in this process


def counters() -> dict[str, int]:
    """This process's counts: copies stuck now and ever, keys finished as failed for a gap."""
    now = time.monotonic()
    stuck = sum(1 for ledger in list(_ledgers) if ledger.since and now - ledger.since >= STUCK_AFTER_S)
    with _counts_lock:
        return {"stuck_sends": stuck, **_counts}


def _count(name: str, n: int = 1) -> None:
    with _counts_lock:
        _counts[name] += n
    pool_events.bump({"incomplete_keys_failed": "pool_keys_failed", "stuck_sends_total": "stuck_sends"}[name], n)


class _Written:
    """The layer slots one step's copies of one KV cache group have written (one copy per layer
    writes every key of the group at once)."""

    __slots__ = ("group", "slots")

    def __init__(self, group: int) -> None:
        self.group = group
        self.slots: set[int] = set()


class _Ledger:
    """One sending thread's view: the item in flight and, per key, what wrote its slots so far."""

    __slots__ = ("worker", "owner", "item", "final", "copied", "since", "seq", "__weakref__")

    def __init__(self, worker) -> None:
        self.worker = worker  # _allocated_gvas (key -> GVA) and group_num_layers live there
        self.owner: dict[str, _Written] = {}  # key -> the group copies that wrote its GVA
        self.item = None  # the task list being sent
        self.final = False
        self.copied = False
        self.since = 0.0  # monotonic start of the item in flight; 0.0 when idle
        self.seq = 0

    # -- the sending thread (the only writer of everything but ``worker``)
    def begin(self, tasks, final_layer_id: int) -> None:
        self.item, self.copied, self.seq = tasks, False, self.seq + 1
        self.final = bool(tasks) and tasks[0].layer_id == final_layer_id
        self.since = time.monotonic()

    def end(self) -> None:
        self.item, self.since = None, 0.0

    def copy_returned(self, thread, res: int) -> None:
        """Record the slot this item wrote; before the final finish, fail every key with a gap."""
        self.copied = True
        tasks = self.item or ()
        if res == 0:
            for task in tasks:
                shared = task.shared_block_data
                if shared is None or not shared.save_keys:
                    continue
                written = shared.__dict__.get(_WRITTEN)
                if written is None:  # this step's first good copy of the group: whose GVAs are these
                    written = shared.__dict__[_WRITTEN] = _Written(task.group_id)
                    gvas = set(shared.block_gvas_arr.tolist())
                    gva_of = self.worker._allocated_gvas
                    for key in shared.save_keys:
                        if gva_of.get(key) in gvas:
                            self.owner[key] = written
                written.slots.add(task.layer_idx_in_group)
        if not self.final:
            return
        results = thread.write_results
        layers = self.worker.group_num_layers
        gaps = 0
        for key in _save_keys(tasks):
            written = self.owner.pop(key, None)
            if written is None or len(written.slots) < layers.get(written.group, self.worker.num_layers):
                if not results.get(key):
                    results[key] = INCOMPLETE  # upstream's `get(key, 0) or res` keeps it
                gaps += 1
        if gaps:
            _count("incomplete_keys_failed", gaps)

    def raised(self, thread) -> None:
        """The final layer raised before its copy returned: finish its keys as failed here."""
        if not self.final or self.copied:
            return
        keys = _save_keys(self.item or ())
        for key in keys:
            thread.write_results.pop(key, None)
            self.owner.pop(key, None)
        if keys:
            thread.m_store.batch_write_finish(keys, [INCOMPLETE] * len(keys))
            _count("incomplete_keys_failed", len(keys))



def _req_ids(tasks) -> list[str]:
    ids: dict[str, None] = {}
    for task in tasks or ():
        for block_range in task.block_ranges:
            ids[block_range.request.req_id] = None
    return list(ids)


# ------------------------------------------------------------------- hooks for the lifetime wrappers
def bind(worker) -> None:
    """``start_load_kv``: give the worker's sending thread its ledger (once)."""
    thread = worker.kv_send_thread
    if thread is not None and LEDGER not in thread.__dict__:
        ledger = thread.__dict__[LEDGER] = _Ledger(worker)
        _ledgers.add(ledger)


def handle(thread, tasks, original):
    """``_handle_request`` of a layer sending thread, with the item noted in the ledger."""
    ledger = thread.__dict__.get(LEDGER)
    if ledger is None:
        return original(thread, tasks)
    ledger.begin(tasks, thread.final_layer_id)
    try:
        return original(thread, tasks)
    except Exception:
        if _copies_tracked(thread):  # else (vllm-ascend 0.26) a raise ends the thread, nothing finished
            ledger.raised(thread)
        raise
    finally:
        ledger.end()


def _copies_tracked(thread) -> bool:
    """Whether ``send_integrity_copy`` is installed on this thread's class (skipped where fixed upstream):
    the class attribute is one of the replacements :func:`make_batch_copy` made (reverted: it is not)."""
    return getattr(type(thread), "_batch_copy_with_limits", None) in _COPY_WRAPPERS


def check_stuck(worker, now: float | None = None) -> None:
    """Warn (rate-limited) and count while the worker's sending thread has a copy stuck in flight."""
    thread = worker.kv_send_thread
    ledger = thread.__dict__.get(LEDGER) if thread is not None else None
    if ledger is None:
        return
    since, seq = ledger.since, ledger.seq
    now = time.monotonic() if now is None else now
    if not since or now - since < STUCK_AFTER_S:
        return
    warned_seq, last = worker.__dict__.get(_WATCH, (0, 0.0))
    if warned_seq == seq and now - last < STUCK_REPEAT_S:
        return
    worker.__dict__[_WATCH] = (seq, now)
    if warned_seq != seq:
        _count("stuck_sends_total")
        pool_events.watch_age("oldest_stuck_send_age_seconds", _stuck_since(ledger, seq))
    item = list(ledger.item or ())  # a snapshot: the thread may clear it meanwhile
    logger().warning(
        "ascend_layerwise_patch: layerwise KV send stuck: tp rank %s, layer %s copy of request(s) %s "
        "in flight for %.3g s (save_kv_layer waits %.3g s); its blocks stay held until it returns",
        getattr(worker, "tp_rank", "?"),
        item[0].layer_id if item else "?",
        ", ".join(_req_ids(item)) or "?",
        now - since,
        STUCK_AFTER_S,
    )


def _stuck_since(ledger: _Ledger, seq: int):
    """When item ``seq`` of ``ledger`` began while its copy is still in flight, else 0.0 (pool_events'
    age gauge; ``copied`` is set as the copy returns, before the thread reports the send complete)."""
    return lambda: ledger.since if ledger.seq == seq and not ledger.copied else 0.0


# ------------------------------------------------------------------------------------- factories
#: the replacements make_batch_copy built (weak: a reverted one goes with its last reference)
_COPY_WRAPPERS: weakref.WeakSet = weakref.WeakSet()


def make_batch_copy(original):
    @functools.wraps(original)
    def _batch_copy_with_limits(self, gvas, addrs, sizes, direction, *args, **kwargs):
        res = original(self, gvas, addrs, sizes, direction, *args, **kwargs)
        ledger = self.__dict__.get(LEDGER)
        if ledger is not None and direction == 0 and ledger.item is not None:
            ledger.copy_returned(self, res)
        return res

    _COPY_WRAPPERS.add(_batch_copy_with_limits)
    return _batch_copy_with_limits


def make_build_shared_data(original):
    @functools.wraps(original)
    def build_shared_data(self, task):
        shared = original(self, task)
        if shared is not None:  # views of the builder's buffer, reused by the next step's build
            shared.block_ids_arr = shared.block_ids_arr.copy()
            shared.block_gvas_arr = shared.block_gvas_arr.copy()
        return shared

    return build_shared_data


def make_has_pending_push_work(original):
    @functools.wraps(original)
    def has_pending_push_work(self):
        sched = getattr(self, "connector_scheduler", None)
        if sched is None or not sched.use_layerwise or not sched.sending_events:
            return original(self)
        oldest = next(iter(sched.sending_events))  # event ids grow; dicts keep insertion order
        now = time.monotonic()
        seen = sched.__dict__.get(_HEAD)
        if seen is None or seen[0] != oldest:
            sched.__dict__[_HEAD] = (oldest, now)
            return True
        return now - seen[1] < IDLE_STEP_LIMIT_S or original(self)

    return has_pending_push_work


# ----------------------------------------------------------------------------- checks on targets
def _copy_ok(original) -> str | None:
    import inspect

    params = list(inspect.signature(original).parameters)[:5]
    if params != ["self", "gvas", "addrs", "sizes", "direction"]:
        return f"_batch_copy_with_limits parameters start {params}"
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import kv_transfer

    thread = kv_transfer.KVCacheStoreLayerSendingThread
    handle_src = _source(vars(thread)["_handle_request"])
    needed = ("_batch_copy_with_limits", "write_results.get(key, 0) or res", "final_layer_id", "batch_write_finish")
    missing = [n for n in needed if handle_src and n not in handle_src]
    if missing:
        return f"KVCacheStoreLayerSendingThread._handle_request no longer uses {', '.join(missing)}"
    return None


def _copy_fails_fast(_original) -> str | None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import kv_transfer

    handle_src = _source(vars(kv_transfer.KVCacheStoreLayerSendingThread)["_handle_request"])
    if re.search(r"if res != 0:\s*raise ", handle_src):
        return (
            "vllm-ascend's layer sending thread stops at a failed or raising save copy before any key "
            "is finished (its worker then raises)"
        )
    return None


def _shared_ok(_original) -> str | None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import config_data

    fields = getattr(config_data.SharedBlockData, "__dataclass_fields__", {})
    if not {"block_ids_arr", "block_gvas_arr", "save_keys"} <= set(fields):
        return "SharedBlockData no longer has block_ids_arr / block_gvas_arr / save_keys"
    return None


def _push_work_ok(_original) -> str | None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if "has_pending_push_work" not in _source(Scheduler.has_requests):
        return "vLLM's Scheduler.has_requests no longer consults has_pending_push_work"
    return None


def _push_work_upstream(original) -> str | None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import ascend_store_connector

    if "has_pending_push_work" in vars(ascend_store_connector.AscendStoreConnector):
        return "AscendStoreConnector defines has_pending_push_work itself"
    return None


SPECS = (
    GROUP.spec(
        "send_integrity_copy",
        f"{STORE}.pool_worker:KVCacheStoreLayerSendingThread._batch_copy_with_limits",
        make_batch_copy,
        why="a layerwise pool key is finished as written only when every layer slot was written",
        precondition=_copy_ok,
        risk="pool keys with unwritten layers can be published as ready",
        fixed_upstream=_copy_fails_fast,
        counters=counters,
    ),
    GROUP.spec(
        "send_integrity_own_arrays",
        f"{STORE}.pool_worker:KVCacheStoreLayerSendingThread.build_shared_data",
        make_build_shared_data,
        why="a queued layer send keeps its own block and GVA arrays when the next step builds its own",
        expects=expects(["self", "task"]),
        precondition=_shared_ok,
        risk="a send still queued after a save timeout copies the next step's blocks",
    ),
    GROUP.spec(
        "send_integrity_idle_steps",
        f"{STORE}.ascend_store_connector:AscendStoreConnector.has_pending_push_work",
        make_has_pending_push_work,
        why="the engine keeps stepping (no model run) until open layerwise send events are reported",
        expects=expects(["self"]),
        precondition=_push_work_ok,
        risk="blocks held by layerwise sends stay pinned on an idle engine",
        fixed_upstream=_push_work_upstream,
    ),
)
