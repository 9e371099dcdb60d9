"""Scheduler half of ``pool_load_recovery``: under ``recompute`` a hybrid request vLLM 0.30 rolled
back in place after a failed load is preempted instead, its blocks evicted from the prefix cache,
and it never loads from the pool again. The package docstring says why."""

from __future__ import annotations

import importlib

from .. import _failed_load
from .._checks import (
    SCHEDULER,
    Counts,
    build_meta_expects,
    upstream_keeps_resumed,
    upstream_preempts,
    upstream_preempts_any,
)
from .._checks import expects as _expects
from .._checks import param_names as _params
from .._checks import source as _source
from .._targets import STORE
from ._common import GROUP, NO_RELOAD

_COUNTS = Counts("requests_rolled_back", "blocks_evicted", "reloads_refused")
counters = _COUNTS.snapshot


def make_handle_invalid(original):
    """After vLLM's own handling: under ``recompute``, every multi-group request it rolled back
    (``num_computed_tokens`` rewound to 0 in place, still running) has every non-null block of
    every group evicted from the prefix cache and is preempted with its in-flight output dropped
    (``drop_stale_output``, as ``reset_prefix_cache`` preempts). vLLM's in-place rewind keeps the
    align-mode block table (null blocks where the recompute's GDN state goes) and, under
    ``recompute``, evicts nothing (a later local hit is served the never-loaded blocks). The shared
    part: ``_failed_load.make_handle_invalid``."""
    return _failed_load.make_handle_invalid(
        original,
        mark=NO_RELOAD,
        # vLLM 0.30 rewinds a multi-group request to 0 and counts what it had computed before the
        # failed step (``total_affected_tokens``): the same count here
        computed_before=lambda request, num_scheduled_tokens: request.num_computed_tokens
        - num_scheduled_tokens.get(request.request_id, 0),
        evicted=_evicted_all,
        preempt=_preempt_dropping_output,
        message="ascend_layerwise_patch: request(s) %s preempted after a failed KV load (recompute, hybrid): %d block(s) "
        "evicted from the prefix cache; they recompute their prompt and do not load from the pool again",
        counts=_COUNTS,
    )


def _evicted_all(scheduler, rolled, _points, _num_scheduled_tokens) -> set[int]:
    """vLLM 0.30 rewinds a multi-group request to 0: every non-null block of every group is evicted."""
    manager = scheduler.kv_cache_manager
    null = manager.block_pool.null_block.block_id
    return {b for r in rolled for ids in manager.get_block_ids(r.request_id) for b in ids if b != null}


def _preempt_dropping_output(scheduler, request, now, _num_scheduled_tokens) -> None:
    """vLLM 0.30's ``_preempt_request`` drops the in-flight output itself (``drop_stale_output``);
    the request is also no longer one the previous step scheduled (async scheduling's bookkeeping)."""
    scheduler._preempt_request(request, now, drop_stale_output=True)
    scheduler.prev_step_scheduled_req_ids.discard(request.request_id)


def make_no_reload(original):
    """A request preempted after a failed pool load resumes without asking the pool again: it
    recomputes what it could not load. Asking again would load the same keys: a store that keeps
    failing would preempt it at every resume (``_failed_load.make_no_reload``; counted)."""
    return _failed_load.make_no_reload(original, mark=NO_RELOAD, counts=_COUNTS)


def make_build_meta(original):
    """vllm-ascend's pool scheduler raises on a request preempted outside ``schedule()`` (the
    rollback above) and resumed by the next one: its preemption's cleanup runs here instead,
    keeping the resume's entry (``_failed_load.make_build_meta``)."""
    return _failed_load.make_build_meta(original, forget=("_loading_req_ids",), finish=_report_preempted)


def _report_preempted(meta, preempted, both) -> None:
    """vllm-ascend 0.30.0rc2's metadata takes sets: every preempted id, and those preempted and
    resumed in this step are released too (the workers' threads forget the request's old state)."""
    meta.preempted_req_ids = set(preempted)
    released = getattr(meta, "released_req_ids", None)
    if released is not None:
        meta.released_req_ids = set(released) | both


def _rewinds_to_0_and_drops_output(_original) -> str | None:
    """vLLM 0.30: a multi-group request is rolled back to 0, and the preemption drops the output in
    flight (``drop_stale_output``) and keeps async scheduling's ``prev_step_scheduled_req_ids``."""
    cls = importlib.import_module("vllm.v1.core.sched.scheduler").Scheduler
    update = _source(getattr(cls, "_update_requests_with_invalid_blocks", None))
    if "req_block_ids_per_group" not in update or "num_computed_tokens = 0" not in update:
        return "Scheduler._update_requests_with_invalid_blocks no longer rolls a multi-group request back to 0"
    preempt = getattr(cls, "_preempt_request", None)
    if preempt is None or "drop_stale_output" not in _params(preempt):
        return "Scheduler._preempt_request has no drop_stale_output"
    if "prev_step_scheduled_req_ids" not in _source(cls):
        return "Scheduler no longer has prev_step_scheduled_req_ids"
    return None


def _handle_invalid_ok(original) -> str | None:
    return _failed_load.handle_invalid_ok(original, _rewinds_to_0_and_drops_output)


SPECS = (
    GROUP.spec(
        "pool_load_rollback",
        f"{SCHEDULER}._handle_invalid_blocks",
        make_handle_invalid,
        precondition=_handle_invalid_ok,
        fixed_upstream=upstream_preempts,
        counters=counters,
        after=("load_fail_rollback",),  # load_failures (vLLM 0.25): never both in range
        why="under recompute a hybrid request rolled back after a failed KV load is preempted (its blocks evicted "
        "from the prefix cache, in-flight output dropped) instead of rewound in place",
        risk="a hybrid request recomputed in place writes and reads GDN state in the shared null block; "
        "never-loaded blocks stay in the prefix cache",
    ),
    GROUP.spec(
        "pool_load_resume_meta",
        f"{STORE}.pool_scheduler:KVPoolScheduler.build_connector_meta",
        make_build_meta,
        precondition=build_meta_expects("AscendConnectorMetadata("),
        fixed_upstream=upstream_keeps_resumed,
        why="a request preempted after a failed load and resumed by the next schedule keeps its pool-scheduler state",
        risk="the pool scheduler raises on a request preempted after a failed load and resumed (the engine ends)",
        after=("send_shedding", "load_fail_resume_meta"),  # 0.25's wrappers of this target: never both in range
    ),
    GROUP.spec(
        "pool_load_no_reload",
        f"{STORE}.pool_scheduler:KVPoolScheduler.get_num_new_matched_tokens",
        make_no_reload,
        precondition=_expects(["self", "request", "num_computed_tokens"]),
        fixed_upstream=upstream_preempts_any,
        why="a request preempted after a failed pool load recomputes its prompt (never reloads from the pool)",
        risk="a store that keeps failing preempts the same request at every resume",
        after=("load_fail_no_reload", "pool_hit_boundary"),
    ),
)
