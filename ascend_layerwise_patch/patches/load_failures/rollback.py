"""Group ``load_failures_rollback``: under ``recompute`` a hybrid request rolled back by a failed
load is preempted (its blocks from the rollback point evicted from the prefix cache), its in-flight
frames discarded, and it never loads from the pool again. The package docstring says why."""

from __future__ import annotations

import functools
import importlib

from .. import _failed_load
from .._checks import (
    build_meta_expects,
    upstream_keeps_resumed,
    upstream_preempts,
    upstream_preempts_any,
)
from .._checks import expects as _expects
from .._checks import source as _source
from .._targets import STORE
from ._common import _FRAMES, _NO_RELOAD, ROLLBACK_GROUP, _as_scheduled


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
    served them by a local hit. The shared part: ``_failed_load.make_handle_invalid``."""
    return _failed_load.make_handle_invalid(
        original,
        mark=_NO_RELOAD,
        # vLLM 0.25 rewinds to the first invalid block of what the request computed, the failed
        # step's tokens included: all of them are recomputed
        computed_before=lambda request, _num_scheduled_tokens: request.num_computed_tokens,
        evicted=_evicted_from_points,
        preempt=_preempt_discarding_frames,
        message="ascend_layerwise_patch: request(s) %s preempted after a failed KV load (recompute); %d block(s) "
        "evicted from the prefix cache",
    )


def _evicted_from_points(scheduler, rolled, points, num_scheduled_tokens) -> set[int]:
    """vLLM 0.25 rewinds a request to a block boundary (its rollback point), not to 0: the blocks
    from there on, in every group, are evicted -- those of the request's table now and, under async
    scheduling, those the failed step held that align mode freed since (``_as_scheduled``)."""
    manager, groups = scheduler.kv_cache_manager, scheduler.kv_cache_config.kv_cache_groups
    evict: set[int] = set()
    for request in rolled:
        point = points[request.request_id]
        tables = [manager.get_block_ids(request.request_id)]
        recorded = _as_scheduled(request, num_scheduled_tokens)
        if recorded is not None:  # async: blocks the failed step held that align mode freed since
            tables.append(recorded[1])
        for table in tables:
            for group, ids in zip(groups, table):
                size = group.kv_cache_spec.block_size
                evict.update(b for b in ids[point // size :] if b)
    return evict


def _preempt_discarding_frames(scheduler, request, now, num_scheduled_tokens) -> None:
    """vLLM 0.25's ``_preempt_request`` has no ``drop_stale_output``: the frames still in flight
    after the failed step are discarded as ``reset_prefix_cache`` discards them."""
    in_flight = _frames_after(request, num_scheduled_tokens)
    scheduler._preempt_request(request, now)
    request.async_tokens_to_discard += in_flight
    request.num_output_placeholders = 0


def make_no_reload(original):
    """A request preempted after a failed pool load resumes without asking the pool again: under
    ``recompute`` it recomputes what it could not load, as vLLM's in-place rollback does (a running
    request never asks its connector again). Asking again would load the same keys: a store that
    keeps failing or stays slower than the wait would preempt it at every resume, for ever."""
    return _failed_load.make_no_reload(original, mark=_NO_RELOAD)


def _frames_after(request, num_scheduled_tokens) -> int:
    """Output frames of ``request`` still in flight after the step being updated (the one whose
    ``num_scheduled_tokens`` this is): one per step scheduled after it for the request. That step's
    own frame is not among them: update_from_output skips a failed request, so its placeholder is
    never counted down. A frame is a step, not a placeholder: under speculative decoding a step
    adds 1 + k placeholders and yields one frame (``_update_request_with_output`` discards one
    frame per call); counting placeholders dropped the good frames after the recovery, and the
    request, never updated again, ran past its max_tokens for ever (found by the pool simulation:
    async scheduling, MTP 3, a failed load). Without a record of the step (sync scheduling: no
    placeholders), the placeholders."""
    log = request.__dict__.get(_FRAMES) or []
    for i, entry in enumerate(log):
        if entry[0] is num_scheduled_tokens:
            return sum(1 for later in log[i + 1 :] if later[1] > 0)
    return request.num_output_placeholders


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
    """vllm-ascend's pool scheduler raises on a request preempted outside ``schedule()`` and resumed
    by the next one (the rollback above, ``reset_prefix_cache``): its preemption's cleanup runs here
    instead, keeping the resume's entry (``_failed_load.make_build_meta``)."""
    # vllm-ascend 0.25.1rc1's cleanup also forgets the request's delayed free
    return _failed_load.make_build_meta(original, forget=("_loading_req_ids", "_delayed_free_req_ids"), finish=_keep_preempted)


