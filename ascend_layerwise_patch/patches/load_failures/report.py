"""Group ``load_failures``: a failed, raising or late layerwise load is reported to vLLM (worker:
the receiving thread and ``wait_for_layer_load``; scheduler: the invalid blocks of every KV cache
group of a hybrid request). The package docstring says why and how."""

from __future__ import annotations

import functools
import importlib
import threading

from ... import pool_events
from .. import _failed_load
from ...host import logger
from .._targets import STORE
from .._checks import expects as _expects
from .._checks import source as _source
from ._common import _FAILED_COPY, _POISONED, _RECV, _STEP, GROUP, _as_scheduled, taint


class _Recv:
    """What the receiving thread tells the worker: blocks of failed copies, and whether it is inside one."""

    __slots__ = ("lock", "failed", "idle")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.failed: set[int] = set()
        self.idle = threading.Event()  # set whenever the thread is not inside a copy (wakes the fence)
        self.idle.set()

    def take(self) -> set[int]:
        with self.lock:
            failed, self.failed = self.failed, set()
        return failed


class _Step:
    """The worker's view of this step's loads."""

    __slots__ = ("blocks", "req_ids", "keys", "late", "metas", "req_blocks")

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.req_ids: set[str] = set()
        self.keys: list[str] = []
        self.late = False  # a wait timed out; the receiving thread may still run an old copy
        self.metas: dict[str, list] = {}  # req id -> this step's ReqMeta(s) (its saves are read from them)
        self.req_blocks: dict[str, set[int]] = {}  # req id -> blocks its loads write


def _recv(thread) -> _Recv:
    state = thread.__dict__.get(_RECV)
    if state is None:
        state = thread.__dict__.setdefault(_RECV, _Recv())
    return state


def _task_blocks(task) -> set[int]:
    """The blocks a load task writes (never the null block, which vLLM never counts as computed)."""
    shared = task.shared_block_data
    return set() if shared is None else {int(b) for b in shared.block_ids_arr} - {0}


def make_batch_copy(original):
    @functools.wraps(original)
    def _batch_copy_with_limits(self, gvas, addrs, sizes, direction, max_transfer_blocks, max_transfer_bytes):
        try:
            res = original(self, gvas, addrs, sizes, direction, max_transfer_blocks, max_transfer_bytes)
        except Exception as exc:  # noqa: BLE001 - a raising store is a failed copy
            logger().error("ascend_layerwise_patch: layerwise load batch_copy raised %r; reported as failed", exc)
            res = -1
            pool_events.bump("load_raised")
        else:
            if res != 0:
                pool_events.bump("load_failed")
        if res != 0:
            self.__dict__[_FAILED_COPY] = res
        return res

    return _batch_copy_with_limits


def make_recv_handle(original):
    @functools.wraps(original)
    def _handle_request(self, data):
        state = _recv(self)
        blocks = set().union(*(_task_blocks(t) for t in data.transfer_tasks))  # before the thread clears them
        self.__dict__.pop(_FAILED_COPY, None)
        state.idle.clear()
        try:
            return original(self, data)
        finally:
            if self.__dict__.pop(_FAILED_COPY, None) is not None and blocks:
                with state.lock:
                    state.failed |= blocks
            state.idle.set()

    return _handle_request


def _report(worker, blocks: set[int]) -> None:
    if blocks:
        with worker._invalid_block_ids_lock:
            worker._invalid_block_ids.update(blocks)
        _drop_saves(worker, blocks)


def _drop_saves(worker, blocks: set[int]) -> None:
    """The requests whose loads wrote ``blocks`` compute this step on state that was never loaded:
    mark their ReqMeta s, so that the sending thread finishes the step's save keys of those
    requests as failed (:func:`make_send_handle`) instead of publishing them as ready. Runs in
    ``wait_for_layer_load``, before the step's final layer is queued for saving."""
    step = worker.__dict__.get(_STEP)
    if step is None:
        return
    for req_id, loaded in step.req_blocks.items():
        if loaded & blocks:
            # under async scheduling the next step is already scheduled on this state: taint the
            # request until the scheduler's preemption of it reaches this worker (make_start_load_kv)
            for meta in step.metas.get(req_id, ()):
                meta.__dict__[_POISONED] = True
                taint(worker, meta)


