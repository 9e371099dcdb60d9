"""The scheduler half of a failed pool load under ``recompute``, shared by vLLM 0.25's
(``load_failures_rollback``) and vLLM 0.30's (``pool_load_recovery``): what the two releases do
alike is here once; each group passes what its release needs differently, named at each parameter.

A hybrid request vLLM rolled back in place after a failed load is preempted instead (its blocks
evicted from the prefix cache first), marked so that it never loads from the pool again
(:func:`make_no_reload`); vllm-ascend's pool scheduler, which would raise on a request preempted
outside ``schedule()`` and resumed by the next one, keeps its state (:func:`make_build_meta`).
On the worker side, both releases' TP ranks agree on which requests' loads failed on any rank
(:func:`tp_agree`, issue 32). Not a group: it declares no patch and imports no group package (group packages import it).
"""

from __future__ import annotations

import functools
import importlib
import os
import time
from collections.abc import Callable, Iterable

from .. import pool_events
from ..host import logger
from ._checks import Counts, expects, source


def handle_invalid_ok(original, release_problem: Callable[[object], str | None]) -> str | None:
    """What both rollbacks need of vLLM's ``Scheduler._handle_invalid_blocks`` (its parameters, its
    in-place rollback, the ``recompute`` switch) and of the prefix cache (``evict_blocks``); between
    the two, ``release_problem(original)``: what the release's rewind and preemption must look like."""
    problem = expects(
        ["self", "invalid_block_ids", "num_scheduled_tokens"],
        needs=("_update_requests_with_invalid_blocks", "recompute_kv_load_failures"),
    )(original) or release_problem(original)
    if problem:
        return problem
    if not callable(getattr(importlib.import_module("vllm.v1.core.kv_cache_manager").KVCacheManager, "evict_blocks", None)):
        return "KVCacheManager.evict_blocks is gone"
    pool = importlib.import_module("vllm.v1.core.block_pool").BlockPool
    if "self.blocks" not in source(pool.__init__):
        return "BlockPool no longer keeps its blocks in .blocks"  # sharing_requests reads them
    return None


def make_handle_invalid(
    original,
    *,
    mark: str,
    computed_before: Callable[[object, dict], int],
    evicted: Callable[[object, list, dict, dict], set],
    preempt: Callable[[object, object, float, dict], None],
    message: str,
    counts: Counts | None = None,
):
    """``Scheduler._handle_invalid_blocks`` after vLLM's own handling: under ``recompute``, every
    multi-group request it rolled back in place (still running) is preempted instead, after the
    blocks ``evicted`` names are evicted from the prefix cache; each is marked with ``mark``.

    What differs by release:
    ``computed_before(request, num_scheduled_tokens)``: the tokens a request had computed, read
    before vLLM's rollback (``tokens_recomputed`` counts from there down to the rollback point).
    ``evicted(scheduler, rolled, points, num_scheduled_tokens)``: the block ids to evict
    (``points``: each request's rollback point, by id).
    ``preempt(scheduler, request, now, num_scheduled_tokens)``: the preemption, the request already
    out of ``running`` (and its in-flight output dropped).
    ``message``: the WARNING, given the sorted request ids and the number of evicted blocks.
    ``counts``: the group's live counts (``requests_rolled_back``, ``blocks_evicted``), if it keeps any.
    """
    status = importlib.import_module("vllm.v1.request").RequestStatus

    @functools.wraps(original)
    def _handle_invalid_blocks(self, invalid_block_ids, num_scheduled_tokens):
        before = {r.request_id: computed_before(r, num_scheduled_tokens) for r in self.running}  # only called on a failed load
        failed = original(self, invalid_block_ids, num_scheduled_tokens)
        if not failed or not self.recompute_kv_load_failures or len(self.kv_cache_config.kv_cache_groups) <= 1:
            return failed
        rolled = [r for r in self.running if r.request_id in failed and r.status == status.RUNNING]
        if not rolled:
            return failed
        points = {r.request_id: r.num_computed_tokens for r in rolled}  # where vLLM rolled each back to
        evict = evicted(self, rolled, points, num_scheduled_tokens)
        sharing = sharing_requests(self, set(failed), evict)  # read before the eviction drops the hashes
        if evict:
            self.kv_cache_manager.evict_blocks(evict)
        now = time.monotonic()

        def preempt_each(requests, marked: bool) -> list[str]:
            for request in requests:
                if marked:  # recompute: the resume must not load the failed range again
                    request.__dict__[mark] = True
                self.running.remove(request)
                preempt(self, request, now, num_scheduled_tokens)
            if counts is not None:
                counts.add("requests_rolled_back", len(requests))
            pool_events.bump("requests_rolled_back", len(requests))
            return sorted(r.request_id for r in requests)

        ids = preempt_each(rolled, True)
        if counts is not None:
            counts.add("blocks_evicted", len(evict))
        pool_events.bump("tokens_recomputed", sum(before.get(r, 0) - points[r] for r in ids))
        logger().warning(message, ids, len(evict))
        if not sharing:
            return failed
        shared = preempt_each(sharing, False)  # not marked: their own pool hits, if any, did not fail
        pool_events.bump("tokens_recomputed", sum(before.get(r, 0) for r in shared))
        logger().warning(
            "ascend_layerwise_patch: request(s) %s preempted with them: a local prefix hit gave them blocks "
            "the failed load left unloaded or that were computed from it (their output of the steps "
            "scheduled since is dropped)",
            shared,
        )
        return set(failed) | set(shared)  # update_from_output skips their output of this step too

    return _handle_invalid_blocks