def _keep_preempted(meta, preempted, _both) -> None:
    """vllm-ascend 0.25.1rc1's metadata carries the preempted ids (when it has the field): all of them."""
    if getattr(meta, "preempted_req_ids", None) is not None:
        meta.preempted_req_ids = preempted


def _preempts_discarding_frames(original) -> str | None:
    """vLLM 0.25: the scheduler preempts (``_preempt_request``) and a request discards frames in
    flight (``async_tokens_to_discard``)."""
    sched = importlib.import_module("vllm.v1.core.sched.scheduler")
    cls = original.__globals__.get("Scheduler", sched.Scheduler)
    for name in ("_preempt_request", "running", "kv_cache_manager"):
        if name not in _source(cls):
            return f"Scheduler no longer has {name}"
    if "async_tokens_to_discard" not in _source(importlib.import_module("vllm.v1.request").Request):
        return "Request no longer has async_tokens_to_discard"
    return None


def _handle_invalid_ok(original) -> str | None:
    return _failed_load.handle_invalid_ok(original, _preempts_discarding_frames)


SPECS = (
    ROLLBACK_GROUP.spec(
        "load_fail_rollback",
        "vllm.v1.core.sched.scheduler:Scheduler._handle_invalid_blocks",
        make_handle_invalid,
        precondition=_handle_invalid_ok,
        fixed_upstream=upstream_preempts,
        aliases=("vllm.v1.core.sched.scheduler:Scheduler.__base__._handle_invalid_blocks",),
        why="a hybrid request rolled back after a failed KV load is preempted (its blocks from the rollback "
        "point evicted from the prefix cache) instead of rewound in place",
        risk="a rolled-back hybrid request runs its GDN state in the null block; invalid blocks stay cached",
    ),
    ROLLBACK_GROUP.spec(
        "load_fail_rollback_frames",
        "vllm.v1.core.sched.async_scheduler:AsyncScheduler._update_after_schedule",
        make_async_after_schedule,
        precondition=_expects(["self", "scheduler_output"], needs=("num_output_placeholders",)),
        fixed_upstream=upstream_preempts_any,
        why="the rollback knows how many output frames of a failed request are still in flight",
        risk="under async scheduling a token computed on a failed load is delivered, or a good one dropped",
    ),
    ROLLBACK_GROUP.spec(
        "load_fail_resume_meta",
        f"{STORE}.pool_scheduler:KVPoolScheduler.build_connector_meta",
        make_build_meta,
        precondition=build_meta_expects("_delayed_free_req_ids"),
        fixed_upstream=upstream_keeps_resumed,
        why="a request preempted outside schedule() and resumed by the next one keeps its pool-scheduler state",
        risk="the pool scheduler raises on a request preempted after a failed load and resumed",
        after=("send_shedding",),  # mamba_lifetime's wrapper of this target is applied first
    ),
    # after load_fail_rollback_frames: a group resolves its targets in this order, importing their
    # modules, and production imports vLLM's async_scheduler before vllm-ascend's pool_scheduler (the
    # connector is built inside the scheduler); the other order changes what the harness's async run
    # computes (found here; see the closing note of issue 21's follow-up)
    ROLLBACK_GROUP.spec(
        "load_fail_no_reload",
        f"{STORE}.pool_scheduler:KVPoolScheduler.get_num_new_matched_tokens",
        make_no_reload,
        precondition=_expects(["self", "request", "num_computed_tokens"], needs=("_get_layerwise_gva_hit_tokens",)),
        fixed_upstream=upstream_preempts_any,
        why="a request preempted after a failed pool load resumes from local hits and recomputes (never reloads)",
        risk="a store that keeps failing preempts the same request at every resume, for ever",
    ),
)
