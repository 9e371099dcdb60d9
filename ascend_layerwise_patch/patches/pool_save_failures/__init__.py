"""A failed layerwise save costs the keys it wrote, not the engine (vllm-ascend 0.26.0rc1 / 0.30.0rc2).

Target   vllm_ascend...ascend_store.pool_worker: KVCacheStoreLayerSendingThread._handle_request (one
         layer's save item) and ._batch_copy_with_limits (its copy into the pool);
         backend.memcache_backend: MemcacheBackend.batch_write_finish, as that thread calls it.
Versions vllm-ascend 0.26.0rc1 and 0.30.0rc2 (``ASCEND_026_030``). 0.25.1rc1 does not stop: its thread
         records a failed copy's result per key and finishes those keys as failed (with
         ``send_integrity_copy`` for a copy that raises).
Why      Both releases raise in the layer sending thread when a save copy returns non-zero or raises,
         and when MemCache answers a key's write finish with non-zero. The thread ends and the worker
         raises at its next save: the engine stops on every TP rank. A full pool does both in normal
         serving on MemCache 1.2.0, the version both pin: MemCache evicts keys an engine is still
         writing, and that engine's next copy returns -3102 (tests/standins/test_memcache_capacity.py
         on the real MemCache). Nothing needs to stop for it: upstream already keeps a failure result
         per key (``write_results``: the first non-zero wins) and hands it to ``batch_write_finish``,
         and MemCache removes a key finished as failed -- a miss for every reader, on every rank
         (a block hits only when every rank's key is there).
How      ``_handle_request`` notes the item's save keys on the thread for the call. A save copy
         (direction 0) that returns non-zero, or raises, gives each of those keys its result (-1 for a
         raise) where the key has none yet, logs a WARNING and answers 0, so the thread goes on and the
         final layer finishes those keys as failed. A write finish that answers non-zero for a key,
         inside that call, means the key is not ready (MemCache removed it or no longer has it): it
         is logged and answered 0 to the thread, whose only use of the answer is to raise. Keys
         given a failure here count in ``pool_keys_failed``.
Removal  When the sending thread keeps a failed copy's result instead of raising (detected: no
         ``if res != 0: raise`` after the save copy in ``_handle_request``).
"""

from __future__ import annotations

import functools
import re
import threading
import time

from ... import pool_events
from ...host import logger
from .._checks import Group
from .._checks import expects as _expects
from .._checks import param_names as _params
from .._checks import source as _source
from .._ranges import ASCEND_026_030
from .._targets import STORE
from .._targets import save_keys as _save_keys

THREAD = f"{STORE}.pool_worker:KVCacheStoreLayerSendingThread"
BACKEND = f"{STORE}.backend.memcache_backend:MemcacheBackend"
RAISED = -1  #: the write result of keys whose copy raised (non-zero: finished as failed)
_KEYS = "_ascend_layerwise_patch_save_keys"  # sending thread: the save keys of the item it handles
WARN_EVERY_S = 60.0  #: a full pool fails many copies: one WARNING per this many seconds, the rest DEBUG
_warned = {"at": None, "quiet": 0}
_warned_lock = threading.Lock()


def _warn(msg: str, *args) -> None:
    """A WARNING, at most one per ``WARN_EVERY_S`` (saying how many were held back); DEBUG between."""
    now = time.monotonic()
    with _warned_lock:
        if _warned["at"] is not None and now - _warned["at"] < WARN_EVERY_S:
            _warned["quiet"] += 1
            quiet = -1
        else:
            quiet, _warned["at"], _warned["quiet"] = _warned["quiet"], now, 0
    if quiet < 0:
        logger().debug(msg, *args)
    else:
        logger().warning(msg + (" (%d more such since the last warning)" if quiet else ""), *args, *((quiet,) if quiet else ()))


def make_handle_request(original):
    @functools.wraps(original)
    def _handle_request(self, request):  # 0.30: a list of layer tasks, or a revoke task
        self.__dict__[_KEYS] = _save_keys(request) if isinstance(request, list) else []
        try:
            return original(self, request)
        finally:
            self.__dict__.pop(_KEYS, None)

    return _handle_request