def sharing_requests(scheduler, failed: set, evict: set) -> list:
    """Running requests, besides the ``failed`` ones, that hold one of the ``evict`` blocks while it
    is still in the prefix cache: a local hit gave it to them -- scheduled in the failed step's own
    batch, or, under async scheduling, in a step scheduled before the failure reached the scheduler.
    They computed (or are computing) on never-loaded blocks or on blocks computed from them, so they
    go back with the failed requests (issue 32). A block freed by align mode and allocated afresh to
    another request is no longer cached under its old hash until that request fills it; if it did,
    the request is preempted needlessly: time only, on a failure."""
    if not evict:
        return []
    manager = scheduler.kv_cache_manager
    blocks = manager.block_pool.blocks
    cached = {b for b in evict if getattr(blocks[b], "block_hash", None) is not None}
    if not cached:
        return []
    return [
        r
        for r in scheduler.running
        if r.request_id not in failed and any(b in cached for ids in manager.get_block_ids(r.request_id) for b in ids)
    ]


def make_no_reload(original, *, mark: str, counts: Counts | None = None):
    """``KVPoolScheduler.get_num_new_matched_tokens``: a request marked ``mark`` (preempted after a
    failed pool load) resumes without asking the pool again -- it recomputes what it could not
    load, as vLLM's in-place rollback does. Asking again would load the same keys: a store that
    keeps failing would preempt it at every resume. ``counts``: ``reloads_refused``, if kept."""

    @functools.wraps(original)
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.__dict__.get(mark):
            if counts is not None:
                counts.add("reloads_refused")
            return 0, False
        return original(self, request, num_computed_tokens)

    return get_num_new_matched_tokens


def make_build_meta(original, *, forget: Iterable[str], finish: Callable[[object, object, set], None]):
    """``KVPoolScheduler.build_connector_meta``: vllm-ascend's pool scheduler handles
    ``preempted_req_ids`` after ``schedule()`` already resumed the request
    (``update_state_after_alloc``): it drops the entry the resume just made and then raises ("not in
    _unfinished_requests") on the resumed request. vLLM resumes in the next ``schedule()`` a request
    preempted outside it (the rollback above, ``reset_prefix_cache``), so it is both. For those the
    preemption's cleanup runs here, before the original, keeping the resume's entry.

    What differs by release:
    ``forget``: the pool scheduler's sets of request ids its preemption cleanup discards the
    request from (besides ``_preempted_req_ids``, which it joins, and ``_request_trackers``).
    ``finish(meta, preempted, both)``: puts every preempted id back into the metadata for the
    workers (``both``: those preempted and resumed in this step)."""
    forget = tuple(forget)

    @functools.wraps(original)
    def build_connector_meta(self, scheduler_output):
        preempted = scheduler_output.preempted_req_ids
        resumed = getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None) or ()
        both = {r for r in (preempted or ()) if r in resumed and r in self._unfinished_requests}
        if not both:
            return original(self, scheduler_output)
        for req_id in both:  # upstream's cleanup of a preempted request, minus dropping the resumed entry
            self._preempted_req_ids.add(req_id)
            self._request_trackers.pop(req_id, None)
            for name in forget:
                getattr(self, name).discard(req_id)
        scheduler_output.preempted_req_ids = type(preempted)(r for r in preempted if r not in both)
        try:
            meta = original(self, scheduler_output)
        finally:
            scheduler_output.preempted_req_ids = preempted
        finish(meta, preempted, both)
        return meta

    return build_connector_meta