def _begin_step(worker) -> _Step:
    """First wait of a step (nothing submitted yet): note what the step's loads cover, and report
    the blocks no copy will write (their GVA lookup or lease failed before the copy)."""
    old = worker.__dict__.get(_STEP)
    step = _Step()
    step.late = old is not None and old.late
    worker.__dict__[_STEP] = step
    recv = worker.kv_recv_thread
    builders = getattr(recv, "group_builders", None)
    unloadable: set[int] = set()
    for tasks in worker.layer_load_tasks:
        for task in tasks:
            copied = _task_blocks(task)
            step.blocks |= copied
            if task.shared_block_data is not None:
                step.keys.extend(task.shared_block_data.load_keys)
            builder = builders[task.group_id] if builders else recv.layer_batch_builder
            for rng in task.block_ranges:
                req_id = rng.request.req_id
                step.req_ids.add(req_id)
                metas = step.metas.setdefault(req_id, [])
                if all(m is not rng.request for m in metas):
                    metas.append(rng.request)
                block_ids, _gvas = builder._require_request_arrays(rng, is_save=False)
                wanted = {int(b) for b in block_ids[rng.start_block : rng.end_block]}
                if rng.partial_block_index is not None:
                    wanted.add(int(block_ids[rng.partial_block_index]))
                step.req_blocks.setdefault(req_id, set()).update(wanted - {0})
                unloadable |= wanted - copied - {0}
    step.keys = list(dict.fromkeys(step.keys))
    step.blocks |= unloadable
    if unloadable:
        logger().warning(
            "ascend_layerwise_patch: layerwise load of requests %s has blocks no copy will write %s; "
            "reported to the scheduler", sorted(step.req_ids), sorted(unloadable)
        )
    _report(worker, unloadable)
    return step


def _abandon(worker, step: _Step) -> None:
    """Report every block of this step's loads, stop the ones still queued, release their leases."""
    _report(worker, step.blocks)
    for tasks in worker.layer_load_tasks:
        tasks.clear()  # a queued LayerLoadTask holding this list now finds nothing to copy
    worker.layer_load_tasks = [[] for _ in range(worker.num_layers)]  # the thread keeps the old lists
    if step.keys:
        worker.m_store.batch_remove_lease(step.keys)
    step.blocks, step.keys = set(), []
    step.late = True


def _fence(worker, recv, state: _Recv) -> None:
    """The late-copy fence (``_failed_load.late_copy_fence``: why, and how the TP ranks agree on it),
    in the step after a load was abandoned, before the step writes anything (``start_load_kv``, and
    again at its first layer's wait)."""
    _failed_load.late_copy_fence(worker, recv, wake=state.idle)


def _fence_owed(worker, step) -> bool:
    """A load was abandoned (on this rank: ``step.late``; on any rank: the agreement's mark), so the
    next step passes the fence first. One rule for both places that fence."""
    return bool((step is not None and step.late) or worker.__dict__.get(_failed_load.LATE_ANYWHERE))


def make_fence_first(original):
    """``start_load_kv`` that, in the step after a load was abandoned, passes the late-copy fence
    first. The runner's bulk mamba pre-copy (the rows with no load this step) writes this step's
    blocks right after ``start_load_kv``, before the first layer's wait where :func:`make_wait`'s
    fence runs: a late copy landing between the two overwrote a block vLLM had just given another
    request (pool harness: request c's GDN state read 'other' after b's gated load timed out, once
    in a loaded CI run). The wait's own fence then finds the thread idle."""

    @functools.wraps(original)
    def start_load_kv(self, metadata):
        recv = self.kv_recv_thread
        if _fence_owed(self, self.__dict__.get(_STEP)) and self.use_gva_layerwise and recv is not None:
            _fence(self, recv, _recv(recv))
        return original(self, metadata)

    return start_load_kv


