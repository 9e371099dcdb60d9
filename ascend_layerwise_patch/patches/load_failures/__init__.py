"""A failed or late layerwise load is reported to vLLM, which recomputes (or fails) the request.

Target   vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_worker:
         KVPoolWorker.wait_for_layer_load                                   (worker half)
         KVCacheStoreLayerRecvingThread._handle_request, ._batch_copy_with_limits
                                                                            (worker half; the
         receiving thread class is reached through pool_worker's name for it)
         vllm.v1.core.sched.scheduler:Scheduler._update_requests_with_invalid_blocks
                                                                            (scheduler half)
         vllm_ascend.platform:NPUPlatform._validate_kv_load_failure_policy   (own group,
         ``load_failures_policy``: the platform is imported while vLLM's own modules are still
         initialising, long before the others can be resolved)
Versions vLLM >=0.25.0,<0.26; vllm-ascend >=0.25.1,<0.26 (base releases). Not widened to 0.26:
         vllm-ascend 0.26.0rc1 stops the engine on a failed hybrid load by design (the receiving
         thread stops at a failed or raising copy and the worker raises; ``_prepare_load_gvas``
         raises for a hybrid request with a missing key), so there is no silent wrong-token path
         to report; turning that fail-fast back into a recompute would replace upstream's choice,
         not fix a defect.
Why      In the layerwise receiving thread a ``batch_copy`` that returns an error is logged and the
         layer's finished event is set anyway; one that raises leaves the event unset (the run
         loop swallows the exception), so the layer waits 10 s; ``wait_for_layer_load`` then logs
         the timeout at INFO and the layer computes. Blocks whose GVA lookup failed are dropped from
         the copy with a warning and, for hybrid requests, deliberately not reported. In every case
         the layer computes on blocks that were never loaded and vLLM is told nothing: wrong tokens,
         silently. vLLM already has the remedy -- blocks returned by the connector's
         ``get_block_ids_with_load_errors()`` go to ``Scheduler._handle_invalid_blocks``, which
         follows ``kv_transfer_config.kv_load_failure_policy`` (``recompute``: roll the request
         back before the bad blocks and drop this step's output; ``fail``: end it with an error)
         -- but vLLM 0.25's ``_update_requests_with_invalid_blocks`` unpacks the block ids of a
         single KV cache group: for a hybrid request it raises ("too many values to unpack"),
         which is why vllm-ascend skips the report for hybrid requests.
How      Worker: the receiving thread turns a copy that raises into a failed copy (so the layer's
         bookkeeping -- lease release, finished event, ``task_done`` -- still runs) and records the
         blocks of every failed copy. ``wait_for_layer_load`` keeps upstream's flow and 10 s
         timeout and, per step, adds to the worker's ``_invalid_block_ids`` (what
         ``get_block_ids_with_load_errors`` returns at the end of the same step): blocks of the
         step's loads that could not be copied (no GVA), blocks of failed copies, and, when a wait
         times out (logged at WARNING with the layer and request ids), every block of the step's
         loads -- the step's remaining loads are then abandoned: queued ones are emptied (the thread
         skips them), their leases released, and no later load is submitted until the receiving
         thread is idle again; then every stale load event is cleared, so no later step mistakes a
         late load's event for its own. Loads in later steps meanwhile are reported, not waited on.
         Scheduler: for a request of a hybrid coordinator (more than one KV cache group) the
         rollback point is the longest prefix every group can resume from: before the first
         invalid block of every group (later blocks may derive from it) and, for mamba groups,
         with a state block at that point that is neither null nor invalid (or the start). Every
         group rolls back together; under ``fail`` the blocks from that point on, in every group,
         are evicted from the prefix cache.
         Single-group schedulers run upstream's code unchanged. vllm-ascend's platform refuses
         ``recompute`` for hybrid models (its config check asserts); with the rollback above that
         refusal is lifted while ``load_failures`` is applied or pending in the process (the check
         is otherwise unchanged; with ``load_failures`` skipped or failed the refusal stands).
Policy   Use ``kv_load_failure_policy: recompute`` with a layerwise pool (vLLM's default is
         ``fail``): a store hiccup then costs one recomputed prefix instead of a failed request.
Residual A copy already inside MemCache when the wait gives up cannot be recalled; it may still
         write into the request's blocks. Under ``recompute`` those blocks stay with the request
         and receive the same bytes; under ``fail`` they are freed and may be reused meanwhile.
Saves    (group ``load_failures_saves``) The failed step still computes from the unloaded state
         and saves its new blocks, every group's (the chunk-end GDN state included); the layer
         sending thread would finish them as ready at the final layer (send_integrity cannot see it:
         every slot was written). The worker marks the step's ReqMeta s of requests whose loads
         failed; the sending thread's final layer gives their save keys a failed result before
         upstream's finish (in the thread: no race on ``write_results``). Under async scheduling the
         next step is already scheduled on the failed state: the request stays marked in later steps
         until its preemption (or end) reaches the worker. Keys ready from earlier steps are untouched.
Rollback (group ``load_failures_rollback``) Rewinding ``num_computed_tokens`` in place keeps the
         align-mode block table (the recompute's GDN state runs in the null block whenever the
         resume point's chunk has a null state block, shared with every request rolled back in the
         same step), the worker's ``mamba_state_idx``, the connector's RequestTracker and, under async
         scheduling, the placeholders of the step in flight; under ``recompute`` vLLM evicts nothing,
         so a later local hit is served the invalid blocks and those computed from them. Instead,
         after the rollback point is found, the request's blocks from there on are evicted from the
         prefix cache and the request is preempted (vLLM's own reset; it resumes from its local hits
         and never asks the pool again: ``load_fail_no_reload`` -- a store that keeps failing would
         otherwise preempt it at every resume); in-flight frames are discarded as ``reset_prefix_cache`` does, counting only the
         steps scheduled after the failed one (``AsyncScheduler._update_after_schedule`` records them,
         with the block table each step saw: align mode may free the loaded state block before the
         failed step's output is handled). vllm-ascend's pool scheduler dropped (and then raised on) a
         request preempted outside ``schedule()`` and resumed by the next one: kept.
Removal  When vLLM's invalid-block handling reads every KV cache group and vllm-ascend reports
         failed layerwise loads itself (detected per half: the scheduler spec skips itself when
         ``_update_requests_with_invalid_blocks`` no longer unpacks one group; the worker specs
         when the receiving thread reports invalid blocks).
"""

