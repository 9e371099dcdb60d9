"""Worker half of ``pool_load_recovery``: a hybrid request whose pool keys cannot be leased for the
load is reported (every hit block of every group) instead of raising; it loads and saves nothing
in that step. The package docstring says why."""

from __future__ import annotations

import functools
import threading

from ... import pool_events
from ...host import logger
from .._checks import Counts
from .._checks import detect_at as _detect_at
from .._checks import expects as _expects
from .._checks import lookup as _lookup
from .._checks import source as _source
from .._targets import STORE
from ._common import AGREES, GROUP

WORKER = f"{STORE}.pool_worker:KVPoolWorker"
#: what upstream raises for a hybrid request with a missing or unleasable key
FAIL_FAST = "safely fall back to per-block recomputation"
#: worker: {req_id} of requests whose load failed, saving nothing until their preemption or end arrives
_FAILED = "_ascend_layerwise_patch_failed_loads"
#: what the layer receiving thread raises when a layer's load copy returns an error
COPY_FAILED = "load batch_copy failed with return code"
#: receiving thread: [req_id] of requests whose copy failed, taken by the worker at its next step
_FAILED_COPIES = "_ascend_layerwise_patch_failed_copies"

_COUNTS = Counts("failed_loads_reported", "failed_copies_reported", "blocks_reported", "saves_dropped")
_count = _COUNTS.add
counters = _COUNTS.snapshot


class _HeldReleases:
    """The worker's store for one ``_prepare_load_gvas`` call: lease releases asked for by this
    thread are held (the caller decides which to make), everything else goes to the store."""

    def __init__(self, store):
        self._store = store
        self._thread = threading.get_ident()
        self.held: list[str] = []

    def batch_remove_lease(self, keys, *args, **kwargs):
        if threading.get_ident() != self._thread:
            return self._store.batch_remove_lease(keys, *args, **kwargs)
        self.held.extend(keys)
        return None  # upstream raises right after; the result is not read

    def __getattr__(self, name):
        return getattr(self._store, name)


