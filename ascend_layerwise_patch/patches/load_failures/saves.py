"""Group ``load_failures_saves``: the pool keys a step whose load failed saves are finished as
failed, never ready (the sending thread's final layer), and so are the request's saves in the steps
scheduled before its rollback reaches the worker. The package docstring says why."""

from __future__ import annotations

import functools
import importlib

from ... import pool_events
from ...host import logger
from .._targets import STORE
from .._checks import expects as _expects
from .._checks import source as _source
from ._common import _POISONED, _TAINTED, DROPPED, SAVES_GROUP, poison_sharing


def make_send_handle(original):
    """The layer sending thread: at the step's final layer (where upstream finishes every save key
    with ``write_results.get(key, 0) or res``), the save keys of requests whose load failed this
    step get a failed result first, so they are finished as failed, never ready. In the thread
    itself, before upstream's finish: no race with its own ``write_results`` updates."""

    @functools.wraps(original)
    def _handle_request(self, transfer_tasks):
        if isinstance(transfer_tasks, list) and transfer_tasks:
            first = transfer_tasks[0]
            if getattr(first, "layer_id", None) == self.final_layer_id:
                dropped: dict[str, None] = {}
                for task in transfer_tasks:
                    for rng in getattr(task, "block_ranges", ()):
                        meta = rng.request
                        if meta.__dict__.get(_POISONED) and meta.save_keys:
                            dropped.update(dict.fromkeys(meta.save_keys))
                if dropped:
                    results = self.write_results
                    new = [key for key in dropped if not results.get(key)]  # not already failed
                    for key in new:
                        results[key] = DROPPED
                    pool_events.bump("pool_keys_failed", len(new))
                    logger().warning(
                        "ascend_layerwise_patch: %d pool key(s) saved in a step whose layerwise load failed "
                        "are finished as failed (not published)",
                        len(dropped),
                    )
        return original(self, transfer_tasks)

    return _handle_request


def make_start_load_kv(original):
    """A request whose load failed keeps computing on the unloaded state in every step scheduled
    before the scheduler rolled it back (async scheduling: the next step is in flight): its saves
    there are dropped too, until its preemption (``load_failures_rollback``) or end reaches the worker."""

    @functools.wraps(original)
    def start_load_kv(self, metadata):
        tainted = self.__dict__.get(_TAINTED)
        if tainted:
            ended = set(getattr(metadata, "preempted_req_ids", None) or ())
            unfinished = getattr(metadata, "unfinished_request_ids", None)
            for req_id in [r for r in tainted if r in ended or (unfinished is not None and r not in unfinished)]:
                del tainted[req_id]  # its preemption (or end) reached the worker: vLLM evicted its blocks
            requests = getattr(metadata, "requests", ())
            for meta in requests:
                if meta.req_id in tainted:
                    meta.__dict__[_POISONED] = True
            poison_sharing(self, requests, "scheduled before its rollback")
        return original(self, metadata)

    return start_load_kv


def _send_ok(original) -> str | None:
    problem = _expects(
        ["self", "transfer_tasks"],
        needs=("write_results.get(key, 0) or res", "final_layer_id", "batch_write_finish", "save_keys"),
    )(original)
    if problem:
        return problem
    fields = getattr(importlib.import_module(f"{STORE}.config_data").ReqMeta, "__annotations__", {})
    if "save_keys" not in fields:
        return "ReqMeta no longer has save_keys"
    return None


def _upstream_drops_saves(original) -> str | None:
    if "invalid_block" in _source(original) or "load_failed" in _source(original):
        return "KVCacheStoreLayerSendingThread drops the saves of failed loads itself"
    return None


def _upstream_drops_later_saves(_original) -> str | None:
    thread = importlib.import_module(f"{STORE}.kv_transfer").KVCacheStoreLayerSendingThread
    return _upstream_drops_saves(vars(thread)["_handle_request"])


SPECS = (
    SAVES_GROUP.spec(
        "load_fail_drop_saves",
        f"{STORE}.pool_worker:KVCacheStoreLayerSendingThread._handle_request",
        make_send_handle,
        precondition=_send_ok,
        fixed_upstream=_upstream_drops_saves,
        why="the pool keys a request saves in a step whose layerwise load failed are finished as failed, never ready",
        risk="keys computed from unloaded state are published as ready: every later pool hit reads them",
        after=("mamba_thread_marker",),  # mamba_lifetime's wrapper of this target is applied first
    ),
    SAVES_GROUP.spec(
        "load_fail_drop_later_saves",
        f"{STORE}.pool_worker:KVPoolWorker.start_load_kv",
        make_start_load_kv,
        precondition=_expects(["self", "metadata"], needs=("process_layer_data",)),
        fixed_upstream=_upstream_drops_later_saves,
        why="a request whose load failed saves nothing until its rollback reaches the worker (async scheduling)",
        risk="keys computed from unloaded state in the step after the failure are published as ready",
        after=("mamba_worker_events",),  # mamba_lifetime's wrapper of this target is applied first
    ),
)
