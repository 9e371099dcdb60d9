"""Every patch this library applies, with its reason and its removal plan.

Each module here declares :class:`~ascend_layerwise_patch.registry.PatchSpec` s as data and
imports nothing heavy at import time (factories import their targets' neighbours lazily).

** connector_guards ** (``connector_guards.py``)
   Target:  vllm_ascend.attention.utils.wait_for_kv_layer_from_connector,
            vllm_ascend.attention.utils.maybe_save_kv_layer_to_connector, and their copies in
            ops.gdn, attention.{mla_v1,sfa_v1,dsa_v1}, attention.context_parallel.dsa_cp,
            _310p.ops.fla.gdn_310.
   Why:     they reach the connector in profile / dummy runs, where no connector metadata is
            bound; AscendStore's pool worker counts layers on every call, so every later layer
            is misaligned.
   How:     call through only when ``connector.has_connector_metadata()``, as vLLM's own
            ``maybe_transfer_kv_layer`` does.
   Upstream: not fixed in vllm-ascend 0.25.1rc1 nor 0.26.0rc1; fixed in 0.30.0rc2 (detected).
   Remove:  when vllm-ascend's helpers check it (detected: the patch then skips itself).

** gdn_layerwise ** and ** gdn_layerwise_310p ** (``gdn_layerwise.py``)
   Target:  vllm_ascend.ops.gdn.AscendGatedDeltaNetAttention._forward_core (+ the copy on vLLM's
            QwenGatedDeltaNetAttention made by vllm-ascend's patch_qwen3_5); the 310P variant
            vllm_ascend._310p.ops.fla.gdn_310.AscendGatedDeltaNetAttention310._forward_core as
            its own group.
   Why:     GDN layers save their layer but never wait for it, so with use_layerwise=true they
            can compute on state still being loaded, and never open MemCache's compute fence.
   How:     wait_for_kv_layer_from_connector(self.prefix), then record_attention_compute_start(),
            at the entry of _forward_core (eager, inside the qwen_gdn_attention_core custom op;
            forward is Dynamo-traced with fullgraph=True).
   Upstream: not fixed in vllm-ascend 0.25.1rc1 nor 0.26.0rc1. 0.30.0rc2: the main GDN layer waits and
            fences itself (skipped, detected; the fence now lives in ascend_store.attention_fence), the
            310P layer still does not (gdn_layerwise_310p applies).
   Remove:  when vllm-ascend's _forward_core waits itself (detected: the patch then skips itself).

** mamba_precopy_rows ** and ** mamba_precopy_defer ** (``mamba_precopy.py``, group ``gdn_layerwise``)
   Target:  vllm.v1.worker.mamba_utils.collect_mamba_copy_meta and do_mamba_copy_block; applied by
            the gdn_layerwise entry.
   Why:     execute_model pre-copies the align state right after start_load_kv, which in layerwise
            mode only builds the load tasks: on a pool hit the copy reads its source block before
            the layer's load wrote it, and GDN computes from stale bytes.
   How:     rows whose source a layerwise load writes this step are uploaded once and copied per
            layer (same batch-copy kernel) between the layer's wait and its first state read;
            every other row keeps upstream's bulk copy. Same group as gdn_layerwise: both or none.
   Upstream: not fixed in vllm-ascend 0.25.1rc1 / 0.26.0rc1 (applies on both). 0.30.0rc2's runner hands
            the copy to the connector (prepare_mamba_state_copy, per layer after its load; the bulk copy
            is only the fallback of other connectors): skipped there, detected.
   Remove:  when vllm-ascend's runner no longer pre-copies in bulk (detected: the group then skips).

** mamba_local_hit ** (``mamba_local_hit.py``)
   Target:  vllm_ascend.patch.platform.patch_kv_cache_coordinator.AscendHybridKVCacheCoordinator.
            find_longest_cache_hit_per_group; KVPoolScheduler.bind_gpu_block_pool.
   Why:     with a connector, the scheduler's local hit skips mamba groups: on a pool-serving
            instance every local prefix hit starts GDN from the null block.
   How:     for the block pool the AscendStore pool scheduler is bound to, the joint hit over all
            groups (vLLM's own local path); P/D connectors keep upstream's skip.
   Upstream: not fixed in vllm-ascend 0.25.1rc1. 0.26.0rc1 fixed it for producer roles only (its
            scheduler takes the joint lookup for kv_producer / kv_both); kv_consumer instances and
            balance scheduling still lose the state there, so the patch applies on both pairs.
            0.30.0rc2 looks every group up, but balance scheduling takes max(per_group_hits) with no
            reconciliation: applies (detected by reading those callers).
   Remove:  when the coordinator no longer skips mamba groups (detected: the group then skips).

** mamba_pool_hit ** (``mamba_pool_hit.py``)
   Target:  KVPoolScheduler._get_layerwise_gva_hit_tokens; KVPoolWorker._alloc_gvas_for_save;
            KVPoolWorker._prepare_load_gvas (``mamba_pool_null_loads``, vllm-ascend 0.26 only).
   Why:     a whole-prompt pool hit ends one token short of a block boundary, and the layerwise save
            publishes mamba null blocks under real keys: GDN starts from states nobody saved.
   How:     hybrid hits end at the last block boundary below the prompt end at which every mamba
            group's key is ready (0 if none); null mamba blocks are never allocated a key. On 0.26,
            whose load looks up every block of the range and stops the engine on a missing key, the
            null mamba blocks' lookups are answered as present and their GVAs zeroed (never copied).
   Upstream: not fixed in vllm-ascend 0.25.1rc1 nor 0.26.0rc1.
   Remove:  when the hit check knows mamba groups (detected: the group then skips).

** mamba_lifetime ** (``mamba_lifetime.py``)
   Target:  ascend_store.pool_scheduler.KVPoolScheduler.touch_sending_mamba_blocks (scheduler
            half); ascend_store.pool_worker.KVPoolWorker.{start_load_kv, save_kv_layer,
            build_connector_worker_meta} and _handle_request of KVCacheStoreLayerSendingThread /
            KVCacheStoreKeyLayerSendingThread (worker half; reached through pool_worker's names).
   Why:     hybrid models touch mamba blocks under a send event, but in layerwise mode no worker
            ever reports the event, so every touched block leaks. Skipping the touch (the seed
            change) lets a send that outlived save_kv_layer's 10 s wait read blocks already given
            to another request. Full-attention blocks are freed at once in layerwise mode and have
            the same exposure after a save timeout.
   How:     the scheduler touches mamba blocks and, by default, the full-attention blocks the step
            may save, under one event; each worker queues a release marker behind its step's last
            layer on the sending thread's FIFO; the thread reaching it marks the events completed,
            build_connector_worker_meta reports them, and update_connector_output frees them once
            every worker has. A raising copy's task list is cleared so it is not re-sent. The six
            specs apply together or not at all. ASCEND_LAYERWISE_PATCH_MAMBA_HOLD_ATTENTION=0
            holds mamba blocks only (full attention is then exposed after a save timeout).
   Upstream: not fixed in vllm-ascend 0.25.1rc1 nor 0.26.0rc1 (leaks); the seed change trades the
            leak for the race (on 0.25.1rc1; 0.26.0rc1's save_kv_layer no longer times out).
   Remove:  when vllm-ascend's layer sending thread reports completed events (detected: the whole
            group then skips itself).

** send_integrity ** (``send_integrity.py``; part of the mamba_lifetime group)
   Target:  ascend_store.pool_worker.KVCacheStoreLayerSendingThread._batch_copy_with_limits and
            .build_shared_data; ascend_store.ascend_store_connector.AscendStoreConnector
            .has_pending_push_work; plus hooks in the mamba_lifetime wrappers (start_load_kv,
            save_kv_layer, build_connector_worker_meta, the sending threads' _handle_request).
   Why:     the layer sending thread finishes a GVA pool key as written after its final layer even
            when another layer's copy raised or its queued task list was rebuilt by the next step
            (after save_kv_layer's 10 s wait), so hits load unwritten layers; held blocks are only
            released inside a step, and vLLM stops stepping when the last request ends (blocks stay
            pinned, reset_prefix_cache(reset_running_requests=True) raises); a hung copy is silent.
   How:     the thread records per key which layer slots a successful copy wrote and gives every
            key with a gap a failure result before the final finish (or finishes it failed itself
            if the final layer raised); the worker hands each queued task list over and starts a
            fresh one, and each step's block / GVA arrays are its own copies (upstream's are views
            of a buffer the next step's build overwrites); has_pending_push_work keeps vLLM
            stepping (no model run) while a send event is open (bounded by IDLE_STEP_LIMIT_S
            without progress); a copy in flight longer than save_kv_layer's wait is logged as a
            WARNING (rate-limited) and counted in status() (``counters``).
   Upstream: not fixed in vllm-ascend 0.25.1rc1. vllm-ascend 0.26.0rc1 stops its sending thread at a
            failed or raising save copy before any key is finished: send_integrity_copy is skipped
            there as fixed upstream; own_arrays and idle_steps apply (a rank that saves nothing at
            the last layer does not wait for its sends); the stuck-copy WARNING cannot fire there
            (save_kv_layer waits for the last layer without a limit).
   Remove:  with the lifetime group; has_pending_push_work skips itself once AscendStoreConnector
            defines it.

** send_shedding ** (``send_shedding.py``; part of the mamba_lifetime group)
   Target:  ascend_store.pool_scheduler.KVPoolScheduler.build_connector_meta, plus a hook in the
            mamba_lifetime wrapper of touch_sending_mamba_blocks.
   Why:     nothing bounds the layerwise send backlog: a store slower than the model (0.25.1rc1's
            save_kv_layer gives up after 10 s and the next step queues behind) keeps every queued
            step's blocks held, rightly, until the block pool is exhausted and the engine stalls.
   How:     at each build_connector_meta, the block references held by open send events are
            compared with ASCEND_LAYERWISE_PATCH_SEND_BACKLOG x the pool (default 0.25), and the
            steps with open events with ASCEND_LAYERWISE_PATCH_SEND_BACKLOG_STEPS (default 3); a
            request's save that would pass either is shed (can_save cleared before the touch: no
            event, no held block, no task, no key on any rank). Loads unaffected. Counted in
            status() (``counters``), WARNING at most once a minute.
   Upstream: not bounded in vllm-ascend 0.25.1rc1. Out of range on 0.26.0rc1: its save_kv_layer
            waits without a limit; a non-leader rank at TP > KV heads does not wait, its sends
            pile up behind a slow store, and then its sending thread's own assertion stops the
            engine (the bound at its defaults does not prevent that: a different defect).
   Remove:  when the scheduler bounds its open send events (detected: the patch then skips itself).

** postprocess_kernel ** and ** postprocess_v2_out_buffer ** (``postprocess_kernel.py``, one group)
   Target:  vllm_ascend.ops.triton.mamba.postprocess.postprocess_mamba_fused_kernel (+ the copies
            vllm-ascend's patch_mamba_utils makes in itself and in vllm.v1.worker.mamba_utils);
            vllm.v1.worker.mamba_utils.MambaSpecDecodeGPUContext.run_fused_postprocess_align.
   Why:     vllm-ascend 0.25.1rc1 installs its 17-parameter kernel as vLLM's, but vLLM 0.25's V1
            and V2 callers launch it with 23: spec-decode steps of GDN hybrids in align mode fail.
            vLLM 0.25's V2 caller also passes no out buffer, so one program writes num_accepted
            in place while the request's other programs read it (a race between programs).
   How:     this library's own Triton kernel (kernels/postprocess.py) with the 23-parameter
            signature, installed as a launcher compiled on first launch (no triton needed to
            install it); its grid is (states, pieces, request blocks) and it splits the 2 MiB
            temporal copies across programs. The V2 caller is replaced by one that passes a
            snapshot to read and the live counts as the out buffer. On an H200: 1.4x-61x faster
            than vLLM 0.25.1's kernel, 1.22-1.34x the time of a plain copy of the same bytes.
   Upstream: not fixed in vllm-ascend 0.25.1rc1; vllm-ascend 0.26.0rc1's kernel has the 23
            parameters (postprocess_kernel is skipped there, vllm-ascend's kernel stays in place);
            vLLM 0.26.0's V2 caller still passes no out buffer (postprocess_v2_out_buffer applies).
            vllm-ascend 0.30.0rc2 / vLLM 0.30: both fixed (its kernel takes the installed vLLM's 24).
   Remove:  when vllm-ascend's kernel takes the 23 parameters and vLLM's V2 caller passes an out
            buffer (both detected: each patch then skips itself).

** gdn_tp_keys ** (``gdn_tp_keys.py``)
   Target:  ascend_store.pool_worker.KVPoolWorker.{_make_layerwise_gva_key,
            _process_save_for_layer_batch, _alloc_gvas_for_save, _build_shared_save_data};
            ascend_store.pool_scheduler.KVPoolScheduler._make_layerwise_gva_keys_for_hit_check.
   Why:     at TP > KV heads the layerwise GVA path keys, saves and hit-checks GDN (align-state)
            groups per KV head, as if ranks shared them: on a pool hit, ranks 1..put_step-1 of each
            head group load the leader rank's GDN slice.
   How:     for align-state groups with put_step > 1: key ``model@group@hash@tp<rank>``, every rank
            saves its own slice (upstream's save code run on a put_step-1 view that leaves the
            leader's groups alone), an empty final-layer save task finishes a non-leader's keys,
            and a block is a hit only when all tp_size rank keys are ready. Full-attention keys
            unchanged; old GDN keys are never asked for (misses).
   Upstream: not fixed in vllm-ascend 0.25.1rc1 nor 0.26.0rc1 (0.26.0rc1 finishes a step's keys with
            its last save task on every rank: gdn_tp_finish is skipped there as fixed upstream).
   Remove:  when _make_layerwise_gva_key reads group_uses_align_state (detected: the group skips).

** pool_key_layout ** (``pool_key_layout.py``)
   Target:  ascend_store.pool_scheduler.KVPoolScheduler.__init__; ascend_store.pool_worker.
            KVPoolWorker.__init__ and KVPoolWorker.process_layer_data.
   Why:     layerwise keys start with the checkpoint folder's name and name no TP size, pipeline
            stage or format: instances of another TP size, another checkpoint in a folder of the
            same name, another stage or a process without this library read each other's bytes;
            PP > 1 also looks layers up by the wrong index; 0.25.1rc1 never forgets a key MemCache
            evicted or failed (never saved again, stale GVA rewritten) and its GVA map grows.
   How:     on the layerwise GVA path both halves key under ``alp<FORMAT>.<name>.<digest of the
            full path>.tp<N>.pp<N>s<stage>`` (other layouts: a miss); PP > 1 is refused at
            start-up with the reason; cached keys a save names are checked in MemCache first
            (0.25.1rc1; 0.26.0rc1 does it itself) and the map is bounded.
   Upstream: not fixed in vllm-ascend 0.25.1rc1 nor 0.26.0rc1.
   Remove:  when vllm-ascend's layerwise keys name TP size and stage (detected: the group skips).

** load_failures ** (``load_failures.py``)
   Target:  ascend_store.pool_worker.KVPoolWorker.wait_for_layer_load;
            KVCacheStoreLayerRecvingThread.{_handle_request, _batch_copy_with_limits} (through
            pool_worker's name); vllm.v1.core.sched.scheduler.Scheduler._update_requests_with_invalid_blocks.
   Why:     a layerwise load that fails, raises or times out is computed on and never reported;
            vLLM 0.25's invalid-block handling cannot take a hybrid request's blocks (it raises),
            so vllm-ascend does not report them.
   How:     the receiving thread records failed copies (a raise is a failed copy); the worker reports
            them, blocks without a GVA, and -- after a timed-out wait (WARNING) -- all of the step's
            load blocks through get_block_ids_with_load_errors in the same step, abandons the
            step's remaining loads and clears stale load events once the thread is idle; the
            scheduler rolls a hybrid request back to the longest prefix every group (mamba state
            included) can resume from. Recommended policy: kv_load_failure_policy=recompute.
   Upstream: not fixed in vLLM 0.25.1 / vllm-ascend 0.25.1rc1. Out of range on 0.26: vllm-ascend
            0.26.0rc1 stops the engine on a failed hybrid load by design (no silent wrong tokens).
   Remove:  when both halves are fixed upstream (each detected: those specs skip themselves).

** load_failures_saves ** (``load_failures.py``, its own group)
   Target:  ascend_store.pool_worker.KVCacheStoreLayerSendingThread._handle_request;
            KVPoolWorker.start_load_kv.
   Why:     the step whose load failed still computes on the unloaded state and saves its new blocks
            (every group, the chunk-end GDN state included); the sending thread finishes them as ready
            at the final layer and every later hit on that prefix, on any instance, loads them.
   How:     load_failures marks the ReqMeta s of the requests whose loads failed (and, for the steps
            already scheduled on that state under async scheduling, the request until its preemption
            reaches the worker); at the final layer the thread gives their save keys a failed result
            before upstream's finish.
   Remove:  when the sending thread drops the saves of failed loads itself (detected).

** load_failures_rollback ** (``load_failures.py``, its own group)
   Target:  vllm.v1.core.sched.scheduler.Scheduler._handle_invalid_blocks;
            AsyncScheduler._update_after_schedule; KVPoolScheduler.build_connector_meta.
   Why:     the in-place rewind keeps the align layout (a recompute over several chunks runs GDN in
            the null block, shared by every request rolled back in the same step), the worker's
            mamba_state_idx, the connector's tracker and async placeholders; under recompute the
            invalid blocks stay cached for local hits.
   How:     evict the request's blocks from the rollback point on, then preempt it (vLLM's own
            reset), discarding only the output frames in flight after the failed step; the pool
            scheduler keeps a request preempted outside schedule() and resumed by the next one.
   Remove:  when vLLM's invalid-block handling preempts itself (detected).

** mamba_pool_resume_load ** (``load_failures.py``, its own group; vllm-ascend 0.25.1rc1)
   Target:  ascend_store.pool_worker.KVPoolWorker._prepare_load_gvas.
   Why:     a pool hit looks up every block of the range and loads each intermediate chunk-end mamba
            state that exists into the null block (cost; the null block is shared).
   How:     mamba_pool_hit's 0.26 member (null_loads_present) on 0.25.1rc1: null mamba blocks are not
            looked up, leased or loaded.

** load_failures_policy ** (``load_failures.py``, its own group)
   Target:  vllm_ascend.platform.NPUPlatform._validate_kv_load_failure_policy.
   Why:     vllm-ascend's config check refuses kv_load_failure_policy=recompute for hybrid models;
            the platform module is imported while vLLM is still initialising, long before
            load_failures' modules can be resolved, so it cannot share that group.
   How:     lifts the refusal while load_failures is applied or pending in the process.
   Remove:  with load_failures, or when vllm-ascend drops the refusal (detected: skips itself).
"""

from __future__ import annotations

from . import (
    connector_guards,
    gdn_layerwise,
    gdn_tp_keys,
    load_failures,
    mamba_lifetime,
    mamba_local_hit,
    mamba_pool_hit,
    mamba_precopy,
    pool_key_layout,
    postprocess_kernel,
    send_integrity,
    send_shedding,
)

SPECS = (
    *connector_guards.SPECS,
    *gdn_layerwise.SPECS,
    *mamba_precopy.SPECS,
    *mamba_lifetime.SPECS,
    *send_integrity.SPECS,
    *send_shedding.SPECS,
    *postprocess_kernel.SPECS,
    *mamba_local_hit.SPECS,
    *mamba_pool_hit.SPECS,
    *gdn_tp_keys.SPECS,
    *pool_key_layout.SPECS,
    *load_failures.SPECS,
)