from __future__ import annotations

import functools
import importlib
import threading
import time

from ... import pool_events
from ...host import logger
from .._targets import STORE
from .._checks import PatchSpec
from .._checks import expects as _expects
from .._checks import source as _source

VLLM = ">=0.25.0,<0.26"
VLLM_ASCEND = ">=0.25.1,<0.26"
GROUP = "load_failures"
POLICY_GROUP = "load_failures_policy"  # the platform's config check: imported long before the rest
ROLLBACK_GROUP = "load_failures_rollback"  # recompute = evict + preempt (own group: own switch)
SAVES_GROUP = "load_failures_saves"  # a failed step's saves are finished failed (own group: own switch)
WAIT_S = 10.0  # upstream's wait_for_layer_load timeout (checked in its source)
RISK = "failed or late layerwise loads are computed on without telling vLLM (wrong tokens, silently)"

_FAILED_COPY = "_ascend_layerwise_patch_failed_copy"  # thread: result of the copy being handled
_RECV = "_ascend_layerwise_patch_recv"  # thread: _Recv
_STEP = "_ascend_layerwise_patch_load_step"  # worker: _Step
_TAINTED = "_ascend_layerwise_patch_tainted"  # worker: req ids computing on a failed load until preempted
_FRAMES = "_ascend_layerwise_patch_frames"  # request: [(a step's num_scheduled_tokens, frames it samples)]
#: request: its pool load failed once; it resumes from local hits and recomputes, never loads again
_NO_RELOAD = "_ascend_layerwise_patch_no_reload"
_POISONED = "_ascend_layerwise_patch_load_failed"  # a step's ReqMeta: its load failed, drop its saves
DROPPED = -1  #: the write result a save of a failed-load request is finished with (non-zero: failed)


class _Recv:
    """What the receiving thread tells the worker: blocks of failed copies, and whether it is busy."""

    __slots__ = ("lock", "failed", "busy")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.failed: set[int] = set()
        self.busy = False

    def take(self) -> set[int]:
        with self.lock:
            failed, self.failed = self.failed, set()
        return failed


class _Step:
    """The worker's view of this step's loads."""

    __slots__ = ("blocks", "req_ids", "keys", "late", "metas", "req_blocks")

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.req_ids: set[str] = set()
        self.keys: list[str] = []
        self.late = False  # a wait timed out; the receiving thread may still run an old copy
        self.metas: dict[str, list] = {}  # req id -> this step's ReqMeta(s) (its saves are read from them)
        self.req_blocks: dict[str, set[int]] = {}  # req id -> blocks its loads write


def _recv(thread) -> _Recv:
    state = thread.__dict__.get(_RECV)
    if state is None:
        state = thread.__dict__.setdefault(_RECV, _Recv())
    return state


def _task_blocks(task) -> set[int]:
    """The blocks a load task writes (never the null block, which vLLM never counts as computed)."""
    shared = task.shared_block_data
    return set() if shared is None else {int(b) for b in shared.block_ids_arr} - {0}


# ------------------------------------------------------------------------------- receiving thread
def make_batch_copy(original):
    @functools.wraps(original)
    def _batch_copy_with_limits(self, gvas, addrs, sizes, direction, max_transfer_blocks, max_transfer_bytes):
        try:
            res = original(self, gvas, addrs, sizes, direction, max_transfer_blocks, max_transfer_bytes)
        except Exception as exc:  # noqa: BLE001 - a raising store is a failed copy
            logger().error("ascend_layerwise_patch: layerwise load batch_copy raised %r; reported as failed", exc)
            res = -1
            pool_events.bump("load_raised")
        else:
            if res != 0:
                pool_events.bump("load_failed")
        if res != 0:
            self.__dict__[_FAILED_COPY] = res
        return res

    return _batch_copy_with_limits