def _fail_keys(thread, result: int) -> int:
    """Give the keys of the item ``thread`` handles ``result`` where they have none; how many got it."""
    results = thread.write_results
    fresh = [k for k in thread.__dict__.get(_KEYS, ()) if not results.get(k)]
    for key in fresh:
        results[key] = result
    if fresh:
        pool_events.bump("pool_keys_failed", len(fresh))
    return len(fresh)


def make_batch_copy(original):
    @functools.wraps(original)
    def _batch_copy_with_limits(self, gvas, addrs, sizes, direction, *args, **kwargs):
        if direction != 0 or _KEYS not in self.__dict__:
            return original(self, gvas, addrs, sizes, direction, *args, **kwargs)
        try:
            res = original(self, gvas, addrs, sizes, direction, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- any raise of the store's copy: its keys fail, the thread goes on
            n = _fail_keys(self, RAISED)
            _warn("ascend_layerwise_patch: layerwise save copy raised %r: %d pool key(s) finished as failed, serving goes on", exc, n)
            return 0
        if res != 0:
            n = _fail_keys(self, res)
            _warn("ascend_layerwise_patch: layerwise save copy failed (%d): %d pool key(s) finished as failed, serving goes on", res, n)
            return 0
        return res

    return _batch_copy_with_limits


def make_write_finish(original):
    @functools.wraps(original)
    def batch_write_finish(self, keys, results):
        answers = original(self, keys, results)
        if _KEYS not in threading.current_thread().__dict__ or answers is None or len(answers) != len(keys):
            return answers
        gone = sorted({str(a) for a in answers if a != 0})
        if not gone:
            return answers
        # a key finished as written that MemCache no longer has is one more key not published
        lost = sum(1 for a, r in zip(answers, results) if a != 0 and r == 0)
        if lost:
            pool_events.bump("pool_keys_failed", lost)
        _warn(
            "ascend_layerwise_patch: MemCache did not finish %d of %d pool key(s) (%s): they are not ready, serving goes on",
            sum(1 for a in answers if a != 0), len(keys), ", ".join(gone),
        )
        return [0] * len(answers)

    return batch_write_finish


def _keeps_failed_copies(_original) -> str | None:
    """Fixed upstream: the layer sending thread no longer raises on a failed save copy."""
    import importlib

    thread = importlib.import_module(f"{STORE}.kv_transfer").KVCacheStoreLayerSendingThread
    if not re.search(r"if res != 0:\s*raise ", _source(vars(thread)["_handle_request"])):
        return "vllm-ascend's layer sending thread keeps a failed save copy's result instead of raising"
    return None


GROUP = Group(
    "pool_save_failures",
    ASCEND_026_030,
    risk="a failed or raising layerwise save copy, or a key MemCache did not finish (a full pool on MemCache 1.2.0), stops the engine",
    why="a failed layerwise save finishes its keys as failed and serving goes on",
    fixed_upstream=_keeps_failed_copies,
)

def _handle_ok(original) -> str | None:
    params = _params(original)
    if params not in (["self", "transfer_tasks"], ["self", "request"]):  # 0.26 / 0.30
        return f"KVCacheStoreLayerSendingThread._handle_request parameters are {params}"
    missing = [n for n in ("_batch_copy_with_limits", "write_results.get(key, 0) or res", "batch_write_finish") if n not in _source(original)]
    return f"KVCacheStoreLayerSendingThread._handle_request no longer uses {', '.join(missing)}" if missing else None


def _copy_ok(original) -> str | None:
    params = _params(original)[:5]
    return None if params == ["self", "gvas", "addrs", "sizes", "direction"] else f"_batch_copy_with_limits parameters start {params}"


SPECS = (
    GROUP.spec("pool_save_failures_item", f"{THREAD}._handle_request", make_handle_request,
               precondition=_handle_ok,
               after=("mamba_thread_marker", "load_fail_drop_saves", "load_fail_agree_drop")),
    GROUP.spec("pool_save_failures_copy", f"{THREAD}._batch_copy_with_limits", make_batch_copy,
               precondition=_copy_ok, after=("send_integrity_copy",)),
    GROUP.spec("pool_save_failures_finish", f"{BACKEND}.batch_write_finish", make_write_finish,
               precondition=_expects(["self", "keys", "results"])),
)
