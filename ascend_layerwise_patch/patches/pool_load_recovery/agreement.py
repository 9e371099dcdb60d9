"""Group ``pool_load_agreement`` (0.30): every TP rank learns, at the step's final-layer save, which
requests' pool loads failed on any rank, so a failed load under async scheduling at TP > 1 is
recovered on every rank -- not vllm-ascend's stop, which at TP > 1 is a hang: only the failing rank
raises, the others wait in the next collective.

How: ``prepare_layerwise_step`` notes, before the worker changes anything (``_recover`` clears
``can_load`` on the failing rank), whether the step loads from the pool (scheduler state, identical
on every rank) and its requests in metadata order. At the final layer's ``save_kv_layer``, before
the original queues it, every rank of such a step all-reduces (MAX) one byte per request over the TP
group's CPU group (``_failed_load.tp_agree``, bounded by ``AGREE_S``): the local flags are the
worker's failed requests (a key gone at ``_prepare_load_gvas``) and the receiving thread's failed
copies of the step. Every rank then marks the agreed requests failed (``pool_load_recovery``'s
``_FAILED``: their saves in the steps already scheduled are dropped at their ``_prepare_load_gvas``,
on every rank) and finishes their save keys of this step as failed (the sending thread, before
upstream's finish). With this group in force ``pool_load_recovery`` recovers under async scheduling
at TP > 1 too (``worker.recovers``); PP > 1 and PCP > 1 keep upstream's stop.

Why its own group, and why not a held publish: as ``load_failures_agreement`` (0.25) says.
An abandoned load (``pool_load_wait_bound``) is agreed with the flags: every rank passes the
late-copy fence at the next step. Not done: at TP >
KV heads a rank that saves only GDN finishes its keys at its last GDN layer, before the agreement
(its keys of the load step are not dropped there: upstream's load step saves nothing for a request
in that shape, so none were measured).
"""

from __future__ import annotations

import functools
import os

from .. import _failed_load
from ...host import logger
from .._checks import Counts
from .._checks import expects as _expects
from .._checks import source as _source
from .._targets import STORE
from ._common import AGREEMENT_GROUP, AGREES
from .worker import _FAILED, _FAILED_COPIES, WORKER

#: how long a rank waits for the others at the agreement (``ASCEND_LAYERWISE_PATCH_LOAD_AGREE_S``)
AGREE_S = float(os.environ.get("ASCEND_LAYERWISE_PATCH_LOAD_AGREE_S", "30") or 30)

_STEP = "_ascend_layerwise_patch_agree_step"  # worker: req ids (metadata order) of a step with a pool load
_BOUND_STEP = "_ascend_layerwise_patch_wait_step"  # worker: pool_load_wait_bound's step (its ``late``), if applied
DROPPED = -1

COUNTS = Counts("agreements", "failed_elsewhere", "keys_dropped")


def make_prepare_step(original):
    """Notes whether the step loads from the pool (before the worker clears ``can_load`` for a
    request whose keys are gone) and says the worker agrees (``worker.recovers`` reads it)."""

    @functools.wraps(original)
    def prepare_layerwise_step(self, metadata):
        self.__dict__[AGREES] = True
        requests = getattr(metadata, "requests", None) or ()
        loads = getattr(self, "use_layerwise_transfer", False) and any(
            m.load_spec is not None and m.load_spec.can_load for m in requests
        )
        self.__dict__[_STEP] = [m.req_id for m in requests] if loads else None
        return original(self, metadata)

    return prepare_layerwise_step


def make_save_kv_layer(original):
    """At the final layer of a step with a pool load: the agreement, the marks, the keys to drop."""

    @functools.wraps(original)
    def save_kv_layer(self, connector_metadata):
        ids = self.__dict__.get(_STEP)
        if ids and self.current_layer == self.num_layers - 1:
            self.__dict__[_STEP] = None
            failed = self.__dict__.setdefault(_FAILED, set())
            thread = getattr(self, "kv_recv_thread", None)
            copies = set(thread.__dict__.get(_FAILED_COPIES) or ()) if thread is not None else set()
            step = self.__dict__.get(_BOUND_STEP)
            late = bool(step is not None and step.late)  # this rank abandoned a load: a copy may still land
            flags = _failed_load.tp_agree([*(r in failed or r in copies for r in ids), late], AGREE_S)
            flags, late = flags[:-1], flags[-1]
            if getattr(self, "tp_size", 1) > 1:
                COUNTS.add("agreements")
                if late:
                    self.__dict__[_failed_load.LATE_ANYWHERE] = True  # every rank fences at the next step
            agreed = {r for r, f in zip(ids, flags) if f}
            elsewhere = agreed - failed - copies
            failed |= agreed
            if elsewhere:
                COUNTS.add("failed_elsewhere", len(elsewhere))
                logger().warning(
                    "ascend_layerwise_patch: TP rank %d: KV pool load of requests %s failed on another TP rank; "
                    "they save nothing on this rank until vLLM recomputes or ends them",
                    self.tp_rank,
                    sorted(elsewhere),
                )
            requests = getattr(connector_metadata, "requests", None) or ()
            _failed_load.attach_drops(self, requests, lambda meta: meta.req_id in agreed)
        return original(self, connector_metadata)

    return save_kv_layer


def make_send_handle(original):
    """The layer sending thread: the keys the worker attached to the final layer's first task get a
    failed result before upstream's finish (``_failed_load.make_drop_attached``)."""
    return _failed_load.make_drop_attached(original, dropped=DROPPED, counts=COUNTS)




def _upstream_agrees(original) -> str | None:
    text = _source(original)
    if "all_reduce" in text or "allreduce" in text:
        return "KVPoolWorker.save_kv_layer agrees on failed loads across TP ranks itself"
    return None


SPECS = (
    AGREEMENT_GROUP.spec(
        "pool_load_agree_step",
        f"{WORKER}.prepare_layerwise_step",
        make_prepare_step,
        precondition=_expects(["self", "metadata"], needs=("process_layer_data",)),
        why="a step's pool loads are noted before the worker changes them (every rank alike)",
        after=("pool_load_report_step",),
    ),
    AGREEMENT_GROUP.spec(
        "pool_load_agree",
        f"{WORKER}.save_kv_layer",
        make_save_kv_layer,
        precondition=_failed_load.agree_ok,
        fixed_upstream=_upstream_agrees,
        counters=COUNTS.snapshot,
        why="every TP rank learns which requests' pool loads failed on any rank, and drops their saves",
        after=("mamba_worker_release", "load_fail_agree"),  # vllm-ascend <0.27 groups: never both in range
    ),
    AGREEMENT_GROUP.spec(
        "pool_load_agree_drop",
        f"{STORE}.kv_transfer:KVCacheStoreLayerSendingThread._handle_request",
        make_send_handle,
        precondition=_expects(
            ["self", "request"],
            needs=("transfer_tasks = request", "write_results.get(key, 0) or res", "write_finish_keys", "batch_write_finish"),
        ),
        why="the keys the agreement drops are finished as failed by the sending thread",
    ),
)
