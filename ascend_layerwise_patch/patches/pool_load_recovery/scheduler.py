"""Scheduler half of ``pool_load_recovery``: under ``recompute`` a hybrid request vLLM 0.30 rolled
back in place after a failed load is preempted instead, its blocks evicted from the prefix cache,
and it never loads from the pool again. The package docstring says why."""

from __future__ import annotations

import functools
import importlib
import time

from ... import pool_events
from ...host import logger
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
_count = _COUNTS.add
counters = _COUNTS.snapshot


def make_handle_invalid(original):
    """After vLLM's own handling: under ``recompute``, every multi-group request it rolled back
    (``num_computed_tokens`` rewound to 0 in place, still running) has every non-null block of
    every group evicted from the prefix cache and is preempted with its in-flight output dropped
    (``drop_stale_output``, as ``reset_prefix_cache`` preempts). vLLM's in-place rewind keeps the
    align-mode block table (null blocks where the recompute's GDN state goes) and, under
    ``recompute``, evicts nothing (a later local hit is served the never-loaded blocks)."""
    status = importlib.import_module("vllm.v1.request").RequestStatus

    @functools.wraps(original)
    def _handle_invalid_blocks(self, invalid_block_ids, num_scheduled_tokens):
        before = {r.request_id: r.num_computed_tokens - num_scheduled_tokens.get(r.request_id, 0) for r in self.running}
        failed = original(self, invalid_block_ids, num_scheduled_tokens)
        if not failed or not self.recompute_kv_load_failures or len(self.kv_cache_config.kv_cache_groups) <= 1:
            return failed
        rolled = [r for r in self.running if r.request_id in failed and r.status == status.RUNNING]
        if not rolled:
            return failed
        manager = self.kv_cache_manager
        null = manager.block_pool.null_block.block_id
        evict = {b for r in rolled for ids in manager.get_block_ids(r.request_id) for b in ids if b != null}
        if evict:
            manager.evict_blocks(evict)
        now = time.monotonic()
        for request in rolled:
            request.__dict__[NO_RELOAD] = True
            self.running.remove(request)
            self._preempt_request(request, now, drop_stale_output=True)
            self.prev_step_scheduled_req_ids.discard(request.request_id)
        ids = sorted(r.request_id for r in rolled)
        _count("requests_rolled_back", len(rolled))
        _count("blocks_evicted", len(evict))
        pool_events.bump("requests_rolled_back", len(rolled))
        pool_events.bump("tokens_recomputed", sum(before.get(r, 0) for r in ids))
        logger().warning(
            "ascend_layerwise_patch: request(s) %s preempted after a failed KV load (recompute, hybrid): %d block(s) "
            "evicted from the prefix cache; they recompute their prompt and do not load from the pool again",
            ids,
            len(evict),
        )
        return failed

    return _handle_invalid_blocks


def make_no_reload(original):
    """A request preempted after a failed pool load resumes without asking the pool again: it
    recomputes what it could not load. Asking again would load the same keys: a store that keeps
    failing would preempt it at every resume."""

    @functools.wraps(original)
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.__dict__.get(NO_RELOAD):
            _count("reloads_refused")
            return 0, False
        return original(self, request, num_computed_tokens)

    return get_num_new_matched_tokens


def make_build_meta(original):
    """vllm-ascend's pool scheduler handles ``preempted_req_ids`` after ``schedule()`` already
    resumed the request (``update_state_after_alloc``): it drops the entry the resume just made and
    then raises ("not in _unfinished_requests") on the resumed request. A request preempted outside
    ``schedule()`` (the rollback above) is resumed by the next one, so it is both. For those the
    preemption's cleanup runs here, keeping the resume's entry; the metadata still carries every
    preempted id to the workers (their threads forget the request's old state)."""

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
            self._loading_req_ids.discard(req_id)
        scheduler_output.preempted_req_ids = type(preempted)(r for r in preempted if r not in both)
        try:
            meta = original(self, scheduler_output)
        finally:
            scheduler_output.preempted_req_ids = preempted
        meta.preempted_req_ids = set(preempted)
        released = getattr(meta, "released_req_ids", None)
        if released is not None:
            meta.released_req_ids = set(released) | both
        return meta

    return build_connector_meta


def _handle_invalid_ok(original) -> str | None:
    problem = _expects(
        ["self", "invalid_block_ids", "num_scheduled_tokens"],
        needs=("_update_requests_with_invalid_blocks", "recompute_kv_load_failures"),
    )(original)
    if problem:
        return problem
    cls = importlib.import_module("vllm.v1.core.sched.scheduler").Scheduler
    update = _source(getattr(cls, "_update_requests_with_invalid_blocks", None))
    if "req_block_ids_per_group" not in update or "num_computed_tokens = 0" not in update:
        return "Scheduler._update_requests_with_invalid_blocks no longer rolls a multi-group request back to 0"
    preempt = getattr(cls, "_preempt_request", None)
    if preempt is None or "drop_stale_output" not in _params(preempt):
        return "Scheduler._preempt_request has no drop_stale_output"
    if "prev_step_scheduled_req_ids" not in _source(cls):
        return "Scheduler no longer has prev_step_scheduled_req_ids"
    if not callable(getattr(importlib.import_module("vllm.v1.core.kv_cache_manager").KVCacheManager, "evict_blocks", None)):
        return "KVCacheManager.evict_blocks is gone"
    return None


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