def tp_agree(local: list[bool], timeout_s: float) -> list[bool]:
    """Which requests' loads failed on any rank of this worker's TP group: ``local`` (one flag per
    request of the step, in metadata order, identical on every rank) all-reduced with MAX over the
    TP group's CPU (gloo) group, as one byte per request, bounded by ``timeout_s`` for this one
    operation (``AllreduceOptions.timeout``: vllm-ascend builds that group with torch's 30-minute
    default). ``local`` as is where the process has no TP group or a group of one. Every rank must
    call it at the same point of the same steps (the caller's condition depends on the scheduler
    output only), on its forward thread; a rank that never comes makes the others raise a
    ``RuntimeError`` after ``timeout_s`` (the group is unusable after that: no retry)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    try:
        group = parallel_state.get_tp_group()
    except AssertionError:  # no TP group in this process (a single-process engine that never built one)
        group = None
    if group is None or group.world_size == 1:
        return list(local)
    flags = torch.tensor(local, dtype=torch.uint8)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    opts.timeout = timedelta(seconds=timeout_s)
    try:
        group.cpu_group.allreduce([flags], opts).wait()
    except Exception as exc:  # noqa: BLE001 - gloo's timeout or a peer gone
        rank = getattr(group, "rank_in_group", "?")
        logger().error(
            "ascend_layerwise_patch: TP rank %s: the layerwise load agreement of the TP group did not "
            "complete within %.0f s (a TP rank failed before its final layer?): %s",
            rank,
            timeout_s,
            exc,
        )
        raise RuntimeError(
            f"ascend_layerwise_patch: TP rank {rank}: the TP group's layerwise load agreement did not "
            f"complete within {timeout_s:.0f} s; another TP rank did not reach its final layer"
        ) from exc
    return [bool(f) for f in flags.tolist()]


def agree_ok(save_kv_layer=None) -> str | None:
    """What the agreement needs: the worker's ``save_kv_layer`` (when given) as both release lines
    have it (its final-layer bookkeeping), and what :func:`tp_agree` needs of torch and vLLM."""
    if save_kv_layer is not None:
        problem = expects(
            ["self", "connector_metadata"],
            needs=("current_layer", "num_layers", "layer_save_tasks", "send_thread.add_request"),
        )(save_kv_layer)
        if problem:
            return problem
    dist = importlib.import_module("torch.distributed")
    if "timeout" not in dir(getattr(dist, "AllreduceOptions", object)):
        return "torch.distributed.AllreduceOptions has no per-operation timeout"
    if not callable(getattr(importlib.import_module("vllm.distributed.parallel_state"), "get_tp_group", None)):
        return "vllm.distributed.parallel_state.get_tp_group is gone"
    return None


#: how long a layerwise layer load may take before it is reported failed and its step's loads
#: abandoned (vLLM 0.25's ``load_failures.report`` and 0.30's ``pool_load_recovery.bound``): the
#: 10 s of upstream's wait loop. 0.30's bound reads it here at each wait (tests shorten it here).
WAIT_S = 10.0


#: how long the step after an abandoned load waits for the copy still inside MemCache (the late-copy
#: fence, :func:`late_copy_fence`) before the engine stops; ``ASCEND_LAYERWISE_PATCH_LATE_COPY_S``
LATE_COPY_S = float(os.environ.get("ASCEND_LAYERWISE_PATCH_LATE_COPY_S", "30") or 30)

#: worker: the agreement found a load abandoned after a timed-out wait on some TP rank of the step:
#: every rank passes the late-copy fence at the next step and agrees on its outcome
LATE_ANYWHERE = "_ascend_layerwise_patch_late_anywhere"


def thread_idle(thread) -> bool:
    """The layer receiving thread has no task queued or inside a copy (``task_done`` follows each,
    after the layer's event is set)."""
    q = thread.request_queue
    with q.mutex:
        return q.unfinished_tasks == 0


def late_copy_fence(worker, thread, wake=None) -> float:
    """The late-copy fence, at the start of the step after a layer load was abandoned (on this rank,
    or -- ``LATE_ANYWHERE``, told by the agreement -- on any rank of the TP group), before the step
    computes anything. Returns the seconds waited.

    A copy that was inside MemCache when its wait gave up cannot be recalled: it writes into the
    blocks its load was given. The rollback frees those blocks and vLLM may give them to any request
    from the next schedule on, whose compute writes them first; a copy landing after that overwrites
    them (wrong tokens for a request that never touched the pool). So the step waits here, at most
    ``LATE_COPY_S``, until the receiving thread is idle: every write of the late copy then precedes
    every write of this step and of every later one. Where the agreement told every rank, the ranks
    agree on the outcome over the TP group's CPU group: a copy that never returns stops the engine on
    every rank with the same error, never one rank alone while the others wait in the forward's
    collectives. ``wake``: an event the thread sets when it leaves a copy (else polled)."""
    start = time.monotonic()
    while not thread_idle(thread) and time.monotonic() - start < LATE_COPY_S:
        if wake is not None:
            wake.wait(0.05)
        else:
            time.sleep(0.01)
    stuck = not thread_idle(thread)
    waited = time.monotonic() - start
    if worker.__dict__.pop(LATE_ANYWHERE, False):
        stuck = tp_agree([stuck], LATE_COPY_S + 30.0)[0]  # the same verdict on every rank
    if stuck:
        raise RuntimeError(
            f"ascend_layerwise_patch: a layerwise load copy abandoned after a timed-out wait has not returned "
            f"within {LATE_COPY_S:.0f} s (on this or another TP rank); stopping rather than let it write into KV "
            "cache blocks vLLM has freed and given to other requests (ASCEND_LAYERWISE_PATCH_LATE_COPY_S)"
        )
    if waited > 0.001:
        pool_events.bump("late_copy_fenced")
        logger().warning(
            "ascend_layerwise_patch: the step waited %.2f s for a late layerwise load copy to return before "
            "computing (it would otherwise write into blocks vLLM may have reused)",
            waited,
        )
    return waited


#: a final-layer LayerTransferTask's attribute: the keys its sending thread finishes as failed
DROP_KEYS = "_ascend_layerwise_patch_drop_keys"


def attach_drops(worker, requests, failed: Callable[[object], bool]) -> None:
    """On the forward thread, at the final layer's save: every ``save_keys`` of the step's requests
    for which ``failed(meta)`` holds go on the final layer's first task (:data:`DROP_KEYS`), whatever
    its ``block_ranges`` say (a rank that saves no attention block at TP > KV heads drops too), for
    :func:`make_drop_attached` to finish in the sending thread."""
    drop: dict[str, None] = {}
    for meta in requests:
        if getattr(meta, "save_keys", None) and failed(meta):
            drop.update(dict.fromkeys(meta.save_keys))
    final = worker.layer_save_tasks[worker.num_layers - 1]
    if drop and final:
        final[0].__dict__[DROP_KEYS] = list(drop)


def make_drop_attached(original, *, dropped: int, counts: Counts, drop_key: str = DROP_KEYS):
    """The layer sending thread's ``_handle_request``: the keys the worker attached to a layer's
    first task under ``drop_key`` (:func:`attach_drops`: the agreed failed requests' keys) get the result
    ``dropped`` before upstream's finish (``write_results.get(key, 0) or res`` keeps it), in the
    thread itself: no race with its own ``write_results`` updates. Used by the agreement of both
    release lines (load_failures on 0.25, pool_load_recovery on 0.30)."""

    @functools.wraps(original)
    def _handle_request(self, request):
        if isinstance(request, list) and request:  # a layer's tasks (not a range revoke)
            keys = getattr(request[0], "__dict__", {}).pop(drop_key, None)
            if keys:
                results = self.write_results
                new = [key for key in keys if not results.get(key)]
                for key in new:
                    results[key] = dropped
                if new:
                    counts.add("keys_dropped", len(new))
                    pool_events.bump("pool_keys_failed", len(new))
        return original(self, request)

    return _handle_request