def _hit_blocks(worker, request) -> list[int]:
    """The request's block ids, in every cacheable group, from vLLM's own hit up to the end of the
    pool hit (the partial block included): what the failed load would have written. Null blocks
    (0) are not the request's."""
    spec_ = request.load_spec
    cached = spec_.kvpool_cached_tokens
    if not getattr(worker, "use_eagle", False) and spec_.kvpool_store_skip_tokens is not None:
        cached = spec_.kvpool_store_skip_tokens
    groups = request.block_ids_by_group_np
    blocks: list[int] = []
    for group_id in range(worker.num_kv_cache_groups):
        if group_id not in worker.cacheable_group_ids:
            continue
        ids = groups[group_id] if groups is not None and group_id < len(groups) else request.block_ids_np
        if ids is None:
            continue
        size = worker.grouped_block_size[group_id]
        start = 0 if worker.layerwise_offload else spec_.vllm_cached_tokens // size
        end = min(-(-cached // size), len(ids))
        blocks.extend(int(b) for b in ids[start:end] if int(b) != 0)
    return sorted(set(blocks))


def _drop_saves(worker, request) -> int:
    """Take ``request``'s ranges out of the step's layer save tasks (built before the load is
    prepared) and clear its ``can_save`` before the save keys are allocated: nothing is put for it."""
    dropped = 0
    for layer, tasks in enumerate(worker.layer_save_tasks):
        kept = []
        for task in tasks:
            ranges = [r for r in task.block_ranges if r.request is not request]
            dropped += len(task.block_ranges) - len(ranges)
            if ranges:
                task.block_ranges = ranges
                kept.append(task)
        if len(kept) != len(tasks):
            worker.layer_save_tasks[layer] = kept
    request.can_save = False
    return dropped


#: receiving thread: whether its worker recovers failed loads (set by the worker every step)
_RECOVERS = "_ascend_layerwise_patch_recovers"
_UNSAFE_LOGGED: set[int] = set()


def _ranks(worker) -> int:
    """How many ranks compute one step of a request together (TP x PP x PCP of this worker)."""
    return int(getattr(worker, "tp_size", 1) or 1) * int(getattr(worker, "pp_size", 1) or 1) * int(getattr(worker, "pcp_size", 1) or 1)


def recovers(worker) -> bool:
    """Whether this worker may turn a failed load into a report. With async scheduling across
    several ranks only where the TP ranks agree on failed loads (``pool_load_agreement`` in force,
    TP alone: no PP, no PCP): the step scheduled before the failure was known is in flight on every
    rank, and without the agreement only the rank whose load failed knows to drop its saves -- the
    others (their layers computed on the failed rank's state through the all-reduce / the earlier
    stage) would publish keys computed on state never loaded. There upstream's stop is kept."""
    config = getattr(worker, "vllm_config", None)
    asynchronous = bool(getattr(getattr(config, "scheduler_config", None), "async_scheduling", False))
    if not (asynchronous and _ranks(worker) > 1):
        return True
    tp_only = _ranks(worker) == int(getattr(worker, "tp_size", 1) or 1)
    return tp_only and bool(worker.__dict__.get(AGREES))


def _kept_stop(worker, what: str) -> None:
    if id(worker) in _UNSAFE_LOGGED:
        return
    _UNSAFE_LOGGED.add(id(worker))
    logger().warning(
        "ascend_layerwise_patch: a KV pool %s failed and is NOT recovered: async scheduling with %d ranks "
        "(the step in flight saves on every rank, and only this one knows the load failed); vllm-ascend's "
        "own stop is kept. Turn async scheduling off (or run at one rank) to have failed loads recomputed",
        what,
        _ranks(worker),
    )


def make_prepare_load(original):
    """Hybrid workers: upstream's ``_prepare_load_gvas`` one request at a time; a request it would
    raise for (a key evicted or unleasable between the hit check and the load) loads nothing, its
    leases are released (not those another request of the step holds) and dropped from the step's
    lease cache, its hit blocks of every group are reported as invalid, and it saves nothing this
    step. Requests marked failed in an earlier step (async scheduling: scheduled before the failure
    was known) save nothing either."""

    @functools.wraps(original)
    def _prepare_load_gvas(self, requests):
        if getattr(self, "num_kv_cache_groups", 1) <= 1 or not getattr(self, "use_layerwise_transfer", False):
            return original(self, requests)
        if "m_store" not in self.__dict__:
            return original(self, requests)
        if not recovers(self):
            try:
                return original(self, requests)
            except RuntimeError as exc:
                if FAIL_FAST in str(exc):
                    _kept_stop(self, "load")
                raise
        failed = self.__dict__.setdefault(_FAILED, set())
        done: list = []
        for request in requests:
            if request.req_id in failed:
                _count("saves_dropped", _drop_saves(self, request))
            held = _HeldReleases(self.m_store)
            own = self.__dict__
            store = own.get("m_store")
            own["m_store"] = held
            try:
                original(self, [request])
            except RuntimeError as exc:
                own["m_store"] = store
                if FAIL_FAST not in str(exc):
                    if held.held:
                        store.batch_remove_lease(list(dict.fromkeys(held.held)))
                    raise
                _recover(self, request, held.held, done, failed)
                continue
            except BaseException:
                own["m_store"] = store
                if held.held:
                    store.batch_remove_lease(list(dict.fromkeys(held.held)))
                raise
            own["m_store"] = store
            if held.held:  # not upstream's flow today (it releases only before raising): release them
                store.batch_remove_lease(list(dict.fromkeys(held.held)))
            done.append(request)

    return _prepare_load_gvas


def _recover(worker, request, released: list[str], done: list, failed: set) -> None:
    others = {k for r in done for k in (getattr(r, "load_keys", None) or ())}
    release = [k for k in dict.fromkeys(released) if k not in others]
    if release:
        worker.m_store.batch_remove_lease(release)
    cache = getattr(worker, "_step_lease_result", None)
    if cache:
        for key in release:
            cache.pop(key, None)
    blocks = _hit_blocks(worker, request)
    request.load_spec.can_load = False
    request.load_keys = []
    request.load_block_gvas_by_group_np = None
    dropped = _drop_saves(worker, request)
    failed.add(request.req_id)
    with worker._invalid_block_ids_lock:
        worker._invalid_block_ids.update(blocks)
    _count("failed_loads_reported")
    pool_events.bump("load_failed")  # pool_metrics: a key gone before the load is a load that failed
    _count("blocks_reported", len(blocks))
    _count("saves_dropped", dropped)
    logger().warning(
        "ascend_layerwise_patch: KV pool load of request %s failed (a key was evicted or could not be leased "
        "after the hit check); nothing is loaded or saved for it in this step, its blocks %s (every KV cache "
        "group) are reported as failed: vLLM recomputes it (kv_load_failure_policy=recompute) or ends it with "
        "an error (fail)",
        request.req_id,
        blocks,
    )


def make_prepare_step(original):
    """A request marked failed stops being so once its preemption or end reaches the worker (the
    step's ``released_req_ids``, or ``preempted_req_ids``): its resume is a new request."""

    @functools.wraps(original)
    def prepare_layerwise_step(self, metadata):
        thread = getattr(self, "kv_recv_thread", None)
        if thread is not None:
            thread.__dict__[_RECOVERS] = recovers(self)
        copies = thread.__dict__.get(_FAILED_COPIES) if thread is not None else None
        if copies:  # the previous step's failed copies (recorded before its layer waits returned)
            failed = self.__dict__.setdefault(_FAILED, set())
            while copies:
                failed.add(copies.pop())
        failed = self.__dict__.get(_FAILED)
        if failed:
            failed -= set(getattr(metadata, "released_req_ids", None) or ())
            failed -= set(getattr(metadata, "preempted_req_ids", None) or ())
        return original(self, metadata)

    return prepare_layerwise_step


def make_recv_handle(original):
    """The layer receiving thread: a layer's load copy that returns an error is reported -- every
    block of that layer's load ranges (upstream's own ``_mark_invalid_transfer_task_blocks``), the
    requests marked failed for the worker -- and the layer's bookkeeping runs as after a copy that
    succeeded (at the final layer the read leases are released and last chunks finished; the layer's
    event is set, ``task_done``), instead of the thread recording a fatal error and stopping (which
    ends the engine at the next layer wait). One batched copy carries every request of the layer:
    all of them are reported. A late copy (its wait gave up and ``pool_load_wait_bound`` emptied the
    step's task lists) that fails only gets that bookkeeping: its step was reported already (on
    MemCache 1.2.0 it fails whenever the bound released its read lease first). A copy that raises
    stays upstream's fatal error (``make_batch_copy`` turns it into a failed copy)."""

    @functools.wraps(original)
    def _handle_request(self, data):
        try:
            return original(self, data)
        except RuntimeError as exc:
            tasks = getattr(data, "transfer_tasks", None)
            if COPY_FAILED in str(exc) and tasks is not None and not tasks:
                # a late copy: its wait gave up meanwhile and pool_load_wait_bound reported the step
                # and emptied its task lists; that its copy failed too changes nothing
                _late_copy_failed(self, data.layer_id, exc)
                return None
            if COPY_FAILED not in str(exc) or not tasks or tasks[0].use_key_major_ranges:
                raise
            if not self.__dict__.get(_RECOVERS, False):  # its worker keeps upstream's stop (or never said)
                _kept_stop(self, "load copy")
                raise
        _recover_copy(self, data)

    return _handle_request


def make_batch_copy(original):
    """The receiving thread's copies (direction 1, pool -> device): a copy that raises is a copy that
    failed (-1), so the layer's failure is reported as one that returned an error; upstream records
    a fatal error and the thread stops. Saves (the sending threads) are untouched."""

    @functools.wraps(original)
    def _batch_copy_with_limits(self, gvas, addrs, sizes, direction, max_transfer_blocks, max_transfer_bytes):
        if direction != 1:
            return original(self, gvas, addrs, sizes, direction, max_transfer_blocks, max_transfer_bytes)
        try:
            res = original(self, gvas, addrs, sizes, direction, max_transfer_blocks, max_transfer_bytes)
        except Exception as exc:  # noqa: BLE001 - a raising store is a failed copy
            logger().warning("ascend_layerwise_patch: KV pool load copy raised (%s: %s); treated as a failed copy",
                             type(exc).__name__, exc)
            pool_events.bump("load_raised")  # pool_metrics: vllm:ascend_pool_load_failures_total{kind="raised"}
            return -1
        if res != 0:
            pool_events.bump("load_failed")  # ... {kind="failed"}
        return res

    return _batch_copy_with_limits


def _layer_done(thread, layer_id: int) -> None:
    """The layer's bookkeeping after its copy, as upstream does after one that succeeded."""
    if not thread.layer_load_finished_events[layer_id].is_set():
        thread.layer_load_finished_events[layer_id].set()
    thread.request_queue.task_done()
    thread.get_event.set()


def _late_copy_failed(thread, layer_id: int, exc) -> None:
    try:
        logger().warning(
            "ascend_layerwise_patch: the late KV pool load copy of layer %d returned after its step had given up "
            "on it (%s); its requests were already reported, nothing more to do", layer_id, exc)
    finally:
        _layer_done(thread, layer_id)


def _recover_copy(thread, data) -> None:
    layer_id = data.layer_id
    tasks = data.transfer_tasks
    thread._mark_invalid_transfer_task_blocks(tasks)
    requests = list({id(r.request): r.request for t in tasks for r in t.block_ranges}.values())
    thread.__dict__.setdefault(_FAILED_COPIES, []).extend(r.req_id for r in requests)
    try:
        if layer_id == thread.final_layer_id:
            keys = list(dict.fromkeys(k for r in requests for k in (getattr(r, "load_keys", None) or ())))
            if keys:
                thread.m_store.batch_remove_lease(keys)
            for request in requests:
                if getattr(request, "is_last_chunk", False):
                    thread.set_finished_request(request.req_id)
    finally:
        _count("failed_copies_reported")
        logger().warning(
            "ascend_layerwise_patch: KV pool load copy of layer %d failed for request(s) %s; their blocks of that "
            "layer's load are reported as failed (vLLM recomputes or ends them; they save nothing until then)",
            layer_id,
            sorted(r.req_id for r in requests),
        )
        _layer_done(thread, layer_id)


def _recv_ok(original) -> str | None:
    problem = _expects(
        ["self", "data"],
        needs=(COPY_FAILED, "use_key_major_ranges", "final_layer_id", "batch_remove_lease", "set_finished_request",
               "self.request_queue.task_done()", "self.get_event.set()"),
    )(original)
    if problem:
        return problem
    cls = original.__globals__.get("KVCacheStoreLayerRecvingThread")
    if cls is None or not callable(getattr(cls, "_mark_invalid_transfer_task_blocks", None)):
        return "KVCacheStoreLayerRecvingThread._mark_invalid_transfer_task_blocks is gone"
    text = _source(original)
    raised, released = text.find("batch_copy failed with return code"), text.find("batch_remove_lease")
    if raised < 0 or released < 0 or raised > released:
        return "the receiving thread no longer raises for a failed copy before its final-layer bookkeeping"
    return None


def _upstream_reports_copies(original) -> str | None:
    if COPY_FAILED not in _source(original):
        return "the layer receiving thread no longer raises for a failed load copy"
    return None


def _prepare_load_ok(original) -> str | None:
    problem = _expects(
        ["self", "requests"],
        needs=(FAIL_FAST, "batch_remove_lease", "_step_lease_result", "_invalid_block_ids", "load_keys", "self.m_store"),
    )(original)
    if problem:
        return problem
    text = _source(getattr(_lookup(WORKER), "process_layer_data", None))
    saves, load, alloc = (text.find(name) for name in ("_process_save_for_layer_batch(", "_prepare_load_gvas(", "_alloc_gvas_for_save("))
    if min(saves, load, alloc) < 0 or not saves < load < alloc:
        return "KVPoolWorker.process_layer_data no longer builds save tasks, then prepares loads, then allocates saves"
    return None


def _upstream_reports(original) -> str | None:
    if FAIL_FAST not in _source(original):
        return "KVPoolWorker._prepare_load_gvas no longer raises for a hybrid request with a failed key"
    return None


SPECS = (
    GROUP.spec(
        "pool_load_report_raise",
        f"{STORE}.pool_worker:KVCacheStoreLayerRecvingThread._batch_copy_with_limits",
        make_batch_copy,
        precondition=_expects(
            ["self", "gvas", "addrs", "sizes", "direction", "max_transfer_blocks", "max_transfer_bytes"], needs=("batch_copy",)
        ),
        fixed_upstream=_detect_at(f"{STORE}.kv_transfer:KVCacheStoreLayerRecvingThread._handle_request", _upstream_reports_copies),
        why="a layerwise load copy that raises is a failed copy (reported), not the receiving thread's fatal error",
        after=("load_fail_copy", "pool_metrics_load_copy"),  # vllm-ascend <0.27 groups: never both in range
    ),
    GROUP.spec(
        "pool_load_report_copy",
        f"{STORE}.kv_transfer:KVCacheStoreLayerRecvingThread._handle_request",
        make_recv_handle,
        precondition=_recv_ok,
        fixed_upstream=_upstream_reports_copies,
        why="a layerwise load copy that fails is reported for its requests (recompute or fail) instead of "
        "stopping the receiving thread (and the engine)",
    ),
    GROUP.spec(
        "pool_load_report",
        f"{WORKER}._prepare_load_gvas",
        make_prepare_load,
        precondition=_prepare_load_ok,
        fixed_upstream=_upstream_reports,
        counters=counters,
        after=("mamba_pool_null_loads", "mamba_pool_resume_load"),  # mamba_pool_hit (vllm-ascend <0.26): never both in range
        why="a hybrid request whose pool key is evicted before its load is reported (every group's hit blocks) "
        "and loads and saves nothing, instead of raising out of execute_model",
    ),
    GROUP.spec(
        "pool_load_report_step",
        f"{WORKER}.prepare_layerwise_step",
        make_prepare_step,
        precondition=_expects(["self", "metadata"], needs=("process_layer_data",)),
        fixed_upstream=_detect_at(f"{WORKER}._prepare_load_gvas", _upstream_reports),
        why="a request whose pool load failed saves nothing until its preemption or end reaches the worker",
        risk="under async scheduling the step after a failed load saves keys computed on the unloaded state",
    ),
)