def make_recv_handle(original):
    @functools.wraps(original)
    def _handle_request(self, data):
        state = _recv(self)
        blocks = set().union(*(_task_blocks(t) for t in data.transfer_tasks))  # before the thread clears them
        self.__dict__.pop(_FAILED_COPY, None)
        state.busy = True
        try:
            return original(self, data)
        finally:
            if self.__dict__.pop(_FAILED_COPY, None) is not None and blocks:
                with state.lock:
                    state.failed |= blocks
            state.busy = False

    return _handle_request


def make_send_handle(original):
    """The layer sending thread: at the step's final layer (where upstream finishes every save key
    with ``write_results.get(key, 0) or res``), the save keys of requests whose load failed this
    step get a failed result first, so they are finished as failed, never ready. In the thread
    itself, before upstream's finish: no race with its own ``write_results`` updates."""

    @functools.wraps(original)
    def _handle_request(self, transfer_tasks):
        if isinstance(transfer_tasks, list) and transfer_tasks:
            first = transfer_tasks[0]
            if getattr(first, "layer_id", None) == self.final_layer_id:
                dropped: dict[str, None] = {}
                for task in transfer_tasks:
                    for rng in getattr(task, "block_ranges", ()):
                        meta = rng.request
                        if meta.__dict__.get(_POISONED) and meta.save_keys:
                            dropped.update(dict.fromkeys(meta.save_keys))
                if dropped:
                    results = self.write_results
                    for key in dropped:
                        if not results.get(key):
                            results[key] = DROPPED
                    pool_events.bump("pool_keys_failed", len(dropped))
                    logger().warning(
                        "ascend_layerwise_patch: %d pool key(s) saved in a step whose layerwise load failed "
                        "are finished as failed (not published)",
                        len(dropped),
                    )
        return original(self, transfer_tasks)

    return _handle_request


# ----------------------------------------------------------------------------------------- worker
def _report(worker, blocks: set[int]) -> None:
    if blocks:
        with worker._invalid_block_ids_lock:
            worker._invalid_block_ids.update(blocks)
        _drop_saves(worker, blocks)


def _drop_saves(worker, blocks: set[int]) -> None:
    """The requests whose loads wrote ``blocks`` compute this step on state that was never loaded:
    mark their ReqMeta s, so that the sending thread finishes the step's save keys of those
    requests as failed (:func:`make_send_handle`) instead of publishing them as ready. Runs in
    ``wait_for_layer_load``, before the step's final layer is queued for saving."""
    step = worker.__dict__.get(_STEP)
    if step is None:
        return
    for req_id, loaded in step.req_blocks.items():
        if loaded & blocks:
            for meta in step.metas.get(req_id, ()):
                meta.__dict__[_POISONED] = True
            # under async scheduling the next step is already scheduled on this state: taint the
            # request until the scheduler's preemption of it reaches this worker (make_start_load_kv)
            worker.__dict__.setdefault(_TAINTED, set()).add(req_id)


def make_start_load_kv(original):
    """A request whose load failed keeps computing on the unloaded state in every step scheduled
    before the scheduler rolled it back (async scheduling: the next step is in flight): its saves
    there are dropped too, until its preemption (``load_failures_rollback``) or end reaches the worker."""

    @functools.wraps(original)
    def start_load_kv(self, metadata):
        tainted = self.__dict__.get(_TAINTED)
        if tainted:
            tainted -= set(getattr(metadata, "preempted_req_ids", None) or ())
            unfinished = getattr(metadata, "unfinished_request_ids", None)
            if unfinished is not None:
                tainted &= set(unfinished)
            for meta in getattr(metadata, "requests", ()):
                if meta.req_id in tainted:
                    meta.__dict__[_POISONED] = True
        return original(self, metadata)

    return start_load_kv


def _begin_step(worker) -> _Step:
    """First wait of a step (nothing submitted yet): note what the step's loads cover, and report
    the blocks no copy will write (their GVA lookup or lease failed before the copy)."""
    old = worker.__dict__.get(_STEP)
    step = _Step()
    step.late = old is not None and old.late
    worker.__dict__[_STEP] = step
    recv = worker.kv_recv_thread
    builders = getattr(recv, "group_builders", None)
    unloadable: set[int] = set()
    for tasks in worker.layer_load_tasks:
        for task in tasks:
            copied = _task_blocks(task)
            step.blocks |= copied
            if task.shared_block_data is not None:
                step.keys.extend(task.shared_block_data.load_keys)
            builder = builders[task.group_id] if builders else recv.layer_batch_builder
            for rng in task.block_ranges:
                req_id = rng.request.req_id
                step.req_ids.add(req_id)
                metas = step.metas.setdefault(req_id, [])
                if all(m is not rng.request for m in metas):
                    metas.append(rng.request)
                block_ids, _gvas = builder._require_request_arrays(rng, is_save=False)
                wanted = {int(b) for b in block_ids[rng.start_block : rng.end_block]}
                if rng.partial_block_index is not None:
                    wanted.add(int(block_ids[rng.partial_block_index]))
                step.req_blocks.setdefault(req_id, set()).update(wanted - {0})
                unloadable |= wanted - copied - {0}
    step.keys = list(dict.fromkeys(step.keys))
    step.blocks |= unloadable
    if unloadable:
        logger().warning(
            "ascend_layerwise_patch: layerwise load of requests %s has blocks no copy will write %s; "
            "reported to the scheduler", sorted(step.req_ids), sorted(unloadable)
        )
    _report(worker, unloadable)
    return step