def make_wait(original):
    names = original.__globals__

    @functools.wraps(original)
    def wait_for_layer_load(self):
        if not self.use_gva_layerwise or self.kv_recv_thread is None:
            return original(self)  # Mooncake's key-based layerwise path: not this patch's
        if self.current_layer >= self.num_layers:
            return
        recv = self.kv_recv_thread
        state = _recv(recv)
        if self.next_layer_to_submit == 0 and self.current_layer == 0:
            step = _begin_step(self)
            if _fence_owed(self, step):
                _fence(self, recv, state)
                for event in self.layer_load_finished_events:
                    event.clear()  # sets left by late or abandoned loads of earlier steps
                state.take()  # already reported with their step
                step.late = False
        step = self.__dict__.get(_STEP)
        if step is None:  # the step's first layer never waited here (a GDN layer without gdn_layerwise)
            return original(self)
        if step.late:
            return  # this step's loads were abandoned (or never attempted): nothing to wait for
        layer = self.current_layer
        names["reset_attention_compute_start_gate"]()
        self._submit_ready_layer_loads()
        event = self.layer_load_finished_events[layer]
        if not self.layer_load_tasks[layer]:
            event.clear()
            _report(self, state.take())
            return
        wait_s = _failed_load.WAIT_S  # one setting, read at call time (upstream's timeout; tests shorten it)
        if event.wait(timeout=wait_s):
            event.clear()
            _report(self, state.take())
            return
        pool_events.bump("load_late")
        logger().warning(
            "ascend_layerwise_patch: layerwise load of layer %d timed out after %.0f s (requests %s); "
            "the step's loads are reported to the scheduler and the rest of them abandoned",
            layer,
            wait_s,
            sorted(step.req_ids),
        )
        _report(self, state.take())
        _abandon(self, step)

    return wait_for_layer_load


