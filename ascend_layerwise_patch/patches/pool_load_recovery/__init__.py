"""0.30: a hybrid request whose pool load fails is recomputed (or failed alone); the engine goes on.

Target   vllm_ascend...ascend_store.pool_worker: KVPoolWorker._prepare_load_gvas,
         KVPoolWorker.prepare_layerwise_step, .save_kv_layer (agreement); ascend_store.kv_transfer:
         KVCacheStoreLayerRecvingThread._handle_request, ._batch_copy_with_limits,
         KVCacheStoreLayerSendingThread._handle_request (agreement)                (worker half)
         vllm.v1.core.sched.scheduler:Scheduler._handle_invalid_blocks;
         vllm_ascend...ascend_store.pool_scheduler: KVPoolScheduler.build_connector_meta,
         KVPoolScheduler.get_num_new_matched_tokens                              (scheduler half)
         vllm_ascend.platform:_validate_kv_load_failure_policy                   (own group,
         ``pool_load_recovery_policy``: the platform is imported long before the others resolve)
Versions vLLM >=0.30,<0.31 (0.30.0); vllm-ascend >=0.30,<0.31 (0.30.0rc2). Not vLLM 0.29: its
         ``_update_requests_with_invalid_blocks`` unpacks one KV cache group, so a hybrid report
         raises in the scheduler (on v0290 these groups are ``skipped: version out of range``; the
         engine stops on a failed hybrid load there, as upstream does). On 0.25 the same defects are
         load_failures' (different code).
Why      vllm-ascend 0.30 fails fast on a failed hybrid (GDN + attention) load: a pool key evicted
         between the scheduler's hit check and the worker's load makes ``_prepare_load_gvas``
         raise ("Layerwise multi-group KV load failed and cannot safely fall back to per-block
         recomputation") out of ``execute_model``, and a layer load copy that returns an error (or
         raises) stops the layer receiving thread (a fatal error the next layer wait raises): the
         engine ends, every request with it.
         vLLM 0.30's scheduler can take a hybrid report, but under ``recompute`` it rewinds the
         request in place (``num_computed_tokens = 0``): it keeps the align-mode block table (null
         blocks below the state, so the recompute writes GDN state into the shared null block and
         reads it back: 6 wrong GDN reads of 16 with two requests, notes/i25e.md) and keeps the
         reported blocks in the prefix cache (a later local hit reads state never loaded); and
         vllm-ascend's platform refuses ``recompute`` for hybrid models.
How      Worker: ``_prepare_load_gvas`` runs upstream's code one request at a time; where upstream
         would raise for a request (a key missing or unleasable), that request loads nothing this
         step (``load_spec.can_load = False``), its read leases are released -- except keys another
         request of the step holds, which keep their lease -- and dropped from the step's lease
         cache (a later request of the step leases them anew); every hit block of every group of it
         goes to ``_invalid_block_ids`` (what ``get_block_ids_with_load_errors`` reports this step),
         logged at WARNING. The failed step saves nothing for it: its save ranges are taken out of
         the step's layer save tasks and ``can_save`` cleared before the save keys are allocated
         (no key is put, none made ready); under async scheduling it stays marked, and saves
         nothing, until its preemption or end reaches the worker.
         A layer load copy that returns an error (one that raises counts as returning -1): the
         receiving thread reports every block of that layer's load ranges (upstream's ``_mark_invalid_transfer_task_blocks``; one batched copy
         carries every request of the layer, so all are reported), marks those requests failed for
         the worker (their later saves dropped as above) and runs the layer's bookkeeping as after
         a copy that succeeded (final layer: leases released, last chunks finished; the layer's
         event set, ``task_done``) instead of stopping.
         Scheduler: under ``recompute``, a multi-group request vLLM rolled back is preempted
         (vLLM's ``_preempt_request``, ``drop_stale_output``: in-flight frames are discarded, as
         ``reset_prefix_cache`` does) after every non-null block of every group of it is evicted
         from the prefix cache: it resumes with a fresh block table (no null block below the resume
         point) and recomputes its prompt; it never asks the pool again (no reload: a store that
         keeps failing would otherwise preempt it at every resume; its re-saves of keys still in the
         pool are refused by the store: upstream's "alloc_gvas FAIL" ERROR lines, harmless).
         vllm-ascend's pool scheduler drops (and then raises on) a request preempted outside ``schedule()`` and
         resumed by the next one (``build_connector_meta``): kept. Under ``fail`` vLLM 0.30 already
         ends just that request with an error and evicts its blocks (unchanged).
         Policy: with ``pool_load_recovery`` in force (applied or pending) the platform accepts
         ``kv_load_failure_policy=recompute`` for hybrid models; otherwise its refusal stands.
         (Pool harness, tests/standins/test_pool_load_recovery.py: off, the engine ends; on,
         every request finishes with the tokens of a run without the pool, 0 wrong reads after the
         failed step, 0 null-block writes, no key of the steps computed on the failure ready.)
Agreement (group ``pool_load_agreement``, module ``agreement``; issue 32) Async scheduling across
         several TP ranks: the step scheduled before the failure was known is in flight on every
         rank, and only the rank whose load failed knew to drop its saves -- the others' (computed
         on that state through the all-reduce) would be published, so upstream's stop was kept, and
         at TP > 1 that stop is a hang (only the failing rank raises; the others wait in the next
         collective). Now every TP rank learns the failed requests at the final layer of the step
         (one byte per request, all_reduce MAX over the TP group's CPU group, bounded) and drops
         their saves until the rollback reaches it; with the agreement in force the failure is
         recovered there too (``worker.recovers``). Without it, and with PP / PCP > 1, upstream's
         stop is kept, with a WARNING saying why.
Wait bound (group ``pool_load_wait_bound``, module ``bound``; issue 32) upstream's layer wait has
         no bound: a copy that never returns hung the engine. After ``WAIT_S`` (10 s, the 0.25
         library's bound) every load block of the step is reported (recovered as above), the
         requests marked failed (the agreement drops their saves on every TP rank), the step's
         remaining loads abandoned and its leases released; stale load events are cleared once
         the receiving thread is idle. Its own group: the module docstring says why.
Not done A key-major (block-key) range load that fails stays upstream's: the engine stops. Not tested with pipeline parallelism or layerwise_offload
         (where a load step also saves).
Removal  When ``_prepare_load_gvas`` no longer raises for a hybrid request, the receiving thread no
         longer raises for a failed copy (worker half), ``_handle_invalid_blocks`` preempts the
         affected requests itself and ``build_connector_meta`` tells a resumed request from a
         preempted one (scheduler half): each detected, the group skips itself.
"""

from __future__ import annotations

from . import agreement, bound, policy, scheduler, worker
from ._common import AGREEMENT_GROUP, GROUP, POLICY_GROUP, WAIT_BOUND_GROUP  # noqa: F401

SPECS = (*worker.SPECS, *agreement.SPECS, *bound.SPECS, *scheduler.SPECS, *policy.SPECS)
