"""Group ``load_failures_agreement``: every TP rank learns, at the step's final-layer save, which
requests' layerwise loads failed on any rank of the TP group, and finishes that request's save keys of
the step as failed, never ready -- on every rank, whatever the rank saves. The package docstring
says why; :func:`make_save_kv_layer` says how.

Why its own group, not part of ``load_failures_saves``: it adds a collective to the forward of every
step that carries a pool load (a host barrier of the TP group at the final layer), and a new way for
a step to end -- a rank that never reaches the collective makes the others raise after
``AGREE_S``. Both are costs an operator may want to switch off on their own
(``ASCEND_LAYERWISE_PATCH_SKIP=load_failures_agreement``) without losing the failing rank's own drop
and the rollback; and at TP 1 it never communicates.

Why not a held publish (the scheduler's verdict in the next step's metadata): every pool key of every
step would be published one step later (two under async scheduling), not only the failed ones -- more
pool misses for concurrent requests of other instances -- and the pending finishes would have to
survive steps without a forward, preemptions and shutdown (an engine that goes idle, or a verdict a
worker never sees, leaves keys unfinished). The agreement costs nothing on a step without a pool
load, publishes nothing later, and reuses the marks ``load_failures`` already leaves.
"""

from __future__ import annotations

import functools
import importlib
import os

from .. import _failed_load
from ...host import logger
from .._checks import Counts
from .._checks import expects as _expects
from .._checks import source as _source
from .._targets import STORE
from ._common import _POISONED, _STEP, AGREEMENT_GROUP, DROPPED, poison_sharing, taint

#: how long a rank waits for the others at the final-layer agreement before it raises: above the
#: largest host skew between ranks in a healthy step (the final layer's own load wait, 10 s, plus the
#: host run-ahead HCCL allows); ``ASCEND_LAYERWISE_PATCH_LOAD_AGREE_S`` sets it (tests shorten it here)
AGREE_S = float(os.environ.get("ASCEND_LAYERWISE_PATCH_LOAD_AGREE_S", "30") or 30)

_PCP_WARNED = "_ascend_layerwise_patch_agree_pcp_warned"  # worker: the PCP warning was logged

COUNTS = Counts("agreements", "failed_elsewhere", "keys_dropped", "sharing_dropped")


def _has_pool_load(requests) -> bool:
    """The step loads from the pool: scheduler state, identical on every TP rank (0.25.1rc1's worker
    never writes ``can_load``), so every rank takes the same branch."""
    return any(m.load_spec is not None and m.load_spec.can_load for m in requests)


def _agree(worker, requests) -> list[bool]:
    """One flag per request (metadata order): its load failed on some rank of the TP group. The
    local flags are the ``load_failures`` marks of this step's waits (``_failed_load.tp_agree``
    all-reduces them)."""
    local = [bool(m.__dict__.get(_POISONED)) for m in requests]
    if getattr(worker, "tp_size", 1) > 1 and getattr(worker, "pcp_size", 1) > 1 and not worker.__dict__.get(_PCP_WARNED):
        worker.__dict__[_PCP_WARNED] = True
        logger().warning(
            "ascend_layerwise_patch: prefill context parallel is on (%d ranks): a failed layerwise load "
            "is agreed across the TP group only",
            worker.pcp_size,
        )
    step = worker.__dict__.get(_STEP)
    late = bool(step is not None and step.late)  # this rank abandoned a load (a copy may still land)
    flags = _failed_load.tp_agree([*local, late], AGREE_S)
    if getattr(worker, "tp_size", 1) > 1:
        COUNTS.add("agreements")
        if flags[-1]:
            worker.__dict__[_failed_load.LATE_ANYWHERE] = True  # every rank fences at the next step (report._fence)
    return flags[:-1]


def _mark(worker, requests, flags) -> None:
    """The requests whose load failed on another rank are marked as the failing rank marks its own:
    this step's ReqMeta (its saves dropped) and the worker's taint (the steps already scheduled on
    the failed state drop theirs too, ``load_failures_saves``' ``start_load_kv``)."""
    elsewhere = [m.req_id for m, f in zip(requests, flags) if f and not m.__dict__.get(_POISONED)]
    for meta, failed in zip(requests, flags):
        if failed:
            meta.__dict__[_POISONED] = True
            taint(worker, meta)
    sharing = poison_sharing(worker, requests, "in the failed step's batch")
    if sharing:
        COUNTS.add("sharing_dropped", len(sharing))
    if elsewhere:
        COUNTS.add("failed_elsewhere", len(elsewhere))
        logger().warning(
            "ascend_layerwise_patch: TP rank %d: layerwise load of requests %s failed on another TP rank; "
            "this rank's pool keys of the step are finished as failed",
            worker.tp_rank,
            sorted(elsewhere),
        )