def _resume_point(specs, block_ids, invalid: set[int], computed: int, mamba_cls) -> int | None:
    """Tokens every group can resume from when some of ``computed`` tokens sit in invalid blocks;
    ``None`` if none of them does."""
    bound, affected = computed, False
    for spec, ids in zip(specs, block_ids):
        size = spec.block_size
        for idx, block in enumerate(ids[: -(-computed // size)]):
            if block in invalid:  # it, and everything computed from it, must be recomputed
                affected = True
                bound = min(bound, idx * size)
                break
    if not affected:
        return None
    mamba = [(spec.block_size, ids) for spec, ids in zip(specs, block_ids) if isinstance(spec, mamba_cls)]
    step = 1
    for spec in specs:
        step = step * spec.block_size // _gcd(step, spec.block_size)
    point = bound // step * step
    while point > 0:
        if all(_state_ok(ids, point // size - 1, invalid) for size, ids in mamba):
            return point
        point -= step
    return 0


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _state_ok(ids, idx: int, invalid: set[int]) -> bool:
    return idx < len(ids) and ids[idx] != 0 and ids[idx] not in invalid


def make_update_invalid(original):
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    mamba_cls = interface.MambaSpec

    def _group_spec(group):
        spec = group.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        return next(iter(inner.values())) if inner else spec

    @functools.wraps(original)
    def _update_requests_with_invalid_blocks(
        self, requests, invalid_block_ids, num_scheduled_tokens, evict_blocks=True
    ):
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) <= 1:
            return original(self, requests, invalid_block_ids, num_scheduled_tokens, evict_blocks)
        specs = [_group_spec(g) for g in groups]
        affected: set[str] = set()
        total = 0
        evict: set[int] = set()
        for request in requests:
            req_id = request.request_id
            block_ids = self.kv_cache_manager.get_block_ids(req_id)
            computed = request.num_computed_tokens - num_scheduled_tokens.get(req_id, 0)
            recorded = _as_scheduled(request, num_scheduled_tokens)  # async: as the failed step saw it
            if recorded is not None:
                computed, block_ids = recorded
            point = _resume_point(specs, block_ids, invalid_block_ids, computed, mamba_cls)
            if point is None:
                continue
            request.num_computed_tokens = point
            total += computed - point
            affected.add(req_id)
            if evict_blocks:
                for spec, ids in zip(specs, block_ids):
                    evict.update(b for b in ids[point // spec.block_size :] if b != 0)
        return affected, total, evict

    return _update_requests_with_invalid_blocks


def _upstream_reports(_original) -> str | None:
    kv_transfer = importlib.import_module(f"{STORE}.kv_transfer")
    source = _source(kv_transfer.KVCacheStoreLayerRecvingThread._handle_request)
    if "invalid_block" in source or "raise RuntimeError" in source:
        return "KVCacheStoreLayerRecvingThread reports (or raises on) failed loads itself"
    return None


def _upstream_hybrid(original) -> str | None:
    if "(req_block_ids,) =" not in _source(original):
        return "Scheduler._update_requests_with_invalid_blocks no longer unpacks a single KV cache group"
    return None


def _wait_ok(original) -> str | None:
    problem = _expects(
        ["self"],
        needs=(
            "layer_load_finished_events",
            "_submit_ready_layer_loads",
            "reset_attention_compute_start_gate",
            "timeout=10",
        ),
        globals_=("reset_attention_compute_start_gate",),
    )(original)
    if problem:
        return problem
    worker = original.__globals__["KVPoolWorker"]
    for name in ("_invalid_block_ids_lock", "layer_load_tasks", "next_layer_to_submit"):
        if name not in _source(worker):
            return f"KVPoolWorker no longer has {name}"
    return None


def _recv_ok(original) -> str | None:
    problem = _expects(["self", "data"], needs=("transfer_tasks", "_batch_copy_with_limits", "task_done"))(original)
    if problem:
        return problem
    builder = importlib.import_module(f"{STORE}.kv_transfer").LayerBatchBuilder
    if not callable(getattr(builder, "_require_request_arrays", None)):
        return "LayerBatchBuilder._require_request_arrays is gone"
    return None


_INVALID = ["self", "requests", "invalid_block_ids", "num_scheduled_tokens", "evict_blocks"]


_COPY = ["self", "gvas", "addrs", "sizes", "direction", "max_transfer_blocks", "max_transfer_bytes"]


SPECS = (
    GROUP.spec(
        "load_fail_copy",
        f"{STORE}.pool_worker:KVCacheStoreLayerRecvingThread._batch_copy_with_limits",
        make_batch_copy,
        precondition=_expects(_COPY, needs=("batch_copy",)),
        fixed_upstream=_upstream_reports,
    ),
    GROUP.spec(
        "load_fail_thread",
        f"{STORE}.pool_worker:KVCacheStoreLayerRecvingThread._handle_request",
        make_recv_handle,
        precondition=_recv_ok,
        fixed_upstream=_upstream_reports,
    ),
    GROUP.spec(
        "load_fail_wait",
        f"{STORE}.pool_worker:KVPoolWorker.wait_for_layer_load",
        make_wait,
        precondition=_wait_ok,
        fixed_upstream=_upstream_reports,
    ),
    GROUP.spec(
        "load_fail_fence_first",
        f"{STORE}.pool_worker:KVPoolWorker.start_load_kv",
        make_fence_first,
        precondition=_expects(["self", "metadata"]),
        fixed_upstream=_upstream_reports,
        after=("mamba_worker_events", "load_fail_drop_later_saves"),
    ),
    GROUP.spec(
        "load_fail_scheduler",
        "vllm.v1.core.sched.scheduler:Scheduler._update_requests_with_invalid_blocks",
        make_update_invalid,
        precondition=_expects(_INVALID, needs=("get_block_ids",)),
        fixed_upstream=_upstream_hybrid,
        # vllm-ascend's patch_balance_schedule rebinds the module's ``Scheduler`` to its subclass;
        # after that the target names the subclass, and this alias the base class every other
        # scheduler (AsyncScheduler, vllm-ascend's own) inherits the method from.
        aliases=("vllm.v1.core.sched.scheduler:Scheduler.__base__._update_requests_with_invalid_blocks",),
    ),
)
