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
Late     A copy already inside MemCache when the wait gives up cannot be recalled; it writes into
         the blocks its load was given, which the rollback frees and vLLM may give to any request
         from the next schedule on (a copy landing after that request computed them: wrong tokens
         for a request that never touched the pool). The step after an abandoned load waits in
         ``start_load_kv`` (``load_fail_fence_first``: before the runner's bulk align pre-copy,
         which writes the step's blocks ahead of the first layer; the first layer's wait fences
         again), before writing anything, until the receiving thread is idle (the late-copy
         fence, ``_failed_load.late_copy_fence``, at most ``LATE_COPY_S`` = 30 s,
         ``ASCEND_LAYERWISE_PATCH_LATE_COPY_S``); at TP > 1 the agreement tells every rank of an
         abandoned load on any rank and the ranks agree on the fence's outcome. A copy that never
         returns stops the engine on every rank with that error instead of risking the write.
Saves    (group ``load_failures_saves``) The failed step still computes from the unloaded state
         and saves its new blocks, every group's (the chunk-end GDN state included); the layer
         sending thread would finish them as ready at the final layer (send_integrity cannot see it:
         every slot was written). The worker marks the step's ReqMeta s of requests whose loads
         failed; the sending thread's final layer gives their save keys a failed result before
         upstream's finish (in the thread: no race on ``write_results``). Under async scheduling the
         next step is already scheduled on the failed state: the request stays marked in later steps
         until its preemption (or end) reaches the worker. Keys ready from earlier steps are untouched.
Agreement (group ``load_failures_agreement``, module ``agreement``) At TP > 1 the marks above are the
         failing rank's alone: the other ranks' loads succeeded, yet after the next TP all-reduce
         their hidden states carry the failing rank's damage, so their saves of the failed step (and
         of the step in flight) are wrong too and were published; and at TP > KV heads the failing
         rank itself found its keys through the final layer's ranges, which a rank that saves no
         attention block does not have (``gdn_tp_keys``' final task: keys, no ranges). A hit then
         mixed clean and poisoned keys. Now, at the final layer's save of a step with a pool load,
         every rank all-reduces (MAX) one byte per request over the TP group's CPU group, bounded
         by ``AGREE_S`` (30 s, ``ASCEND_LAYERWISE_PATCH_LOAD_AGREE_S``); every rank marks the agreed
         requests as the failing rank does, and finishes ALL of their keys of the step as failed,
         whatever the ranges. The module docstring says why its own group, and why not a held
         publish. PP > 1 stays refused (``pool_key_layout``); each DP replica has its own TP group.
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
         request preempted outside ``schedule()`` and resumed by the next one: kept. A request given
         one of the evicted blocks by a local prefix hit before the rollback (in the failed step's
         own batch, or under async scheduling in the step in flight) computed on it too: it is
         preempted with the failed request (``_failed_load.sharing_requests``), its output of those
         steps dropped, and every rank finishes its saves of those steps as failed
         (``_common.poison_sharing``, at the agreement and at ``start_load_kv``; issue 32).
Removal  When vLLM's invalid-block handling reads every KV cache group and vllm-ascend reports
         failed layerwise loads itself (detected per half: the scheduler spec skips itself when
         ``_update_requests_with_invalid_blocks`` no longer unpacks one group; the worker specs
         when the receiving thread reports invalid blocks).
"""

from __future__ import annotations

from . import agreement, policy, report, rollback, saves
from ._common import _NO_RELOAD, AGREEMENT_GROUP, GROUP, POLICY_GROUP, ROLLBACK_GROUP, SAVES_GROUP  # noqa: F401
from .report import _resume_point, _upstream_hybrid, _upstream_reports  # noqa: F401  (tests read them)

_BY_NAME = {spec.name: spec for module in (report, saves, agreement, policy, rollback) for spec in module.SPECS}

#: the order they are applied in (and their modules imported): stacked patches after the ones they
#: name; load_fail_no_reload after load_fail_rollback_frames (production imports vLLM's
#: async_scheduler before vllm-ascend's pool_scheduler: the connector is built inside the scheduler;
#: the other order changed what the harness's async run computed)
SPECS = tuple(
    _BY_NAME[name]
    for name in (
        "load_fail_copy",
        "load_fail_thread",
        "load_fail_drop_saves",
        "load_fail_drop_later_saves",
        "load_fail_agree",
        "load_fail_agree_drop",
        "load_fail_wait",
        "load_fail_fence_first",
        "load_fail_policy",
        "load_fail_rollback",
        "load_fail_rollback_frames",
        "load_fail_resume_meta",
        "load_fail_no_reload",
        "load_fail_scheduler",
    )
)
