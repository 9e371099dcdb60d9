"""Every patch group, one line each; one package per group family (``patches/<package>/``), whose
docstring is the group's text (targets, versions, why, how, removal). ``check`` shows each patch's
``why`` and its state; scripts/expected_states.txt the expected state of every patch on every pair.

A package declares each of its groups once (``_checks.Group``: its name, the releases it is
declared for -- one of the ranges named in ``_ranges`` --, its risk) and its
:class:`~ascend_layerwise_patch.registry.PatchSpec` s as data through it (``GROUP.spec(...)``); it
imports nothing heavy at import time (factories import their targets' neighbours lazily). No
package imports another package or the registry: what a factory needs of another group it reads
from its ``Context`` (``PatchSpec.context``); patches stacked on one target name the earlier ones
(``PatchSpec.after``). Target paths shared by several packages are in ``_targets``; target checks
in ``_checks``; release ranges in ``_ranges``; the scheduler half of a failed load that vLLM 0.25's
and 0.30's groups share in ``_failed_load``. A group applies whole or not at all; ``SPECS`` below is
the order in which groups (and patches stacked on one target) are applied. tests/unit/test_index.py
holds this list to ``SPECS`` and the packages to their imports.

A new release pair touches these files (tests/unit/test_new_pair.py adds a fictitious one to a copy
of the repository, as below, and holds the files that changed to this list):

    scripts/pairs.txt                            its line (scripts/env.sh installs it)
    ascend_layerwise_patch/patches/_ranges.py    the named ranges that admit it (every group declared for one follows)
    scripts/expected_states.txt                  its column: ``check --cpu --json`` on it, each patch's reason read
    README.md                                    its row in the version table
    docs/patches.md                              its column of the expected-states table: ``python scripts/expected_states.py --readme``
    setup.cfg                                    the ``vllm`` extra, where ``_ranges.SUPPORTED``'s vLLM range moved

and, only where the pair behaves differently from the one before it, the packages of the groups whose
behaviour differs there (a detector that answers wrongly is fixed first; a target that moved; a
member declared for fewer releases, with a range of its own in ``_ranges``), and
``@pytest.mark.pairs`` on the tests whose defect the pair still has. A new patch: a spec in its
group's package, a row in scripts/expected_states.txt, a line here if it is a new group (a new
package if it is a new family).

group                   package              what it fixes
connector_guards        connector_guards     connector helpers called in profile / dummy runs advance the pool's layer counter
gdn_layerwise           gdn_layerwise        GDN layers never waited for their layerwise load; align pre-copy read blocks before the load wrote them
gdn_layerwise_310p      gdn_layerwise        the same wait for the 310P GDN layer
mamba_lifetime          mamba_lifetime       mamba blocks leaked or freed under an in-flight send; half-written keys made ready; a slow store pinned the block pool
postprocess_kernel      postprocess_kernel   vllm-ascend's Triton postprocess kernel lacked vLLM 0.25's signature; V2 caller's shared counts
mamba_local_hit         mamba_local_hit      a local prefix hit dropped the mamba state with the AscendStore pool
mamba_pool_hit          mamba_pool_hit       a pool hit resumed where no mamba state was saved; null blocks published as keys
gdn_tp_keys             gdn_tp_keys          at TP above the KV heads every rank read rank 0's GDN slice
gdn_tp_step_end         gdn_tp_keys          0.26: at TP above the KV heads a non-leader rank's step ended before its GDN save copies
pool_key_layout         pool_key_layout      pool keys named no layout (TP size, stage, format); evicted keys never saved again
mamba_pool_resume_load  mamba_pool_hit       0.25.1rc1 loaded every intermediate mamba state of a hit into the null block
load_failures           load_failures        failed, raising or late loads were computed on, unreported
load_failures_saves     load_failures        the keys a failed step saved were made ready
load_failures_agreement load_failures        at TP > 1 only the failing rank dropped its keys of a failed step; the others published theirs
load_failures_policy    load_failures        vllm-ascend refused kv_load_failure_policy=recompute for hybrid models
load_failures_rollback  load_failures        the in-place rollback shared the null block, kept stale blocks cached and async frames
async_fences            async_fences         with async scheduling a kv_producer's freed block could be loaded into while the in-flight step still wrote it
pool_metrics            pool_metrics         the pool's failures were not on vLLM's /metrics nor in its KV-transfer log line
pool_hit_boundary       pool_hit_boundary    0.30: a whole-prompt pool hit resumed a GDN request at prompt - 1, where no state was saved
pool_key_tp             pool_key_tp          0.30: pool keys named no TP size: another TP size's GDN slices were loaded
pool_load_recovery      pool_load_recovery   0.30: a failed hybrid pool load ended the engine; vLLM's in-place rollback shared the null block
pool_load_agreement     pool_load_recovery   0.30: at TP > 1 with async scheduling a failed pool load stopped one rank and hung the others
pool_load_wait_bound    pool_load_recovery   0.30: a layerwise pool load copy that never returned hung the engine (the layer wait had no bound)
pool_load_recovery_policy pool_load_recovery 0.30: vllm-ascend refused kv_load_failure_policy=recompute for hybrid models
mtp_layer               mtp_layer            under MTP the draft layer's pool KV was saved with layer 0, before the drafter wrote it
mtp_step_end            mtp_layer            under MTP a step whose drafter did not run broke the layer sending thread ('save failed')
mtp_decode_saves        mtp_decode_saves     save_decode_cache under MTP pooled decode blocks' GDN states before the align postprocess wrote them
pool_hit_written        pool_hit_written     MemCache 1.2.x: a key another engine was still writing counted as a pool hit; its load failed
pool_save_failures      pool_save_failures   0.26 / 0.30: a failed save copy or a key MemCache did not finish (a full pool) stopped the engine
pool_alloc_lease        pool_alloc_lease     0.30: a save's 5-minute allocation lease let a writer host's death stall MemCache 1.2.0, every engine with it
"""

from __future__ import annotations

from . import (
    async_fences,
    connector_guards,
    gdn_layerwise,
    gdn_tp_keys,
    load_failures,
    mamba_lifetime,
    mamba_local_hit,
    mamba_pool_hit,
    mtp_decode_saves,
    mtp_layer,
    pool_alloc_lease,
    pool_hit_boundary,
    pool_hit_written,
    pool_key_layout,
    pool_key_tp,
    pool_load_recovery,
    pool_metrics,
    pool_save_failures,
    postprocess_kernel,
)
from .gdn_layerwise import mamba_precopy
from .mamba_lifetime import send_integrity, send_shedding
from .pool_metrics import v030 as pool_metrics_030

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
    *gdn_tp_keys.STEP_END_SPECS,
    *pool_key_layout.SPECS,
    *mamba_pool_hit.RESUME_LOAD_SPECS,
    *load_failures.SPECS,
    *async_fences.SPECS,
    *pool_metrics.SPECS,
    *pool_hit_boundary.SPECS,
    *pool_key_tp.SPECS,
    *pool_load_recovery.SPECS,
    *pool_metrics_030.SPECS,
    *mtp_layer.SPECS,
    *mtp_layer.STEP_END_SPECS,
    *mtp_decode_saves.SPECS,
    *pool_hit_written.SPECS,
    *pool_save_failures.SPECS,
    *pool_alloc_lease.SPECS,
)
