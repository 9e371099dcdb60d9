"""Block lifetime under layerwise sends (issue 24): which request's block each save copy reads
(:class:`BlockOwners`), and workloads whose save copies are held at a gate, fail or raise
(:class:`Lifetime`, :func:`make_lifetime`)."""

from __future__ import annotations

import itertools
import os as _os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import byte_store

from . import timing
from .engine import engine_loop
from .instance import PoolInstance
from .rank import _Rank
from .runtime import _placements, make_pool


ATTN, MAMBA = "attn", "mamba"  # BlockOwners.ever's keys: full-attention and mamba (GDN) groups
_LIFETIME_TOKENS = itertools.count(10_000_000)  # distinct prompt tokens: a block hash names its request


@dataclass
class BadRead:
    """A save copy that read a block its request no longer owns."""

    kind: str  # "foreign" (use-after-free: freed and handed to another request mid-send) | "free" (a free block)
    block_id: int
    reader: str  # the request whose pool key the copy writes
    mark: str | None  # the request the block was last allocated to
    group: int


def _cache_regions(rank: _Rank, num_blocks: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(pid, [(address of block 0, bytes, block stride)]) of the rank's cache memory: one page per
    raw tensor where the groups share it (vLLM <= 0.29); vLLM 0.30 places every tensor's layers in one
    backing allocation (``offset + l * layer_stride``, their own ``block_stride``): one region per layer
    placement (tensors of different groups overlay: the same region)."""
    if not rank.one_backing:
        return _os.getpid(), [(raw.data_ptr(), raw.numel(), raw.numel() // num_blocks) for raw in rank._raw]
    (raw,) = rank._raw  # the groups overlay each other
    regions = {
        (raw.data_ptr() + start, num_blocks * stride, stride)
        for tensor in rank.kv_cache_config.kv_cache_tensors
        for _name, start, stride in _placements(tensor, rank.inst.specs)
    }
    return _os.getpid(), sorted(regions)


def slot_of(inst: PoolInstance, key: str, offset: int, size: int) -> int:
    """The layer slot (index of the layer in its group) a write at ``offset`` of a layerwise key of
    ``size`` bytes lands in: vllm-ascend <= 0.26 sizes a key for its group's layers; 0.30 for every
    physical layer (``_global_group_alloc_size``), the group's layer l at slot l."""
    if KEYS_SIZED_FOR_EVERY_LAYER:
        return offset * len(inst.layer_order) // size
    return offset * len(inst.kv_cache_config.kv_cache_groups[int(key.split("@")[1])].layer_names) // size


def has_a_gap(inst: PoolInstance, key: str, blob) -> bool:
    """A layer slot of ``key``'s group that no successful copy wrote before the key was finished."""
    layers = len(inst.kv_cache_config.kv_cache_groups[int(key.split("@")[1])].layer_names)
    written = {slot_of(inst, key, off, len(blob.data)) for off, _n, t, ok in blob.writes if ok and t <= blob.finished_at}
    return not set(range(layers)) <= written


def ready_with_a_gap(pool, inst: PoolInstance) -> list[str]:
    """The pool's ready keys with a layer slot that no successful copy wrote before the key was finished."""
    return [key for key in pool.ready_keys() if has_a_gap(inst, key, pool.blobs[key])]


def _keys_sized_for_every_layer() -> bool:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import pool_worker

    return hasattr(pool_worker.KVPoolWorker, "_global_group_alloc_size")


KEYS_SIZED_FOR_EVERY_LAYER = _keys_sized_for_every_layer()


#: a sending thread whose backlog has not moved this long, nothing queued, is quiet (a request that
#: raised in it is never done)
QUIET_S = 0.5


def _send_backlog(rank: _Rank) -> tuple[int, int]:
    """(requests queued, requests taken but not done) of the rank's layer sending thread: upstream's
    ``_handle_request`` calls ``task_done`` when it finished a request (one that raised is never
    done: its count stays)."""
    queue = rank.connector.connector_worker.kv_send_thread.request_queue
    return queue.qsize(), queue.unfinished_tasks


class BlockOwners:
    """Use-after-free detector for layerwise sends on one :class:`PoolInstance` with a pool.

    Every block the instance's KVCacheManager allocates to a request is marked with the request's
    id (each group's ``allocate_new_blocks``; ``ever[req][ATTN | MAMBA]`` keeps every block a
    request was given). Every save copy (a byte_store observer: after the copy's gate or delay,
    when it reads) maps each host range back to its block id, and its key (``model@group@hash@rank``)
    to the request whose block hash it names, then compares: a block marked by another request is a
    use-after-free read ("foreign": freed and handed to another request while the send was queued or
    stuck); a block with ``ref_cnt == 0`` is a read of a free block ("free": about to be reused).
    The null block is skipped. ``allocs_while_stuck`` counts allocations made while a gated copy
    (a ``gate`` fault of the pool) was held."""

    def __init__(self, inst: PoolInstance):
        from vllm.v1.kv_cache_interface import MambaSpec

        self.inst, self.pool = inst, inst.pool
        manager = inst.scheduler.kv_cache_manager
        self.block_pool = manager.block_pool
        self.kind_of_group = {
            g: MAMBA if isinstance(grp.kv_cache_spec, MambaSpec) else ATTN
            for g, grp in enumerate(inst.kv_cache_config.kv_cache_groups)
        }
        self.marks: dict[int, str] = {}
        self.ever: dict[str, dict[str, set[int]]] = {}
        self.requests: dict[str, object] = {}  # req id -> vLLM Request (its block hashes grow with decode)
        self._hash_owner: dict[str, str] = {}
        self.violations: list[BadRead] = []
        self.reads = 0
        self.allocs_while_stuck = 0
        self.lock = threading.Lock()
        #: process id -> (start, size, page) of its ranks' cache tensors: a host address of that
        #: process names its block (the ranks as processes have addresses of their own)
        self.regions: dict[int, list[tuple[int, int, int]]] = {}
        for pid, regions in inst.on_ranks(_cache_regions, inst.kv_cache_config.num_blocks):
            self.regions.setdefault(pid, []).extend(regions)
        for g, single in enumerate(manager.coordinator.single_type_managers):
            self._wrap(g, single)
        add = inst.add_request

        def add_request(req_id, prompt, max_tokens=1):
            request = add(req_id, prompt, max_tokens)
            self.requests[req_id] = request
            self.ever[req_id] = {ATTN: set(), MAMBA: set()}
            return request

        inst.add_request = add_request
        inst.pool.observers.append(self._observe)

    def _wrap(self, group: int, single) -> None:
        allocate, kind = single.allocate_new_blocks, self.kind_of_group[group]

        def allocate_new_blocks(request_id, *args, **kwargs):
            blocks = allocate(request_id, *args, **kwargs)
            if blocks:
                if any(f.kind == "gate" and not f.gate.is_set() for f in self.pool.faults):
                    self.allocs_while_stuck += 1
                with self.lock:
                    real = [b.block_id for b in blocks if not b.is_null]  # align mode: nulls for skipped states
                    for b in real:
                        self.marks[b] = request_id  # the block's "content": its owner
                    self.ever.setdefault(request_id, {ATTN: set(), MAMBA: set()})[kind].update(real)
            return blocks

        single.allocate_new_blocks = allocate_new_blocks

    def owner(self, block_hash_hex: str) -> str | None:
        if block_hash_hex not in self._hash_owner:  # a decode block, hashed after the request was added
            for rid, request in list(self.requests.items()):
                for h in request.block_hashes:
                    self._hash_owner.setdefault(h.hex(), rid)
        return self._hash_owner.get(block_hash_hex)

    def block_of(self, addr: int, pid: int) -> int | None:
        for start, size, page in self.regions.get(pid, ()):
            if start <= addr < start + size:
                return (addr - start) // page
        return None

    def _observe(self, direction: int, targets, host) -> None:
        if direction != byte_store.L2G:
            return
        with self.lock:
            for key, _off, addr, _size in targets:
                _model, group, block_hash, *_ = key.split("@")
                reader, block_id = self.owner(block_hash), self.block_of(addr, host.pid)
                if reader is None or not block_id:  # not a request's key, another instance's range, the null block
                    continue
                self.reads += 1
                mark = self.marks.get(block_id)
                if mark != reader:
                    self.violations.append(BadRead("foreign", block_id, reader, mark, int(group)))
                elif self.block_pool.blocks[block_id].ref_cnt <= 0:
                    self.violations.append(BadRead("free", block_id, reader, mark, int(group)))

    def held_blocks(self) -> list[int]:
        """Blocks other than the null block that something still references."""
        return [b.block_id for b in self.block_pool.blocks if not b.is_null and b.ref_cnt > 0]

    def misowned(self) -> list[tuple[str, int, str | None]]:
        """Blocks vLLM lists for an unfinished request that carry another request's mark."""
        sched, bad = self.inst.scheduler, []
        for rid, request in list(sched.requests.items()):
            if request.is_finished():
                continue
            for ids in sched.kv_cache_manager.get_block_ids(rid):
                bad += [(rid, b, self.marks.get(b)) for b in ids if b and self.marks.get(b) != rid]
        return bad


def layer_slot_fault(inst: PoolInstance, layers) -> Callable:
    """An ``at`` for :meth:`byte_store.PoolService.add_fault`: the ranges of the layer slots of the
    physical layers ``layers`` (indices into ``inst.layer_order``) in their groups' keys."""
    groups = inst.kv_cache_config.kv_cache_groups
    wanted = {(inst.group_of[inst.layer_order[i]], groups[inst.group_of[inst.layer_order[i]]].layer_names.index(inst.layer_order[i])) for i in layers}

    def at(key: str, offset: int, size: int) -> bool:
        return (int(key.split("@")[1]), slot_of(inst, key, offset, size)) in wanted

    return at


#: Lifetime.add's behaviours -> byte_store fault kinds (of the request's save copies)
_BEHAVIOURS = {"slow": "gate", "fail": "error", "raise": "raise"}


class Lifetime:
    """Block-lifetime workloads on one :class:`PoolInstance` (with a pool): requests of distinct
    tokens whose save copies behave as planned -- ``fast``; ``slow`` (held at a gate until
    :meth:`release`, ``release_after`` steps, or :meth:`drain`); ``fail`` (the copy returns an
    error); ``raise`` -- on every layer or on the given physical layers; vLLM's own abort
    (``finish_requests``) and preemption (``_preempt_request``, as ``reset_prefix_cache`` preempts);
    :class:`BlockOwners` watching every save copy. ``seed_skip_touch``: the seed change (no touch
    of the mamba blocks a send reads, an instance attribute of the connector's scheduler half)."""

    def __init__(self, inst: PoolInstance, *, seed_skip_touch: bool = False):
        self.inst, self.pool = inst, inst.pool
        self.sched = inst.scheduler
        self.cs = inst.scheduler.connector.connector_scheduler
        if seed_skip_touch:
            self.cs.touch_sending_mamba_blocks = lambda req_meta: None
        self.owners = BlockOwners(inst)
        self.faults: dict[str, byte_store.Fault] = {}
        self.release_at: dict[str, int] = {}
        self.steps = 0
        self.reset()

    def reset(self) -> None:
        """A new workload on the same (idle) instance: faults, records and baselines start afresh."""
        self.pool.clear_faults()
        self.faults.clear()
        self.release_at.clear()
        self.owners.violations.clear()
        self.owners.reads = self.owners.allocs_while_stuck = 0
        self.initial_free = self.owners.block_pool.get_num_free_blocks()
        self.keys_before = set(self.pool.blobs)

    # ------------------------------------------------------------------ requests
    def add(self, req_id: str, prompt_len: int, decode_steps: int = 1, behaviour: str = "fast", release_after=None, layers=None):
        tokens = [next(_LIFETIME_TOKENS) for _ in range(prompt_len)]
        request = self.inst.add_request(req_id, tokens, max_tokens=decode_steps + 1)
        if behaviour != "fast":
            owned = lambda key: key.split("@")[2] in {h.hex() for h in request.block_hashes}  # noqa: E731
            at = None if layers is None else layer_slot_fault(self.inst, layers)
            self.faults[req_id] = self.pool.add_fault(_BEHAVIOURS[behaviour], direction=byte_store.L2G, match=owned, at=at)
        if behaviour == "slow" and release_after is not None:
            self.release_at[req_id] = self.steps + release_after
        return request

    def gate(self, req_id: str) -> threading.Event:
        return self.faults[req_id].gate

    def release(self, req_id: str) -> None:
        """Let a slow request's copies proceed."""
        if req_id in self.faults:
            self.faults[req_id].gate.set()

    def open_all_gates(self) -> None:
        for fault in self.faults.values():
            fault.gate.set()

    def done(self, req_id: str) -> bool:
        return req_id in self.owners.requests and req_id not in self.sched.requests

    def live(self) -> list[str]:
        return [r for r, req in self.sched.requests.items() if not req.is_finished()]

    # ------------------------------------------------------------------ steps
    def step(self, *, abort=(), preempt=()) -> None:
        """One engine step (``PoolInstance.step``; nothing if the engine has no work), after
        aborting / preempting the given requests and opening the gates due."""
        from vllm.v1.request import RequestStatus

        for rid, at in list(self.release_at.items()):
            if at <= self.steps:
                self.release(rid)
                del self.release_at[rid]
        for rid in abort:
            if rid in self.sched.requests:
                self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        preempted = []
        for rid in preempt:
            request = self.sched.requests.get(rid)
            if request is not None and request.status == RequestStatus.RUNNING:
                self.sched.running.remove(request)
                self.sched._preempt_request(request, time.monotonic())  # as reset_prefix_cache preempts
                # as in a step that preempts: reported in this step's preempted_req_ids, not resumed
                # before the next one (vllm-ascend 0.26's connector rejects a same-step resume)
                self.sched.waiting.remove_request(request)
                preempted.append(request)
        if preempted:
            self.sched.has_requests = lambda: True  # the step that reports them runs
            try:
                self.inst.step()
            finally:
                del self.sched.has_requests
                for request in reversed(preempted):
                    self.sched.waiting.prepend_request(request)
        elif self.inst.has_work():
            self.inst.step()
        self.steps += 1

    def drain(self, max_steps: int = 2000) -> None:
        """Open every gate, then run EngineCoreProc's loop until it stops by itself; then wait for
        the sending threads to go quiet (a send the engine no longer steps for still copies)."""
        self.open_all_gates()
        engine_loop(self.inst, max_steps=max_steps)
        # then the sending threads, whatever the scheduler tracks (without the library's touch -- the
        # seed -- it tracks no send at all, and a copy just let through its gate still runs)
        # quiet: nothing queued and nothing taken but not done -- or, where a request raised in the
        # thread (never done), nothing moved for QUIET_S; never longer than GATE_LIMIT_S
        now = time.monotonic()
        deadline, last, since = now + timing.GATE_LIMIT_S, None, now
        while now < deadline:
            backlog = self.inst.on_ranks(_send_backlog)
            if all(queued == 0 and taken == 0 for queued, taken in backlog):
                break
            if backlog != last:
                last, since = backlog, now
            elif all(queued == 0 for queued, _ in backlog) and now - since >= QUIET_S:
                break
            time.sleep(0.005)
            now = time.monotonic()
        engine_loop(self.inst, max_steps=max_steps)

    def close(self) -> None:
        self.open_all_gates()

    # ------------------------------------------------------------------ checks
    @property
    def violations(self) -> list[BadRead]:
        return self.owners.violations

    def held_blocks(self) -> list[int]:
        return self.owners.held_blocks()

    def leaked(self) -> int:
        return self.initial_free - self.owners.block_pool.get_num_free_blocks()

    def new_keys(self) -> list[str]:
        return [k for k in self.pool.blobs if k not in self.keys_before]

    def stale_ready(self) -> list[str]:
        """This workload's keys finished ready while a layer slot was unwritten (by a copy that
        returned 0 before the finish)."""
        with self.pool.lock:
            blobs = self.pool.blobs
            return [key for key in self.new_keys() if blobs[key].state == "ready" and has_a_gap(self.inst, key, blobs[key])]

    def finished(self) -> dict[str, int]:
        """This workload's finished keys and their results."""
        with self.pool.lock:
            return {k: self.pool.blobs[k].result for k in self.new_keys() if self.pool.blobs[k].state != "writing"}

    def unfinished(self) -> list[str]:
        """This workload's keys allocated but never finished (MemCache keeps them invisible)."""
        with self.pool.lock:
            return [k for k in self.new_keys() if self.pool.blobs[k].state == "writing"]


def make_lifetime(
    *, tp: int = 1, num_blocks: int = 16, chunk: int = 8, seed_skip_touch: bool = False, max_model_len: int | None = None
) -> Lifetime:
    """A :class:`Lifetime` on a fresh pool and instance shaped for block-lifetime workloads: 4-token
    blocks (prompts of 4-24 tokens span 1-6 blocks), ``num_blocks`` in the KV cache (small: freed
    blocks are soon handed out again), ``chunk`` prefill tokens per request and step, kv_producer
    (saves only), save_kv_layer's 10 s wait scaled to 30 ms."""
    inst = PoolInstance(
        make_pool(),
        tp=tp,
        kv_heads=2,
        block_size=4,
        num_blocks=num_blocks,
        kv_role="kv_producer",
        max_num_batched_tokens=64,
        long_prefill_token_threshold=chunk,
        # as long as the cache allows (vLLM checks it; 0.30 allows 20 on 8 blocks); 128 as test_send_pool's
        # instances (one model config)
        max_model_len=max_model_len or (24 if num_blocks < 10 else 28 if num_blocks < 48 else 128),
    )
    inst.scale_save_wait()
    return Lifetime(inst, seed_skip_touch=seed_skip_touch)
