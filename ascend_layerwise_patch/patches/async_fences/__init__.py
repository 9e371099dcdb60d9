"""Async scheduling: a block a step still writes is never a layerwise load's target.

Target   vllm.v1.core.sched.async_scheduler.AsyncScheduler.__init__ (vllm-ascend's async schedulers
         inherit it). Only async scheduling runs two batches at once here: pipeline parallelism,
         the other way, is refused with the layerwise pool (``pool_key_layout``). Not
         ``scheduler.Scheduler``: vllm-ascend 0.25.1rc1 rebinds that name to its BalanceScheduler.
Versions vLLM >=0.25.0,<0.27; vllm-ascend >=0.25.1,<0.27 (same consumer-only check and same ungated
         current-layer load in vLLM 0.26.0 / vllm-ascend 0.26.0rc1). Member ``async_free_fence_030``: vLLM
         0.29 / 0.30 with vllm-ascend 0.30.0rc2 -- vLLM still defers for kv_consumer only (its free path
         asks ``_request_blocks_can_be_freed``, which reads the fence), vllm-ascend 0.30 still gives the
         current layer's load no gate, and vLLM 0.30's KV cache groups overlay one allocation, so block b
         of an attention layer can be the bytes of block b of a GDN layer: a pool hit's GDN state loaded
         into a block an aborted request's in-flight attention write then lands on.
Why      With overlapping batches (async scheduling, vLLM 0.25's default) a finished or aborted
         request's blocks are freed while the step scheduled before that is known may still be
         writing them. vLLM fences that with ``defer_block_free`` (frees are held until the step
         that last wrote the blocks is processed), but turns it on only for ``is_kv_consumer``
         roles. AscendStore's pool scheduler answers pool hits for ``kv_producer`` too, and
         vllm-ascend's ``KVPoolWorker._submit_ready_layer_loads`` gives the current layer's load
         no ``attention_start_gate`` (every load with ``layerwise_prefetch_layers=1``): the copy
         starts at once, unordered against the compute stream. So on a kv_producer a pool hit can
         get the freed block as its load target and the in-flight step's write lands on the
         loaded bytes (GDN state / attention KV of the wrong request).
How      After vLLM's own ``__init__``, a scheduler whose connector is a layerwise AscendStore
         connector and that runs more than one batch at once (``max_concurrent_batches > 1``)
         gets ``defer_block_free = True`` -- vLLM's own fence, for the role it leaves out. Nothing
         else changes; a scheduler upstream already defers for is left alone.
Removal  When vLLM defers for every role that loads (detected: the upstream condition, evaluated
         for a kv_producer with two batches in flight, already turns the fence on).
"""

from __future__ import annotations

import ast
import functools
import importlib
import types

from ...host import logger
from .._checks import Group
from .._ranges import V025_026, V029_030
from .._targets import STORE
from .._checks import syntax_tree as _syntax_tree

ASYNC = "vllm.v1.core.sched.async_scheduler"
CONNECTOR = f"{STORE}.ascend_store_connector"

_COUNTS = {"schedulers_fenced": 0}


def counters() -> dict[str, int]:
    return dict(_COUNTS)


def _self_attrs(node, *, stored: bool) -> set[str]:
    ctx = ast.Store if stored else ast.Load
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ctx) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }


def _fence_init():
    """The ``__init__`` in AsyncScheduler's MRO that sets the fence (vLLM's Scheduler: vllm-ascend
    may rebind ``scheduler.Scheduler`` to its own subclass, so it is found by what it does)."""
    cls = importlib.import_module(ASYNC).AsyncScheduler
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        tree = _syntax_tree(init) if init is not None else None
        if tree is not None and "defer_block_free" in _self_attrs(tree, stored=True):
            return init, tree
    return None, None


def _reads(cls, name: str, *attrs: str) -> bool:
    """Some definition of ``name`` in ``cls``'s MRO reads every one of ``attrs``."""
    for klass in cls.__mro__:
        fn = klass.__dict__.get(name)
        tree = _syntax_tree(fn) if fn is not None else None
        if tree is not None and set(attrs) <= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}:
            return True
    return False


def _precondition(original) -> str | None:
    """The scheduler still sets the fence's state, and its free / update / schedule paths read it."""
    init, tree = _fence_init()
    if tree is None:
        return "no __init__ in AsyncScheduler's classes sets defer_block_free"
    missing = {"sched_step_seq", "processed_step_seq", "deferred_frees"} - _self_attrs(tree, stored=True)
    if missing:
        return f"{init.__qualname__} no longer sets {sorted(missing)}"
    cls = importlib.import_module(ASYNC).AsyncScheduler
    readers = {"_free_request_blocks": "last_sched_seq", "update_from_output": "_drain_deferred_frees", "_update_after_schedule": "last_sched_seq"}
    for name, also in readers.items():
        if not _reads(cls, name, "defer_block_free", also) and not (name == "_free_request_blocks" and _asks_whether_freeable(cls)):
            return f"Scheduler.{name} no longer reads defer_block_free / {also}"
    return None


