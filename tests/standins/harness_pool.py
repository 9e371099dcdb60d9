"""CPU harness for the lifetime of blocks read by vllm-ascend's layerwise KV pool sends.

Real objects: vLLM's ``BlockPool``, ``Request``, ``SchedulerOutput`` / ``NewRequestData`` /
``CachedRequestData`` / ``KVConnectorOutput``; vllm-ascend's ``KVPoolScheduler`` and ``KVPoolWorker``
methods (``build_connector_meta``, ``update_state_after_alloc``, ``touch_sending_mamba_blocks``,
``update_connector_output``, ``request_finished_all_groups``; ``start_load_kv`` with the real
``process_layer_data``, ``save_kv_layer``, ``get_finished``, ``build_connector_worker_meta``),
its ``ChunkedTokenDatabase``, ``LayerBatchBuilder`` s and a started ``KVCacheStoreLayerSendingThread``.

Stood in for, and why:
- ``KVPoolScheduler`` / ``KVPoolWorker`` are made with ``object.__new__`` plus the attributes the
  methods above read: their ``__init__`` needs a full ``VllmConfig`` with a model config, a
  MemCache client and an NPU. The values are those of a 4-layer GDN hybrid (3 linear-attention
  layers in a mamba group, 1 full-attention layer last), block size 4 tokens in every group.
- MemCache is :class:`Backend`: ``batch_alloc`` hands out GVAs and remembers their keys,
  ``batch_copy`` "reads" each block and checks it (see below), and can be slowed (blocked on a gate
  the test opens later), made to fail (non-zero result) or to raise.
- ``torch.npu.Event`` (``sync_save_events``) is a no-op: the "forward" here is synchronous.
- The worker's ``layer_save_finished_events`` are :class:`ScaledEvent` s, so that
  ``save_kv_layer``'s 10 s wait lasts 10 s x ``TIME_SCALE``; everything else is untouched.
- The harness plays vLLM's ``Scheduler`` / ``KVCacheManager`` with the real ``BlockPool``: blocks
  are allocated and freed in the same order, and a mamba group in ``align`` mode is emulated by
  freeing a request's older state blocks as it advances (keeping the last one it resumes from).

The check (use-after-free detector): every block allocated to a request is marked with that
request's id; ``Backend.batch_copy`` maps each GVA back to its key, the key to the block hash, the
hash to the request that owns it, and then compares with the mark on the block it reads. A foreign
mark is a use-after-free (the block was freed and handed to another request mid-send); a block
with ``ref_cnt == 0`` is a read of a free block (about to be reused). Null blocks (id 0) are skipped.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from dataclasses import dataclass, field

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import kv_transfer
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config_data import ChunkedTokenDatabase
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_scheduler import KVPoolScheduler
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_worker import KVPoolWorker

BS = 4  # tokens per block, every group
ATTN, MAMBA = 0, 1
#: physical layer -> [(group, index in group)]: three GDN layers, then full attention (last layer)
LAYERS = {0: [(MAMBA, 0)], 1: [(MAMBA, 1)], 2: [(MAMBA, 2)], 3: [(ATTN, 0)]}
GROUP_LAYERS = {ATTN: 1, MAMBA: 3}
NUM_LAYERS = len(LAYERS)
TIME_SCALE = 0.003  # save_kv_layer's 10 s wait -> 30 ms
GATE_LIMIT_S = 20.0  # a slow copy never waits longer than this for its gate (no hung tests)
GVA_SHIFT = 20
ADDR_SHIFT = 32

_token_ids = itertools.count(1000)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ScaledEvent(threading.Event):
    """``threading.Event`` whose timed waits are scaled by ``TIME_SCALE`` (the worker waits 10 s)."""

    def wait(self, timeout=None):
        return super().wait(None if timeout is None else timeout * TIME_SCALE)


class NpuEvent:
    """Stands in for ``torch.npu.Event``: nothing runs asynchronously on a device here."""

    def record(self, *args):
        pass

    def synchronize(self):
        pass


@dataclass
class Behaviour:
    kind: str = "fast"  # fast | slow | fail | raise
    gate: threading.Event | None = None
    release_at: int | None = None  # harness step at which a slow request's gate opens


@dataclass
class Violation:
    kind: str  # "foreign" (use-after-free) or "free" (read of a block in the free pool)
    block_id: int
    reader: str
    mark: str | None


class Backend:
    """In place of MemCache: GVA allocation, and copies that check what they read."""

    def __init__(self, harness: Harness):
        self.h = harness
        self.store = self  # the sending thread calls m_store.store.batch_copy
        self._next = itertools.count(1)
        self._key_of_base: dict[int, str] = {}
        self.plan: dict[str, Behaviour] = {}
        self.lock = threading.Lock()
        self.reads = 0
        self.copies = 0
        self.violations: list[Violation] = []

    # -- what the worker and its sending thread call
    def set_device(self):
        pass

    def batch_alloc(self, keys, sizes):
        gvas = []
        for key in keys:
            base = next(self._next) << GVA_SHIFT
            self._key_of_base[base] = key
            gvas.append(base)
        return gvas

    def batch_is_exist(self, keys):  # vllm-ascend 0.26: are cached GVAs still there (1) or evicted (0)
        known = set(self._key_of_base.values())
        return [int(key in known) for key in keys]

    def batch_write_finish(self, keys, results):
        return [0] * len(keys)  # vllm-ascend 0.26 checks one result per key

    def batch_copy(self, gvas, addrs, sizes, direction):
        readers = [self._reader(gva) for gva in gvas]
        behaviours = [self.plan.get(r, Behaviour()) for r in dict.fromkeys(readers)]
        for b in behaviours:
            if b.gate is not None:
                b.gate.wait(GATE_LIMIT_S)
        pool, marks = self.h.pool, self.h.marks
        with self.lock:
            self.copies += 1
            for reader, addr in zip(readers, addrs):
                block_id = addr & ((1 << ADDR_SHIFT) - 1)
                if block_id == 0:
                    continue
                self.reads += 1
                mark = marks[block_id]
                if mark != reader:
                    self.violations.append(Violation("foreign", block_id, reader, mark))
                elif pool.blocks[block_id].ref_cnt <= 0:
                    self.violations.append(Violation("free", block_id, reader, mark))
        kinds = {b.kind for b in behaviours}
        if "raise" in kinds:
            raise RuntimeError("test backend: copy raised")
        return -1 if "fail" in kinds else 0

    def _reader(self, gva: int) -> str:
        key = self._key_of_base[(gva >> GVA_SHIFT) << GVA_SHIFT]
        block_hash_hex = key.split("@")[-2]  # model@group@hash@rank
        return self.h.hash_owner[block_hash_hex]

    def open_all_gates(self):
        for b in list(self.plan.values()):
            if b.gate is not None:
                b.gate.set()


def make_scheduler(pool: BlockPool, world_size: int) -> KVPoolScheduler:
    """A KVPoolScheduler for the hybrid above, layerwise over MemCache (GVA path), kv_producer."""
    s = object.__new__(KVPoolScheduler)  # __init__ needs a VllmConfig with a model and a store client
    s.use_layerwise = True
    s.use_gva_layerwise = True
    s.backend_name = "memcache"
    s.kv_role = "kv_producer"
    s.consumer_is_to_put = s.consumer_is_to_load = False
    s.load_async = False
    s.save_decode_cache = False
    s.use_hybrid = True
    s.use_compress = s.need_truncate = False
    s.kv_cache_group_ids = [ATTN, MAMBA]
    s.kv_cache_group_families = []  # "default" for every group
    s.mamba_group_ids = [MAMBA]
    s.num_speculative_blocks = 0
    s.original_block_size = [BS, BS]
    s.grouped_block_size = [BS, BS]
    s.hash_block_size = BS
    s._block_size = BS
    s.lcm_block_size = BS
    s.cache_transfer_granularity = s._infer_cache_transfer_granularity()
    s._discard_partial_chunks = True
    s.tp_mismatch = False
    s.layerwise_offload = s.use_eagle = False  # read from vllm-ascend 0.26 on (layer reuse, EAGLE)
    s.model_name = "m"
    s.load_specs = {}
    s._request_trackers = {}
    s._preempted_req_ids = set()
    s._unfinished_requests = {}
    s._unfinished_request_ids = set()
    s._loading_req_ids = set()
    s._delayed_free_req_ids = set()
    s.sending_event_id = 0
    s.sending_blocks = {}
    s.sending_events = {}
    s._expected_worker_count = world_size
    s._block_pool = None
    s.bind_gpu_block_pool(pool)
    return s


def make_worker(rank: int, tp: int, backend: Backend) -> KVPoolWorker:
    """A KVPoolWorker (tp rank ``rank``) with a started KVCacheStoreLayerSendingThread."""
    w = object.__new__(KVPoolWorker)  # __init__ registers NPU caches with MemCache
    w.use_layerwise = True
    w.use_gva_layerwise = True
    w.use_mamba = True
    w.kv_role = "kv_producer"
    w.consumer_is_to_put = False
    w.load_async = False
    w.tp_rank, w.tp_size, w.dcp_size, w.put_step = rank, tp, 1, 1
    w.head_or_tp_rank = rank
    w.my_key_index, w.num_ranks_per_layer = 0, 1
    w.num_layers = NUM_LAYERS
    w.num_kv_cache_groups = 2
    w.grouped_block_size = [BS, BS]
    w.block_size = BS
    w.hash_block_size = BS
    w.kv_cache_group_families = []
    w.group_num_layers = dict(GROUP_LAYERS)
    w.group_block_len = {g: [1] * n for g, n in GROUP_LAYERS.items()}  # one 1-"byte" cache per layer
    w.page_size_bytes = 1
    w.model_name = "m"
    w._allocated_gvas = {}
    w.m_store = backend
    w.physical_layer_to_group_layers = {k: list(v) for k, v in LAYERS.items()}
    w.layer_save_tasks = [[] for _ in range(NUM_LAYERS)]
    w.layer_load_tasks = [[] for _ in range(NUM_LAYERS)]
    w.current_layer = 0
    w.next_layer_to_submit = 0
    w.num_prefetch_layers = 1
    w.layerwise_retrievers = []
    w._invalid_block_ids = set()
    w._invalid_block_ids_lock = threading.Lock()
    w.kv_recv_thread = None
    # read from vllm-ascend 0.26 on: no layer reuse (offload), no EAGLE, no external slot waiter
    w.layerwise_offload = w.use_eagle = False
    w.independent_layers, w.prefetch_layer_map = [], {}
    w.external_slot_release_waiter = None
    db = ChunkedTokenDatabase(metadata=[], block_size=[BS, BS], partitions=None, use_hybrid=True)
    for g, n in GROUP_LAYERS.items():
        # address = base(group, layer) + block_id * 1: the backend reads the block id back
        db.group_kv_caches_base_addr[g] = [((g * 100 + i + 1) << ADDR_SHIFT) for i in range(n)]
        db.group_block_len[g] = [1] * n
        db.group_block_stride[g] = [1] * n
    w.token_database = db
    w.sync_save_events = [NpuEvent() for _ in range(NUM_LAYERS)]
    w.layer_save_finished_events = [ScaledEvent() for _ in range(NUM_LAYERS)]
    ready = threading.Event()
    w.kv_send_thread = kv_transfer.KVCacheStoreLayerSendingThread(
        backend,
        db,
        BS,
        rank,
        tp,
        1,
        1,
        w.my_key_index,
        w.num_ranks_per_layer,
        w.page_size_bytes,
        ready,
        NUM_LAYERS,
        w.layer_save_finished_events,
        w.sync_save_events,
        group_builders=w._build_group_layer_builders(),
    )
    w.kv_send_thread.start()
    ready.wait(5)
    w._transfer_threads_started = True
    return w


@dataclass
class Req:
    request: Request
    decode_steps: int
    blocks: dict[int, list] = field(default_factory=lambda: {ATTN: [], MAMBA: []})
    state: str = "new"  # new | running | preempted | done
    decoded: int = 0
    ever: dict[int, set] = field(default_factory=lambda: {ATTN: set(), MAMBA: set()})  # block ids ever held

    @property
    def id(self) -> str:
        return self.request.request_id


class Harness:
    """Drives scheduler steps the way vLLM's engine core does, with ``tp`` workers."""

    def __init__(self, *, tp: int = 1, num_blocks: int = 96, chunk: int = 8, seed_skip_touch: bool = False):
        init_none_hash(sha256)
        self.pool = BlockPool(num_blocks, enable_caching=False, hash_block_size=BS)
        self.marks: list[str | None] = [None] * num_blocks
        self.hash_owner: dict[str, str] = {}
        self.backend = Backend(self)
        self.sched = make_scheduler(self.pool, tp)
        if seed_skip_touch:
            # The seed change: no touch in layerwise mode (an instance attribute, so that the
            # class -- patched or not -- is left alone).
            self.sched.touch_sending_mamba_blocks = lambda req_meta: None
        self.workers = [make_worker(rank, tp, self.backend) for rank in range(tp)]
        self.chunk = chunk
        self.reqs: dict[str, Req] = {}
        self.finished_ids: set[str] = set()
        self.steps = 0
        self.allocs_while_stuck = 0  # allocations made while some slow copy was held at its gate
        self.initial_free = self.pool.get_num_free_blocks()
        self._hasher = get_request_block_hasher(BS, sha256)

    # ------------------------------------------------------------------ requests
    def add(
        self, req_id: str, prompt_len: int, decode_steps: int = 1, behaviour: str = "fast", release_after: int | None = None
    ) -> Req:
        tokens = [next(_token_ids) for _ in range(prompt_len)]  # distinct: a hash names its request
        request = Request(req_id, tokens, SamplingParams(max_tokens=decode_steps + 1), None, block_hasher=self._hasher)
        for h in request.block_hashes:
            self.hash_owner[h.hex()] = req_id
        req = Req(request, decode_steps)
        self.reqs[req_id] = req
        gate = threading.Event() if behaviour == "slow" else None
        release_at = None if release_after is None else self.steps + release_after
        self.backend.plan[req_id] = Behaviour(behaviour, gate, release_at)
        return req

    def release(self, req_id: str) -> None:
        """Let a slow request's copies proceed."""
        gate = self.backend.plan[req_id].gate
        if gate is not None:
            gate.set()

    def live(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.state != "done"]

    # ------------------------------------------------------------------ block bookkeeping (vLLM's side)
    def _free(self, req: Req) -> None:
        for g in (ATTN, MAMBA):
            blocks = [b for b in req.blocks[g] if not b.is_null]
            self.pool.free_blocks(reversed(blocks))  # KVCacheManager frees tail first
            req.blocks[g] = []

    def _allocate(self, req: Req, num_new: int) -> tuple[list[int], ...] | None:
        r = req.request
        # mamba "align": states older than the one this step resumes from are freed (null in vLLM)
        keep_from = cdiv(r.num_computed_tokens, BS) - 1
        mamba = req.blocks[MAMBA]
        for i in range(max(0, min(keep_from, len(mamba)))):
            if not mamba[i].is_null:
                self.pool.free_blocks([mamba[i]])
                mamba[i] = self.pool.null_block
        need = cdiv(r.num_computed_tokens + num_new, BS)
        wanted = {g: max(0, need - len(req.blocks[g])) for g in (ATTN, MAMBA)}
        if sum(wanted.values()) > self.pool.get_num_free_blocks():
            return None
        new: list[list[int]] = [[], []]
        for g, n in wanted.items():
            if n:
                got = self.pool.get_new_blocks(n)
                if any(b.gate is not None and not b.gate.is_set() for b in self.backend.plan.values()):
                    self.allocs_while_stuck += 1
                for b in got:
                    self.marks[b.block_id] = req.id  # "content" of the block: its owner
                req.blocks[g].extend(got)
                new[g] = [b.block_id for b in got]
                req.ever[g].update(new[g])
        return tuple(new)

    def _block_ids(self, req: Req) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in req.blocks[g]] for g in (ATTN, MAMBA))

    def _finish(self, req: Req) -> None:
        delay, _ = self.sched.request_finished_all_groups(req.request, self._block_ids(req))
        assert not delay, "layerwise mode never delays the free"
        self._free(req)
        req.state = "done"
        self.finished_ids.add(req.id)

    # ------------------------------------------------------------------ one engine step
    def step(self, *, abort=(), preempt=()) -> None:
        for b in list(self.backend.plan.values()):
            if b.gate is not None and b.release_at is not None and b.release_at <= self.steps:
                b.gate.set()
        out = SchedulerOutput.make_empty()
        out.preempted_req_ids = set()
        out.finished_req_ids, self.finished_ids = self.finished_ids, set()
        for rid in abort:
            if self.reqs[rid].state != "done":
                self._finish(self.reqs[rid])  # abort: request_finished + free, like finish
        for rid in preempt:
            req = self.reqs[rid]
            if req.state == "running":
                self._free(req)
                req.request.num_computed_tokens = 0
                req.state = "preempted"
                out.preempted_req_ids.add(rid)
        scheduled: list[tuple[Req, int]] = []
        cached = out.scheduled_cached_reqs
        for req in self.live():
            if req.id in out.preempted_req_ids:
                continue
            r = req.request
            remaining = r.num_tokens - r.num_computed_tokens
            num_new = min(self.chunk, remaining) if r.num_computed_tokens < r.num_prompt_tokens else remaining
            if num_new <= 0:
                continue
            new_ids = self._allocate(req, num_new)
            if new_ids is None:
                continue  # no room: wait (vLLM would preempt; enough here)
            if req.state in ("new", "preempted"):
                self.sched.update_state_after_alloc(r, KVCacheBlocks(tuple(req.blocks[g] for g in (ATTN, MAMBA))), 0)
            if req.state == "new":
                out.scheduled_new_reqs.append(NewRequestData.from_request(r, self._block_ids(req)))
            else:
                resumed = req.state == "preempted"
                cached.req_ids.append(req.id)
                if resumed:
                    cached.resumed_req_ids.add(req.id)
                ids = self._block_ids(req) if resumed else new_ids
                cached.new_block_ids.append(ids if any(ids) else None)
                cached.new_token_ids.append([])
                cached.num_computed_tokens.append(r.num_computed_tokens)
                cached.num_output_tokens.append(r.num_output_tokens)
            req.state = "running"
            out.num_scheduled_tokens[req.id] = num_new
            scheduled.append((req, num_new))
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        meta = self.sched.build_connector_meta(out)
        for req, n in scheduled:  # Scheduler._update_after_schedule
            req.request.num_computed_tokens += n
        self._run_workers(meta, out)
        for req, _n in scheduled:  # Scheduler.update_from_output
            r = req.request
            if r.num_computed_tokens >= r.num_tokens:
                if req.decoded >= req.decode_steps:
                    self._finish(req)
                    continue
                r.append_output_token_ids(next(_token_ids))
                for h in r.block_hashes:
                    self.hash_owner.setdefault(h.hex(), req.id)
                req.decoded += 1
        self.steps += 1

    def _run_workers(self, meta, out: SchedulerOutput) -> None:
        reports = []
        for w in self.workers:
            m = copy.deepcopy(meta)  # each worker process gets its own (deserialized) copy
            w.start_load_kv(m)
            if out.total_num_scheduled_tokens:  # else: kv_connector_no_forward
                for _ in range(NUM_LAYERS):
                    w.save_kv_layer(m)
            w.get_finished(out.finished_req_ids, m)
            reports.append(w.build_connector_worker_meta())
        agg = None
        for r in reports:  # KVOutputAggregator
            if agg is None:
                agg = r
            elif r is not None:
                agg = agg.aggregate(r)
        self.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=agg))

    # ------------------------------------------------------------------ ends
    def drain(self, max_steps: int = 200) -> None:
        """Open every gate, then step (empty steps included) until all requests are done and all
        sends have been reported, or ``max_steps`` pass."""
        self.backend.open_all_gates()
        for _ in range(max_steps):
            if not self.live():
                break
            self.step()
        deadline = time.monotonic() + GATE_LIMIT_S
        while any(w.kv_send_thread.request_queue.qsize() for w in self.workers) and time.monotonic() < deadline:
            time.sleep(0.005)
        # Completed events reach the scheduler through a later step's output. Step until none is
        # outstanding, or until the outstanding set stops changing (nothing reports: unpatched).
        unchanged, last = 0, None
        while self.sched.sending_events and unchanged < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
            self.step()
            now = set(self.sched.sending_events)
            unchanged = unchanged + 1 if now == last else 0
            last = now
        self.step()

    def held_blocks(self) -> list[int]:
        """Blocks other than the null block that something still references."""
        return [b.block_id for b in self.pool.blocks if not b.is_null and b.ref_cnt > 0]

    def leaked(self) -> int:
        return self.initial_free - self.pool.get_num_free_blocks()

    def close(self) -> None:
        self.backend.open_all_gates()