def _abandon(worker, step: _Step) -> None:
    """Report every block of this step's loads, stop the ones still queued, release their leases."""
    _report(worker, step.blocks)
    for tasks in worker.layer_load_tasks:
        tasks.clear()  # a queued LayerLoadTask holding this list now finds nothing to copy
    worker.layer_load_tasks = [[] for _ in range(worker.num_layers)]  # the thread keeps the old lists
    if step.keys:
        worker.m_store.batch_remove_lease(step.keys)
    step.blocks, step.keys = set(), []
    step.late = True


def make_wait(original):
    names = original.__globals__

    @functools.wraps(original)
    def wait_for_layer_load(self):
        if not self.use_gva_layerwise or self.kv_recv_thread is None:
            return original(self)  # Mooncake's key-based layerwise path: not this patch's
        if self.current_layer >= self.num_layers:
            return
        recv = self.kv_recv_thread
        state = _recv(recv)
        if self.next_layer_to_submit == 0 and self.current_layer == 0:
            step = _begin_step(self)
            if step.late:
                if recv.request_queue.empty() and not state.busy:
                    for event in self.layer_load_finished_events:
                        event.clear()  # sets left by late or abandoned loads of earlier steps
                    state.take()  # already reported with their step
                    step.late = False
                elif step.blocks:
                    logger().warning(
                        "ascend_layerwise_patch: layerwise loads of requests %s not attempted: a timed-out "
                        "load of an earlier step still occupies the receiving thread; reported to the scheduler",
                        sorted(step.req_ids),
                    )
                    _abandon(self, step)
        step = self.__dict__[_STEP]
        if step.late:
            return  # this step's loads were abandoned (or never attempted): nothing to wait for
        layer = self.current_layer
        names["reset_attention_compute_start_gate"]()
        self._submit_ready_layer_loads()
        event = self.layer_load_finished_events[layer]
        if not self.layer_load_tasks[layer]:
            event.clear()
            _report(self, state.take())
            return
        if event.wait(timeout=WAIT_S):
            event.clear()
            _report(self, state.take())
            return
        pool_events.bump("load_late")
        logger().warning(
            "ascend_layerwise_patch: layerwise load of layer %d timed out after %.0f s (requests %s); "
            "the step's loads are reported to the scheduler and the rest of them abandoned",
            layer,
            WAIT_S,
            sorted(step.req_ids),
        )
        _report(self, state.take())
        _abandon(self, step)

    return wait_for_layer_load