def _asks_whether_freeable(cls) -> bool:
    """vLLM 0.29 / 0.30: ``_free_request_blocks`` asks ``_request_blocks_can_be_freed``, which reads the fence."""
    return _reads(cls, "_request_blocks_can_be_freed", "defer_block_free", "last_sched_seq") and _reads(
        cls, "_free_request_blocks", "_request_blocks_can_be_freed"
    )


def _fence_condition(tree):
    """(the ``if`` that sets ``self.defer_block_free = True``, the statements before it in its block)."""
    for node in ast.walk(tree):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i, stmt in enumerate(block):
                if not isinstance(stmt, ast.If):
                    continue
                sets = [
                    s
                    for s in stmt.body
                    if isinstance(s, ast.Assign)
                    and any(isinstance(t, ast.Attribute) and t.attr == "defer_block_free" for t in s.targets)
                    and isinstance(s.value, ast.Constant)
                    and s.value.value is True
                ]
                if sets:
                    return stmt.test, block[:i]
    return None, None


def _fixed_upstream(original) -> str | None:
    """Upstream's own condition, evaluated for a kv_producer with two batches in flight."""
    _, tree = _fence_init()
    test, before = _fence_condition(tree) if tree is not None else (None, None)
    if test is None:
        return None  # no conditional fence to evaluate: the precondition decides
    try:
        from vllm.config import KVTransferConfig

        kv = KVTransferConfig(kv_connector="AscendStoreConnector", kv_role="kv_producer")
        ns = types.SimpleNamespace
        scope = {"self": ns(vllm_config=ns(max_concurrent_batches=2, kv_transfer_config=kv)), "kv_transfer_config": kv}
        locals_ = [s for s in before if isinstance(s, ast.Assign) and all(isinstance(t, ast.Name) for t in s.targets)]
        for stmt in locals_:  # e.g. multiple_inflight_batches = self.vllm_config.max_concurrent_batches > 1
            exec(compile(ast.Module(body=[stmt], type_ignores=[]), "<fence>", "exec"), {}, scope)
        fenced = eval(compile(ast.Expression(body=test), "<fence>", "eval"), {}, scope)
    except Exception:  # noqa: BLE001 -- a condition we cannot evaluate here: not proven fixed
        return None
    if fenced:
        return "vLLM's scheduler already defers block frees for a kv_producer with batches in flight"
    return None


def _loads_layerwise(connector) -> bool:
    try:
        cls = importlib.import_module(CONNECTOR).AscendStoreConnector
    except ImportError:
        return False
    return isinstance(connector, cls) and bool(getattr(connector, "use_layerwise", False))


def make_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.defer_block_free or self.connector is None or self.vllm_config.max_concurrent_batches <= 1:
            return
        if not _loads_layerwise(self.connector):
            return
        self.defer_block_free = True
        _COUNTS["schedulers_fenced"] += 1
        role = self.vllm_config.kv_transfer_config.kv_role
        logger().info(
            "ascend_layerwise_patch: deferring block frees while a step is in flight (%s, %d batches): "
            "a layerwise pool load never targets a block an in-flight step still writes",
            role,
            self.vllm_config.max_concurrent_batches,
        )

    return __init__


GROUP = Group(
    "async_fences",
    V025_026,
    why="defers block frees while a step is in flight for layerwise AscendStore roles that load "
    "(vLLM does it for kv_consumer only): a pool-hit load never targets a block the step still writes",
    precondition=_precondition,
    risk="a kv_producer's pool-hit load can target a block an in-flight step still writes",
    fixed_upstream=_fixed_upstream,
    counters=counters,
    ported_to=((V029_030, "member async_free_fence_030 (the same fence, on vLLM 0.29 / 0.30's scheduler)"),),
)

SPECS = (
    GROUP.spec("async_free_fence", f"{ASYNC}:AsyncScheduler.__init__", make_init),
    # vLLM 0.29 / 0.30 + vllm-ascend 0.30.0rc2: vLLM still defers for kv_consumer only (its free path asks
    # _request_blocks_can_be_freed now), vllm-ascend still loads the current layer ungated
    # (tests/standins/test_async_fences.py runs on v0300)
    GROUP.spec("async_free_fence_030", f"{ASYNC}:AsyncScheduler.__init__", make_init, ranges=V029_030, after=("async_free_fence",)),
)