def make_save_kv_layer(original):
    """``KVPoolWorker.save_kv_layer`` at the step's final layer, before the original queues that
    layer's saves (whose task the sending thread finishes every key of the step with):

    1. in a step whose metadata holds a pool load, every TP rank all-reduces (MAX) a flag per request
       over the TP group's CPU group: every rank passes here once per step, on the forward thread,
       in the same steps (the call depends on the scheduler output only; non-saver ranks too), and by
       now the rank's own load waits, the final layer's included, have returned or been abandoned;
    2. each request flagged is marked on every rank as the failing rank marks it (``_mark``);
    3. the save keys of every marked request of the step (this rank's newly allocated keys, every
       group; marked here, by the failing rank's waits, or by ``start_load_kv`` for a request still
       computing on a failed load) go to the sending thread on the final-layer task, and
       :func:`make_send_handle` finishes them as failed -- whatever ``block_ranges`` say: at TP >
       KV heads a rank that saves no attention block finishes its GDN keys with ``gdn_tp_keys``'
       task, which has no ranges.

    A rank that raises before this point leaves the others in the collective for ``AGREE_S``; they
    raise then (``RuntimeError``), and the engine ends with every rank's error, not a hang."""
    @functools.wraps(original)
    def save_kv_layer(self, connector_metadata):
        last = self.num_layers - 1
        if self.current_layer == last and self.use_gva_layerwise:
            requests = getattr(connector_metadata, "requests", None) or ()
            if requests and _has_pool_load(requests):
                _mark(self, requests, _agree(self, requests))
            _failed_load.attach_drops(self, requests, lambda meta: meta.__dict__.get(_POISONED))
        return original(self, connector_metadata)

    return save_kv_layer


def make_send_handle(original):
    """The layer sending thread: the keys the worker attached to the final layer's first task get a
    failed result before upstream's finish (``_failed_load.make_drop_attached``)."""
    return _failed_load.make_drop_attached(original, dropped=DROPPED, counts=COUNTS)


# ----------------------------------------------------------------------------- checks on targets
def _save_ok(original) -> str | None:
    config = importlib.import_module(f"{STORE}.config_data")
    fields = getattr(config.ReqMeta, "__annotations__", {})
    for name in ("save_keys", "load_spec"):
        if name not in fields:
            return f"ReqMeta no longer has {name}"
    if "can_load" not in getattr(config.LoadSpec, "__annotations__", {}):
        return "LoadSpec no longer has can_load"
    return _failed_load.agree_ok(original)


def _upstream_agrees(_original) -> str | None:
    """Fixed upstream when the worker's ``save_kv_layer`` reduces over the TP group itself (both
    members ask the worker, so the group skips whole)."""
    save = vars(importlib.import_module(f"{STORE}.pool_worker").KVPoolWorker)["save_kv_layer"]
    source = _source(save)  # inspect unwraps other groups' wrappers
    if "all_reduce" in source or "allreduce" in source:
        return "KVPoolWorker.save_kv_layer agrees on failed loads across TP ranks itself"
    return None


SPECS = (
    AGREEMENT_GROUP.spec(
        "load_fail_agree",
        f"{STORE}.pool_worker:KVPoolWorker.save_kv_layer",
        make_save_kv_layer,
        precondition=_save_ok,
        fixed_upstream=_upstream_agrees,
        counters=COUNTS.snapshot,
        why="every TP rank finishes the keys of a step whose load failed on any rank as failed",
        risk="the ranks whose loads succeeded publish keys computed from another rank's failed load",
        after=("mamba_worker_release",),  # mamba_lifetime's wrapper of this target is applied first
    ),
    AGREEMENT_GROUP.spec(
        "load_fail_agree_drop",
        f"{STORE}.pool_worker:KVCacheStoreLayerSendingThread._handle_request",
        make_send_handle,
        precondition=_expects(
            ["self", "transfer_tasks"], needs=("write_results.get(key, 0) or res", "final_layer_id", "batch_write_finish")
        ),
        fixed_upstream=_upstream_agrees,
        why="the keys the agreement drops are finished as failed by the sending thread",
        risk="keys of a non-saver rank (no ranges at the final layer) are published after a failed load",
        after=("mamba_thread_marker", "load_fail_drop_saves"),
    ),
)