# -------------------------------------------------------------------------------------- scheduler
def _resume_point(specs, block_ids, invalid: set[int], computed: int, mamba_cls) -> int | None:
    """Tokens every group can resume from when some of ``computed`` tokens sit in invalid blocks;
    ``None`` if none of them does."""
    bound, affected = computed, False
    for spec, ids in zip(specs, block_ids):
        size = spec.block_size
        for idx, block in enumerate(ids[: -(-computed // size)]):
            if block in invalid:  # it, and everything computed from it, must be recomputed
                affected = True
                bound = min(bound, idx * size)
                break
    if not affected:
        return None
    mamba = [(spec.block_size, ids) for spec, ids in zip(specs, block_ids) if isinstance(spec, mamba_cls)]
    step = 1
    for spec in specs:
        step = step * spec.block_size // _gcd(step, spec.block_size)
    point = bound // step * step
    while point > 0:
        if all(_state_ok(ids, point // size - 1, invalid) for size, ids in mamba):
            return point
        point -= step
    return 0


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _state_ok(ids, idx: int, invalid: set[int]) -> bool:
    return idx < len(ids) and ids[idx] != 0 and ids[idx] not in invalid


def make_update_invalid(original):
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    mamba_cls = interface.MambaSpec

    def _group_spec(group):
        spec = group.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        return next(iter(inner.values())) if inner else spec

    @functools.wraps(original)
    def _update_requests_with_invalid_blocks(
        self, requests, invalid_block_ids, num_scheduled_tokens, evict_blocks=True
    ):
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) <= 1:
            return original(self, requests, invalid_block_ids, num_scheduled_tokens, evict_blocks)
        specs = [_group_spec(g) for g in groups]
        affected: set[str] = set()
        total = 0
        evict: set[int] = set()
        for request in requests:
            req_id = request.request_id
            block_ids = self.kv_cache_manager.get_block_ids(req_id)
            computed = request.num_computed_tokens - num_scheduled_tokens.get(req_id, 0)
            recorded = _as_scheduled(request, num_scheduled_tokens)  # async: as the failed step saw it
            if recorded is not None:
                computed, block_ids = recorded
            point = _resume_point(specs, block_ids, invalid_block_ids, computed, mamba_cls)
            if point is None:
                continue
            request.num_computed_tokens = point
            total += computed - point
            affected.add(req_id)
            if evict_blocks:
                for spec, ids in zip(specs, block_ids):
                    evict.update(b for b in ids[point // spec.block_size :] if b != 0)
        return affected, total, evict

    return _update_requests_with_invalid_blocks


def make_handle_invalid(original):
    """Under ``recompute``, a hybrid request rolled back by a load failure is preempted (after its
    blocks from the rollback point on, in every group, are evicted from the prefix cache) instead of
    only having ``num_computed_tokens`` rewound in place.

    Rewinding in place keeps the request's align-mode block table (its older mamba states are null
    blocks, so a recompute over more than one chunk runs its GDN state in the null block, shared by
    every other request rolled back in the same step), the worker's ``mamba_state_idx``, the
    connector's request tracker, and -- under async scheduling -- the output placeholders of the
    step already in flight. vLLM's preemption resets all of those; resumption schedules the request
    again from its local and pool hits. In-flight output frames are discarded the way vLLM's own
    force-preemption (``reset_prefix_cache``) discards them: ``async_tokens_to_discard``.
    Under ``recompute`` vLLM evicts nothing, so without the eviction the invalid blocks, and those
    computed from them, stay cached and a later request with that prefix (or the resumed one) is
    served them by a local hit."""
    status = importlib.import_module("vllm.v1.request").RequestStatus

    @functools.wraps(original)
    def _handle_invalid_blocks(self, invalid_block_ids, num_scheduled_tokens):
        before = {r.request_id: r.num_computed_tokens for r in self.running}  # only called on a failed load
        failed = original(self, invalid_block_ids, num_scheduled_tokens)
        groups = self.kv_cache_config.kv_cache_groups
        if not failed or not self.recompute_kv_load_failures or len(groups) <= 1:
            return failed
        rolled = [r for r in self.running if r.request_id in failed and r.status == status.RUNNING]
        if not rolled:
            return failed
        manager = self.kv_cache_manager
        evict: set[int] = set()
        points = {}
        for request in rolled:
            # where _update_requests_with_invalid_blocks rolled it back to
            point = points[request.request_id] = request.num_computed_tokens
            tables = [manager.get_block_ids(request.request_id)]
            recorded = _as_scheduled(request, num_scheduled_tokens)
            if recorded is not None:  # async: blocks the failed step held that align mode freed since
                tables.append(recorded[1])
            for table in tables:
                for group, ids in zip(groups, table):
                    size = group.kv_cache_spec.block_size
                    evict.update(b for b in ids[point // size :] if b)
        if evict:
            manager.evict_blocks(evict)
        now = time.monotonic()
        for request in rolled:
            request.__dict__[_NO_RELOAD] = True  # recompute: the resume must not load the failed range again
            in_flight = _frames_after(request, num_scheduled_tokens)
            self.running.remove(request)
            self._preempt_request(request, now)
            request.async_tokens_to_discard += in_flight
            request.num_output_placeholders = 0
        pool_events.bump("requests_rolled_back", len(rolled))
        pool_events.bump("tokens_recomputed", sum(before.get(r.request_id, 0) - points[r.request_id] for r in rolled))
        logger().warning(
            "ascend_layerwise_patch: request(s) %s preempted after a failed KV load (recompute); %d block(s) "
            "evicted from the prefix cache",
            sorted(r.request_id for r in rolled),
            len(evict),
        )
        return failed

    return _handle_invalid_blocks


def make_no_reload(original):
    """A request preempted after a failed pool load resumes without asking the pool again: under
    ``recompute`` it recomputes what it could not load, as vLLM's in-place rollback does (a running
    request never asks its connector again). Asking again would load the same keys: a store that
    keeps failing or stays slower than the wait would preempt it at every resume, for ever."""

    @functools.wraps(original)
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.__dict__.get(_NO_RELOAD):
            return 0, False
        return original(self, request, num_computed_tokens)

    return get_num_new_matched_tokens


def _frames_after(request, num_scheduled_tokens) -> int:
    """Output frames of ``request`` still in flight after the step being updated (the one whose
    ``num_scheduled_tokens`` this is): those of the steps scheduled after it. That step's own frame
    is not among them: update_from_output skips a failed request, so its placeholder is never
    counted down -- discarding ``num_output_placeholders`` frames would drop a good token later.
    Without a record of the step (sync scheduling: no placeholders), the placeholders."""
    log = request.__dict__.get(_FRAMES) or []
    for i, entry in enumerate(log):
        if entry[0] is num_scheduled_tokens:
            return sum(later[1] for later in log[i + 1 :])
    return request.num_output_placeholders


def _as_scheduled(request, num_scheduled_tokens):
    """(tokens computed before, block ids) of ``request`` when the step being updated was scheduled,
    if recorded (async scheduling: a later step may have advanced it since, and align mode may have
    freed the mamba state block the failed load wrote); else None."""
    for entry in request.__dict__.get(_FRAMES) or ():
        if entry[0] is num_scheduled_tokens:
            return None if entry[3] is None else (entry[2], entry[3])
    return None


def make_async_after_schedule(original):
    """AsyncScheduler: note, per request, each scheduled step and the output frames it adds
    (the placeholders), so that a rollback knows which of them are still in flight."""

    @functools.wraps(original)
    def _update_after_schedule(self, scheduler_output):
        before = {
            r: (self.requests[r].num_output_placeholders, self.requests[r].num_computed_tokens)
            for r in scheduler_output.num_scheduled_tokens
        }
        result = original(self, scheduler_output)
        # only a new or resumed request loads from the pool: only their block tables are kept
        loading = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        loading.update(getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None) or ())
        for req_id, (was, start) in before.items():
            request = self.requests[req_id]
            log = request.__dict__.setdefault(_FRAMES, [])
            blocks = None
            if req_id in loading:
                blocks = tuple(list(ids) for ids in self.kv_cache_manager.get_block_ids(req_id))
            log.append((scheduler_output.num_scheduled_tokens, request.num_output_placeholders - was, start, blocks))
            del log[:-4]  # at most the batch queue's depth is ever in flight
        return result

    return _update_after_schedule


def make_build_meta(original):
    """vllm-ascend's pool scheduler handles ``preempted_req_ids`` after ``schedule()`` already
    resumed the request (``update_state_after_alloc``): it drops the entry the resume just made and
    then raises ("not in _unfinished_requests") on the resumed request. vLLM resumes in the next
    ``schedule()`` a request preempted outside it (the rollback above, ``reset_prefix_cache``). For
    those requests the preemption's cleanup runs here, before the original, keeping that entry; the
    metadata still carries every preempted id to the workers."""

    @functools.wraps(original)
    def build_connector_meta(self, scheduler_output):
        preempted = scheduler_output.preempted_req_ids
        resumed = getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None) or ()
        both = {r for r in (preempted or ()) if r in resumed and r in self._unfinished_requests}
        if not both:
            return original(self, scheduler_output)
        for req_id in both:  # upstream's preempted cleanup, minus dropping the resumed entry
            self._preempted_req_ids.add(req_id)
            self._request_trackers.pop(req_id, None)
            self._loading_req_ids.discard(req_id)
            self._delayed_free_req_ids.discard(req_id)
        scheduler_output.preempted_req_ids = type(preempted)(r for r in preempted if r not in both)
        try:
            meta = original(self, scheduler_output)
        finally:
            scheduler_output.preempted_req_ids = preempted
        if getattr(meta, "preempted_req_ids", None) is not None:
            meta.preempted_req_ids = preempted
        return meta

    return build_connector_meta


def make_policy_check(original, context):
    """vllm-ascend's platform refuses ``kv_load_failure_policy=recompute`` for hybrid models (the
    scheduler could not roll them back); with ``load_failures`` in force it can: applied in this
    process, or waiting for its modules (not skipped, not failed), read from the registry's
    ``context``. The platform's config check runs long before the scheduler and pool modules are
    imported, which is why the refusal is lifted by its own group, coupled through this. Installed
    as a plain function: vllm-ascend calls it through the class (``cls._validate_...``)."""
    check = original.__func__

    @functools.wraps(check)
    def _validate_kv_load_failure_policy(vllm_config):
        kv = vllm_config.kv_transfer_config
        if kv is not None and getattr(kv, "kv_load_failure_policy", "fail") == "recompute":
            if getattr(vllm_config.model_config, "is_hybrid", False) and context.in_force(GROUP):
                return None  # load_failures rolls hybrid requests back
        return check(vllm_config)

    return _validate_kv_load_failure_policy


# ----------------------------------------------------------------------------- checks on targets
def _upstream_reports(_original) -> str | None:
    kv_transfer = importlib.import_module(f"{STORE}.kv_transfer")
    source = _source(kv_transfer.KVCacheStoreLayerRecvingThread._handle_request)
    if "invalid_block" in source or "raise RuntimeError" in source:
        return "KVCacheStoreLayerRecvingThread reports (or raises on) failed loads itself"
    return None


def _upstream_hybrid(original) -> str | None:
    if "(req_block_ids,) =" not in _source(original):
        return "Scheduler._update_requests_with_invalid_blocks no longer unpacks a single KV cache group"
    return None


def _wait_ok(original) -> str | None:
    problem = _expects(
        ["self"],
        needs=(
            "layer_load_finished_events",
            "_submit_ready_layer_loads",
            "reset_attention_compute_start_gate",
            "timeout=10",
        ),
        globals_=("reset_attention_compute_start_gate",),
    )(original)
    if problem:
        return problem
    worker = original.__globals__["KVPoolWorker"]
    for name in ("_invalid_block_ids_lock", "layer_load_tasks", "next_layer_to_submit"):
        if name not in _source(worker):
            return f"KVPoolWorker no longer has {name}"
    return None


def _recv_ok(original) -> str | None:
    problem = _expects(["self", "data"], needs=("transfer_tasks", "_batch_copy_with_limits", "task_done"))(original)
    if problem:
        return problem
    builder = importlib.import_module(f"{STORE}.kv_transfer").LayerBatchBuilder
    if not callable(getattr(builder, "_require_request_arrays", None)):
        return "LayerBatchBuilder._require_request_arrays is gone"
    return None


def _send_ok(original) -> str | None:
    problem = _expects(
        ["self", "transfer_tasks"],
        needs=("write_results.get(key, 0) or res", "final_layer_id", "batch_write_finish", "save_keys"),
    )(original)
    if problem:
        return problem
    fields = getattr(importlib.import_module(f"{STORE}.config_data").ReqMeta, "__annotations__", {})
    if "save_keys" not in fields:
        return "ReqMeta no longer has save_keys"
    return None


def _upstream_drops_saves(original) -> str | None:
    if "invalid_block" in _source(original) or "load_failed" in _source(original):
        return "KVCacheStoreLayerSendingThread drops the saves of failed loads itself"
    return None


def _handle_invalid_ok(original) -> str | None:
    problem = _expects(
        ["self", "invalid_block_ids", "num_scheduled_tokens"],
        needs=("_update_requests_with_invalid_blocks", "recompute_kv_load_failures"),
    )(original)
    if problem:
        return problem
    sched = importlib.import_module("vllm.v1.core.sched.scheduler")
    cls = original.__globals__.get("Scheduler", sched.Scheduler)
    for name in ("_preempt_request", "running", "kv_cache_manager"):
        if name not in _source(cls):
            return f"Scheduler no longer has {name}"
    if "async_tokens_to_discard" not in _source(importlib.import_module("vllm.v1.request").Request):
        return "Request no longer has async_tokens_to_discard"
    if not callable(getattr(importlib.import_module("vllm.v1.core.kv_cache_manager").KVCacheManager, "evict_blocks", None)):
        return "KVCacheManager.evict_blocks is gone"
    return None


def _build_meta_ok(original) -> str | None:
    return _expects(
        ["self", "scheduler_output"],
        needs=(
            "for req_id in scheduler_output.preempted_req_ids",
            "self._unfinished_requests.pop(req_id, None)",
            "_preempted_req_ids",
            "_request_trackers",
            "_loading_req_ids",
            "_delayed_free_req_ids",
        ),
    )(original)


def _upstream_keeps_resumed(original) -> str | None:
    if "resumed_req_ids" in _source(original):
        return "KVPoolScheduler.build_connector_meta tells a preempted request from a resumed one itself"
    return None


def _upstream_preempts_frames(_original) -> str | None:
    return _upstream_preempts(importlib.import_module("vllm.v1.core.sched.scheduler").Scheduler._handle_invalid_blocks)


def _upstream_drops_later_saves(_original) -> str | None:
    thread = importlib.import_module(f"{STORE}.kv_transfer").KVCacheStoreLayerSendingThread
    return _upstream_drops_saves(vars(thread)["_handle_request"])


def _upstream_preempts(original) -> str | None:
    if "_preempt_request" in _source(original):
        return "Scheduler._handle_invalid_blocks preempts the affected requests itself"
    return None


def _policy_ok(original) -> str | None:
    func = getattr(original, "__func__", None)
    if not isinstance(original, staticmethod) or func is None:
        return "NPUPlatform._validate_kv_load_failure_policy is no longer a staticmethod"
    import inspect

    if list(inspect.signature(func).parameters) != ["vllm_config"]:
        return "NPUPlatform._validate_kv_load_failure_policy parameters changed"
    platform = func.__globals__.get("NPUPlatform")
    if platform is None or "cls._validate_kv_load_failure_policy(" not in _source(platform.check_and_update_config):
        return "NPUPlatform.check_and_update_config no longer calls it through the class"
    return None


def _upstream_allows_hybrid(original) -> str | None:
    func = getattr(original, "__func__", original)
    if "is_hybrid" not in _source(func):
        return "vllm-ascend no longer refuses recompute for hybrid models"
    return None



_WHY = (
    "failed, raised or timed-out layerwise loads are reported to vLLM's invalid-block handling, "
    "which handles hybrid (multi-group) requests"
)


def _spec(
    name: str, target: str, factory, precondition, fixed=_upstream_reports, group=GROUP, aliases=(), why=_WHY, risk=RISK, context=False, after=()
) -> PatchSpec:
    return PatchSpec(
        name=name,
        group=group,
        target=target,
        aliases=aliases,
        factory=factory,
        why=why,
        vllm=VLLM,
        vllm_ascend=VLLM_ASCEND,
        precondition=precondition,
        risk=risk,
        fixed_upstream=fixed,
        context=context,
        after=after,
    )


_INVALID = ["self", "requests", "invalid_block_ids", "num_scheduled_tokens", "evict_blocks"]
_COPY = ["self", "gvas", "addrs", "sizes", "direction", "max_transfer_blocks", "max_transfer_bytes"]

SPECS = (
    _spec(
        "load_fail_copy",
        f"{STORE}.pool_worker:KVCacheStoreLayerRecvingThread._batch_copy_with_limits",
        make_batch_copy,
        _expects(_COPY, needs=("batch_copy",)),
    ),
    _spec(
        "load_fail_thread",
        f"{STORE}.pool_worker:KVCacheStoreLayerRecvingThread._handle_request",
        make_recv_handle,
        _recv_ok,
    ),
    _spec(
        "load_fail_drop_saves",
        f"{STORE}.pool_worker:KVCacheStoreLayerSendingThread._handle_request",
        make_send_handle,
        _send_ok,
        fixed=_upstream_drops_saves,
        group=SAVES_GROUP,
        why="the pool keys a request saves in a step whose layerwise load failed are finished as failed, never ready",
        risk="keys computed from unloaded state are published as ready: every later pool hit reads them",
        after=("mamba_thread_marker",),  # mamba_lifetime's wrapper of this target is applied first
    ),
    _spec(
        "load_fail_drop_later_saves",
        f"{STORE}.pool_worker:KVPoolWorker.start_load_kv",
        make_start_load_kv,
        _expects(["self", "metadata"], needs=("process_layer_data",)),
        fixed=_upstream_drops_later_saves,
        group=SAVES_GROUP,
        why="a request whose load failed saves nothing until its rollback reaches the worker (async scheduling)",
        risk="keys computed from unloaded state in the step after the failure are published as ready",
        after=("mamba_worker_events",),  # mamba_lifetime's wrapper of this target is applied first
    ),
    _spec("load_fail_wait", f"{STORE}.pool_worker:KVPoolWorker.wait_for_layer_load", make_wait, _wait_ok),
    _spec(
        "load_fail_policy",
        "vllm_ascend.platform:NPUPlatform._validate_kv_load_failure_policy",
        make_policy_check,
        _policy_ok,
        fixed=_upstream_allows_hybrid,
        group=POLICY_GROUP,
        context=True,
    ),
    _spec(
        "load_fail_rollback",
        "vllm.v1.core.sched.scheduler:Scheduler._handle_invalid_blocks",
        make_handle_invalid,
        _handle_invalid_ok,
        fixed=_upstream_preempts,
        group=ROLLBACK_GROUP,
        aliases=("vllm.v1.core.sched.scheduler:Scheduler.__base__._handle_invalid_blocks",),
        why="a hybrid request rolled back after a failed KV load is preempted (its blocks from the rollback "
        "point evicted from the prefix cache) instead of rewound in place",
        risk="a rolled-back hybrid request runs its GDN state in the null block; invalid blocks stay cached",
    ),
    _spec(
        "load_fail_rollback_frames",
        "vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_after_schedule",
        make_async_after_schedule,
        _expects(["self", "scheduler_output"], needs=("num_output_placeholders",)),
        fixed=_upstream_preempts_frames,
        group=ROLLBACK_GROUP,
        why="the rollback knows how many output frames of a failed request are still in flight",
        risk="under async scheduling a token computed on a failed load is delivered, or a good one dropped",
    ),
    _spec(
        "load_fail_resume_meta",
        f"{STORE}.pool_scheduler:KVPoolScheduler.build_connector_meta",
        make_build_meta,
        _build_meta_ok,
        fixed=_upstream_keeps_resumed,
        group=ROLLBACK_GROUP,
        why="a request preempted outside schedule() and resumed by the next one keeps its pool-scheduler state",
        risk="the pool scheduler raises on a request preempted after a failed load and resumed",
        after=("send_shedding",),  # mamba_lifetime's wrapper of this target is applied first
    ),
    # after load_fail_rollback_frames: a group resolves its targets in this order, importing their
    # modules, and production imports vLLM's async_scheduler before vllm-ascend's pool_scheduler (the
    # connector is built inside the scheduler); the other order changes what the harness's async run
    # computes (found here; see the closing note of issue 21's follow-up)
    _spec(
        "load_fail_no_reload",
        f"{STORE}.pool_scheduler:KVPoolScheduler.get_num_new_matched_tokens",
        make_no_reload,
        _expects(["self", "request", "num_computed_tokens"], needs=("_get_layerwise_gva_hit_tokens",)),
        fixed=_upstream_preempts_frames,
        group=ROLLBACK_GROUP,
        why="a request preempted after a failed pool load resumes from local hits and recomputes (never reloads)",
        risk="a store that keeps failing preempts the same request at every resume, for ever",
    ),
    _spec(
        "load_fail_scheduler",
        "vllm.v1.core.sched.scheduler:Scheduler._update_requests_with_invalid_blocks",
        make_update_invalid,
        _expects(_INVALID, needs=("get_block_ids",)),
        fixed=_upstream_hybrid,
        # vllm-ascend's patch_balance_schedule rebinds the module's ``Scheduler`` to its subclass;
        # after that the target names the subclass, and this alias the base class every other
        # scheduler (AsyncScheduler, vllm-ascend's own) inherits the method from.
        aliases=("vllm.v1.core.sched.scheduler:Scheduler.__base__._update_requests_with_invalid_blocks",),
    ),
)
