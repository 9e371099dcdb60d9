"""The pool harness: vLLM + vllm-ascend's layerwise KV pool on real objects, on a CPU.

Two drivers live here:
- :class:`PoolInstance` (second half of this file, with :func:`make_pool`, :func:`engine_loop`,
  :class:`GDNRead`): the project's pool harness. vLLM's real ``Scheduler`` / KVCacheManager in
  mamba align mode, the AscendStore connector's halves from ``KVConnectorFactory``, TP ranks as
  worker halves in one process, the real layer threads, ``execute_model``'s order replayed, a
  byte-level MemCache (``byte_store``). Its own docstring block says what is stood in for.
- :class:`Harness` (below): the older block-lifetime driver, kept for test_mamba_lifetime.py.

The rest of this docstring describes :class:`Harness`.

CPU harness for the lifetime of blocks read by vllm-ascend's layerwise KV pool sends.

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

import collections
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
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_scheduler import KVPoolScheduler
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_worker import KVPoolWorker

try:  # vllm-ascend 0.25 / 0.26; 0.30 moved it (metadata) and reworked the pool worker: only the
    # older block-lifetime driver (Harness, make_worker) uses it, PoolInstance does not
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config_data import ChunkedTokenDatabase
except ImportError:
    ChunkedTokenDatabase = None

BS = 4  # tokens per block, every group
ATTN, MAMBA = 0, 1
#: physical layer -> [(group, index in group)]: three GDN layers, then full attention (last layer)
LAYERS = {0: [(MAMBA, 0)], 1: [(MAMBA, 1)], 2: [(MAMBA, 2)], 3: [(ATTN, 0)]}
GROUP_LAYERS = {ATTN: 1, MAMBA: 3}
NUM_LAYERS = len(LAYERS)
TIME_SCALE = 0.003  # save_kv_layer's 10 s wait -> 30 ms
GATE_LIMIT_S = 20.0  # a slow copy never waits longer than this for its gate (no hung tests)
#: PoolInstance.step: a step taking longer fails the test (watchdog). vllm-ascend 0.25.1rc1 may wait
#: 10 s for each layer whose load never comes (unpatched runs), so a legitimate step can take 20 s+.
STEP_LIMIT_S = 60.0
#: when set, every rank's layer-load events time their waits out after ``timeout x LOAD_WAIT_SCALE``
#: (vllm-ascend 0.25.1rc1's ``wait_for_layer_load`` waits 10 s for a load that never comes when
#: the library is off: a library-off control can shorten that without changing what it shows)
LOAD_WAIT_SCALE: float | None = None
GVA_SHIFT = 20
ADDR_SHIFT = 32

_token_ids = itertools.count(1000)
#: address base (see make_worker: (group * 100 + index + 1) << ADDR_SHIFT) -> physical layer
_PHYSICAL = {g * 100 + i + 1: layer for layer, places in LAYERS.items() for g, i in places}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ScaledEvent(threading.Event):
    """``threading.Event`` whose timed waits are scaled by ``TIME_SCALE`` (the worker waits 10 s)."""

    def wait(self, timeout=None):
        return super().wait(None if timeout is None else timeout * TIME_SCALE)


class _ScaledWait(threading.Event):
    """``threading.Event`` whose timed waits last ``timeout x scale``."""

    def __init__(self, scale: float, set_: bool = False):
        super().__init__()
        self.scale = scale
        if set_:
            self.set()

    def wait(self, timeout=None):
        return super().wait(None if timeout is None else timeout * self.scale)


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
    layers: frozenset[int] | None = None  # physical layers whose copies misbehave (None: all)


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
        # store integrity: layer slots written by successful copies, and each key's finish
        self.written: dict[str, set[int]] = {}
        self.finished: dict[str, int] = {}
        self.stale_ready: list[str] = []  # keys finished with result 0 while a slot was unwritten

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
        with self.lock:
            for key, res in zip(keys, results):
                self.finished[key] = res
                if res == 0 and self.written.get(key, set()) != set(range(self.num_slots(key))):
                    self.stale_ready.append(key)
        return [0] * len(keys)  # vllm-ascend 0.26 checks one result per key

    @staticmethod
    def num_slots(key: str) -> int:
        return GROUP_LAYERS[int(key.split("@")[1])]  # model@group@hash@rank: one slot per layer of the group

    def unfinished(self) -> list[str]:
        """Keys allocated but never finished (MemCache keeps them invisible)."""
        return [k for k in self._key_of_base.values() if k not in self.finished]

    def batch_copy(self, gvas, addrs, sizes, direction):
        readers = [self._reader(gva) for gva in gvas]
        layer = _PHYSICAL[addrs[0] >> ADDR_SHIFT] if addrs else None
        behaviours = [self.plan.get(r, Behaviour()) for r in dict.fromkeys(readers)]
        behaviours = [b for b in behaviours if b.layers is None or layer in b.layers]
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
        if "fail" in kinds:
            return -1
        with self.lock:
            for gva in gvas:  # gva = key base + layer slot (page_size_bytes is 1)
                base = (gva >> GVA_SHIFT) << GVA_SHIFT
                self.written.setdefault(self._key_of_base[base], set()).add(gva - base)
        return 0

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
        self,
        req_id: str,
        prompt_len: int,
        decode_steps: int = 1,
        behaviour: str = "fast",
        release_after: int | None = None,
        layers: frozenset[int] | None = None,
    ) -> Req:
        tokens = [next(_token_ids) for _ in range(prompt_len)]  # distinct: a hash names its request
        request = Request(req_id, tokens, SamplingParams(max_tokens=decode_steps + 1), None, block_hasher=self._hasher)
        for h in request.block_hashes:
            self.hash_owner[h.hex()] = req_id
        req = Req(request, decode_steps)
        self.reqs[req_id] = req
        gate = threading.Event() if behaviour == "slow" else None
        release_at = None if release_after is None else self.steps + release_after
        self.backend.plan[req_id] = Behaviour(behaviour, gate, release_at, layers)
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


# ==================================================================================================
# The pool harness on real objects.
#
# ``Harness`` above (a fake scheduler loop over the real BlockPool and KVPoolScheduler/KVPoolWorker
# methods) is kept, unchanged, for tests/standins/test_mamba_lifetime.py. What follows is the
# project's pool harness; new tests use it:
#
#   pool = make_pool()                                   # a byte-level MemCache pool (byte_store)
#   a = PoolInstance(pool, name="A")                     # one vLLM instance attached to it
#   a.add_request("a", prompt); engine_loop(a)           # EngineCoreProc's loop
#   b = PoolInstance(pool, name="B")                     # a second instance, same pool
#   ...; b.wrong_reads("b")                              # what each GDN layer read, right or not
#
# Real: vLLM's ``Scheduler`` (``scheduler_config.get_scheduler_cls()``) with its KVCacheManager /
# HybridKVCacheCoordinator in mamba ``align`` mode, with vllm-ascend's process-wide patches applied
# as its platform plugin applies them (``load_general_plugins`` + ``pre_register_and_update`` ->
# ``adapt_patch(is_global_patch=True)``; the worker patches as its NPU worker applies them,
# ``adapt_patch()``); the AscendStore connector's scheduler and worker halves made by vLLM's
# ``KVConnectorFactory`` from a ``kv_transfer_config`` (use_layerwise, MemCache backend), the
# worker's ``register_kv_caches`` and the layer sending / receiving threads it starts; vLLM's
# ``KVOutputAggregator``; ``NPUModelRunner.execute_model``'s order replayed with the functions
# looked up where it looks them up (``handle_preemptions``, ``mamba_utils.preprocess_mamba``,
# ``NPUModelRunner.maybe_get_kv_connector_output`` / ``kv_connector_no_forward``,
# ``mamba_utils.do_mamba_copy_block``), each GDN layer entered through its (patched or not)
# ``AscendGatedDeltaNetAttention._forward_core`` and saved by ``ops.gdn``'s
# ``maybe_save_kv_layer_to_connector``, each attention layer through vLLM's
# ``maybe_transfer_kv_layer``.
#
# Stood in for, and why:
# - the model config is a tiny Qwen3-Next (``config.json`` in a temp dir, no weights, no hub);
#   vLLM's model inspection subprocess gets the CPU stand-ins through a ``sitecustomize``;
# - the KV cache specs are the harness's (``block_size`` tokens in every group, small states, the
#   mamba page padded to the attention page): vllm-ascend's platform forces 128-token attention
#   blocks for this model; the scheduler's block size is set the way EngineCore sets it (min of
#   the groups' block sizes);
# - MemCache: ``byte_store`` (real bytes, bounds-checked, faults, per-key write records);
# - the NPU batch-copy kernel (``mamba_utils.batch_memcpy``, a Triton launcher on NPU): host
#   ``memmove`` of the same (src, dst, size) rows, bounds-checked against the cache tensors;
# - the NPU caches: host tensors laid out as vLLM lays out shared hybrid pages (one raw tensor per
#   ``KVCacheTensor``, attention K/V and mamba conv/SSM views with the page as block stride);
# - one process per TP rank: each rank's worker half is built while vllm-ascend's pool worker and
#   MemCache backend see that rank's parallel state; each rank's step runs with its connector as
#   the process's transfer group;
# - the model's compute: a GDN layer "computes" when the original ``_forward_core`` first reads its
#   state (``self.kv_cache[1]``): the harness records what the state block of each request holds
#   (a :class:`GDNRead`), writes the state after this step's tokens, and stops the original there
#   (the NPU kernels that follow cannot run on a CPU). Attention layers check their computed blocks
#   and write the new ones the same way. Every state / KV block value names its content: "the
#   state of layer L (TP slice R) after the first t tokens of this token sequence"
#   (:func:`state_value`); a wrong read propagates (the layer writes a value derived from what it
#   read), as a real model would compute on.
# ==================================================================================================
import ctypes as _ctypes  # noqa: E402
import hashlib as _hashlib  # noqa: E402
import json as _json  # noqa: E402
import os as _os  # noqa: E402
import tempfile as _tempfile  # noqa: E402
from contextlib import contextmanager as _contextmanager  # noqa: E402
from pathlib import Path as _Path  # noqa: E402
from types import SimpleNamespace as _NS  # noqa: E402

import numpy as _np  # noqa: E402
import torch as _torch  # noqa: E402

import byte_store  # noqa: E402
from byte_store import PoolService  # noqa: E402,F401

_CHILD_SITE = _Path(__file__).resolve().parent / "child_site"
_MODEL_DIRS: dict[tuple, str] = {}
_MODEL_CONFIGS: dict[tuple, object] = {}
_HOST_REGIONS: list[tuple[int, int]] = []  # every cache tensor of every rank (batch_memcpy bounds)
_RT = _NS(ready=False)


def make_pool() -> PoolService:
    """A fresh byte-level MemCache pool; instances created with it share it."""
    return PoolService()


def state_value(tokens, layer: int, rank_key, nbytes: int) -> bytes:
    """The content of layer ``layer``'s state (TP slice ``rank_key``) after ``tokens``."""
    h = _hashlib.blake2b(_np.asarray(tokens, dtype=_np.int64).tobytes(), digest_size=16, person=b"alp-state")
    h.update(f"{layer}/{rank_key}".encode())
    d = h.digest()
    return (d * (nbytes // len(d) + 1))[:nbytes]


def next_token(tokens) -> int:
    """The token every rank 'samples' after ``tokens`` (deterministic, same on every instance)."""
    d = _hashlib.blake2b(_np.asarray(tokens, dtype=_np.int64).tobytes(), digest_size=4).digest()
    return 10 + int.from_bytes(d, "little") % 50000


def _runtime():
    """Process-wide setup, once: plugins and vllm-ascend's patches as its platform applies them."""
    if _RT.ready:
        return _RT
    from vllm.plugins import load_general_plugins
    from vllm.platforms import current_platform

    load_general_plugins()  # vllm-ascend's general plugin registers its KV connectors
    current_platform.pre_register_and_update()  # adapt_patch(is_global_patch=True)
    from vllm_ascend.utils import adapt_patch

    adapt_patch()  # the worker patches, as NPUWorker applies them (patch_mamba_utils, ...)
    import vllm_ascend.ops  # noqa: F401
    import vllm_ascend.ops.gdn as gdn
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    try:  # execute_model's own module and class, where they import here
        import vllm_ascend.worker.model_runner_v1 as runner_module

        runner = runner_module.NPUModelRunner
    except ImportError:  # the CPU venvs lack numba (EPLB): the same objects, found where they live
        runner_module = _NS(mamba_utils=mamba_utils)  # model_runner_v1: from vllm.v1.worker import mamba_utils
        runner = KVConnectorModelRunnerMixin  # NPUModelRunner inherits both methods unchanged

    # The NPU batch-copy kernel (a Triton launcher): host memmove of the same rows.
    mamba_utils.batch_memcpy = _host_batch_memcpy
    import sys as _sys

    ascend_mamba = _sys.modules.get("vllm_ascend.patch.worker.patch_mamba_utils")
    if hasattr(ascend_mamba, "_batch_memcpy_triton"):  # vllm-ascend 0.30: the per-layer copy calls it by name
        ascend_mamba._batch_memcpy_triton = _host_batch_memcpy
    import vllm.v1.utils as _v1_utils

    if getattr(_v1_utils, "PIN_MEMORY", False):  # vLLM 0.30's CpuGpuBuffer.copy_to_gpu pins by this flag
        _v1_utils.PIN_MEMORY = False  # (the device's pinned host memory: no such thing here)
    _RT.gdn = gdn
    _RT.runner_module = runner_module
    _RT.runner = runner
    _RT.ready = True
    return _RT


def _placements(tensor, specs) -> list[tuple[str, int, int]]:
    """(layer, byte offset of its block 0, block stride) of each layer in one ``KVCacheTensor``:
    vLLM <= 0.29 shares the tensor among ``shared_by`` layers (one per group, each from offset 0,
    stride = the page); vLLM 0.30 places ``layers`` at ``offset + l * layer_stride`` with its own
    ``block_stride``."""
    if hasattr(tensor, "shared_by"):
        return [(name, 0, specs[name].page_size_bytes) for name in tensor.shared_by]
    return [(name, tensor.offset + i * tensor.layer_stride, tensor.block_stride) for i, name in enumerate(tensor.layers)]


def _in_host_regions(addr: int, size: int) -> bool:
    return any(start <= addr and addr + size <= start + n for start, n in _HOST_REGIONS)


def _host_batch_memcpy(src_ptrs, dst_ptrs, sizes):
    for src, dst, n in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
        if not (_in_host_regions(src, n) and _in_host_regions(dst, n)):
            raise AssertionError(f"batch_memcpy out of the cache tensors: {src:#x} -> {dst:#x} ({n} bytes)")
        _ctypes.memmove(dst, src, n)


def _model_dir(pattern: str, kv_heads: int, folder: str | None = None) -> str:
    """The checkpoint folder (config.json only) of a tiny Qwen3-Next; ``folder`` names its last path
    component (in a fresh parent folder: two calls with one ``folder`` give two checkpoints whose
    folders have the same name)."""
    key = (pattern, kv_heads, folder)
    if folder is not None or key not in _MODEL_DIRS:
        d = _tempfile.mkdtemp(prefix="alp-qwen3next-")
        if folder is not None:
            d = _os.path.join(d, folder)
            _os.makedirs(d)
        types = ["linear_attention" if c == "G" else "full_attention" for c in pattern]
        cfg = dict(
            architectures=["Qwen3NextForCausalLM"],
            model_type="qwen3_next",
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=len(pattern),
            layer_types=types,
            full_attention_interval=2,
            num_attention_heads=8,  # divisible by every TP size the tests use (up to 8)
            num_key_value_heads=kv_heads,
            head_dim=16,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            vocab_size=65536,
            max_position_embeddings=4096,
            torch_dtype="bfloat16",
        )
        (_Path(d) / "config.json").write_text(_json.dumps(cfg))
        _MODEL_DIRS[key] = d
    return _MODEL_DIRS[key]


def _model_config(pattern: str, kv_heads: int, max_model_len: int, model_dir: str | None = None):
    key = (pattern, kv_heads, max_model_len, model_dir)
    if key not in _MODEL_CONFIGS:
        from vllm.config import ModelConfig

        old = _os.environ.get("PYTHONPATH")
        _os.environ["PYTHONPATH"] = _os.pathsep.join(p for p in (str(_CHILD_SITE), old) if p)
        try:  # vLLM inspects the architecture in a subprocess: give it the CPU stand-ins too
            _MODEL_CONFIGS[key] = ModelConfig(
                model=model_dir or _model_dir(pattern, kv_heads), skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16"
            )
        finally:
            if old is None:
                _os.environ.pop("PYTHONPATH", None)
            else:
                _os.environ["PYTHONPATH"] = old
    return _MODEL_CONFIGS[key]


@_contextmanager
def _process_of_rank(rank: int, tp: int):
    """What vllm-ascend's pool worker and MemCache backend read of the process's parallel state."""
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import pool_worker
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import memcache_backend

    values = {
        (pool_worker, "get_tensor_model_parallel_rank"): lambda: rank,
        (pool_worker, "get_tensor_model_parallel_world_size"): lambda: tp,
        (pool_worker, "get_pcp_group"): lambda: _NS(world_size=1, rank_in_group=0),
        (pool_worker, "get_decode_context_model_parallel_world_size"): lambda: 1,
        (pool_worker, "get_decode_context_model_parallel_rank"): lambda: 0,
    }
    if hasattr(memcache_backend, "get_world_group"):  # vllm-ascend <= 0.26 (0.30: torch.npu.current_device())
        values[(memcache_backend, "get_world_group")] = lambda: _NS(local_rank=rank)
    if hasattr(memcache_backend, "get_ascend_device_type"):  # vllm-ascend 0.25 (0.26 no longer asks)
        # an A3 node (no A2 bootstrap all-gather over the world group)
        values[(memcache_backend, "get_ascend_device_type")] = lambda: memcache_backend.AscendDeviceType.A3
    saved = {k: getattr(k[0], k[1]) for k in values}
    for (mod, name), v in values.items():
        setattr(mod, name, v)
    try:
        yield
    finally:
        for (mod, name), v in saved.items():
            setattr(mod, name, v)


@_contextmanager
def _transfer_group(connector):
    """The process's KV transfer group (what ensure_kv_transfer_initialized sets) for one rank."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    saved = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = connector
    try:
        yield
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = saved


@dataclass
class GDNRead:
    """What a layer found in a request's block when it read it (GDN state, or an attention block)."""

    instance: str
    rank: int
    step: int
    req_id: str
    layer: str
    kind: str  # "gdn" | "attn"
    block_index: int
    block_id: int
    expected: int  # tokens the content must cover
    actual: int | str  # tokens it covers, or "null" / "zero" / "other"

    @property
    def ok(self) -> bool:
        return self.actual == self.expected


class _GDNComputed(Exception):
    """Raised from the state read inside the original ``_forward_core``: the harness computed."""


class _StateProbe(list):
    """A GDN layer's ``kv_cache`` ([conv, ssm] views): reading an item inside the forward is the
    layer starting to compute; iteration (the runner's copy helpers) is plain."""

    def __init__(self, tensors, rank: "_Rank", layer_name: str):
        super().__init__(tensors)
        self.rank, self.layer_name = rank, layer_name

    def __getitem__(self, index):
        if self.rank.in_forward:
            self.rank.gdn_compute(self.layer_name)
            raise _GDNComputed(self.layer_name)
        return super().__getitem__(index)


class _AttentionLayer(_torch.nn.Module):
    def __init__(self, kv_cache):
        super().__init__()
        self.kv_cache = kv_cache


class _InputBatch:
    """The runner's persistent batch, as far as the replayed functions read it."""

    def __init__(self, max_num_reqs: int):
        self.req_ids: list[str] = []
        self.num_accepted_tokens_cpu = _np.ones(max_num_reqs, dtype=_np.int32)


class _Rank:
    """One TP rank: its caches, layers, worker connector half and runner state."""

    def __init__(self, inst: "PoolInstance", rank: int):
        rt = _runtime()
        self.inst, self.rank = inst, rank
        self.config = inst.configs[rank]
        self.kv_cache_config = inst.kv_cache_config
        self.in_forward = False
        self.so = None
        bs = inst.block_size
        self.layers: dict[str, _torch.nn.Module] = {}
        kv_caches: dict[str, object] = {}
        nb = self.kv_cache_config.num_blocks
        self._raw = []
        for tensor in self.kv_cache_config.kv_cache_tensors:
            align = 2 * 1024 * 1024  # vllm-ascend's register_kv_caches aligns regions down to 2 MiB
            raw = _torch.zeros(tensor.size + align, dtype=_torch.uint8)
            start = (-raw.data_ptr()) % align
            raw = raw[start : start + tensor.size]
            self._raw.append(raw)
            _HOST_REGIONS.append((raw.data_ptr(), tensor.size))
            inst.pool_register(raw)
            for name, start, page in _placements(tensor, inst.specs):
                spec = inst.specs[name]
                if name in inst.gdn_layers:
                    views, offset = [], start
                    for shape, dtype in zip(spec.shapes, spec.dtypes):
                        esize = _torch.tensor([], dtype=dtype).element_size()
                        inner = _np.prod(shape)
                        base = raw.view(dtype)
                        strides = [page // esize] + [int(_np.prod(shape[i + 1 :])) for i in range(len(shape))]
                        views.append(base.as_strided((nb, *shape), tuple(strides), base.storage_offset() + offset // esize))
                        offset += int(inner) * esize
                    layer = rt.gdn.AscendGatedDeltaNetAttention.__new__(rt.gdn.AscendGatedDeltaNetAttention)
                    _torch.nn.Module.__init__(layer)
                    layer.prefix = name
                    layer.kv_cache = _StateProbe(views, self, name)
                    kv_caches[name] = layer.kv_cache
                else:
                    h, d = spec.num_kv_heads, spec.head_size
                    base = raw.view(spec.dtype)
                    esize = base.element_size()
                    k = base.as_strided((nb, bs, h, d), (page // esize, h * d, d, 1), base.storage_offset() + start // esize)
                    half = spec.page_size_bytes // 2
                    v = base.as_strided((nb, bs, h, d), (page // esize, h * d, d, 1), base.storage_offset() + (start + half) // esize)
                    layer = _AttentionLayer((k, v))
                    kv_caches[name] = (k, v)
                self.layers[name] = layer
        self.config.compilation_config.static_forward_context.update(self.layers)
        self.kv_caches = kv_caches
        self.connector = None
        if inst.pool is not None:
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

            byte_store.install(inst.pool)
            with _process_of_rank(rank, inst.tp):
                self.connector = KVConnectorFactory.create_connector(
                    config=self.config, role=KVConnectorRole.WORKER, kv_cache_config=self.kv_cache_config
                )
                self.connector.register_kv_caches(kv_caches)  # starts the layer sending / receiving threads
            events = getattr(self.connector.connector_worker, "layer_load_finished_events", None)
            if LOAD_WAIT_SCALE is not None and events:  # the list the receiving thread shares
                for i, ev in enumerate(events):
                    events[i] = _ScaledWait(LOAD_WAIT_SCALE, set_=ev.is_set())
        # runner state
        from vllm.v1.worker import mamba_utils
        from vllm.v1.utils import CpuGpuBuffer

        self.requests: dict[str, object] = {}
        self.mamba_state_idx: dict[str, int] = {}
        self.input_batch = _InputBatch(inst.max_num_seqs)
        make_buffer = lambda n, dtype: CpuGpuBuffer(n, dtype=dtype, device=_torch.device("cpu"), pin_memory=False)  # noqa: E731
        self.mamba_bufs = mamba_utils.MambaBuffers.create(
            max_num_reqs=inst.max_num_seqs,
            kv_cache_config=self.kv_cache_config,
            copy_funcs=inst.copy_funcs,
            make_buffer=make_buffer,
            device=_torch.device("cpu"),
            with_postprocess_align=False,
        )

    # ------------------------------------------------------------------ values
    def rank_key(self, layer: str) -> str:
        """Which slice of the layer this rank holds, named by what it covers (so that two TP layouts
        whose ranks hold the same heads hold the same bytes, and any other pair differs): for GDN
        its share of the linear-attention heads (rank r of TP t), for attention its KV heads
        (``kv_heads // tp`` of them from its head group's first; one head, replicated, at TP >=
        KV heads)."""
        inst = self.inst
        if layer in inst.gdn_layers:
            return f"gdn{self.rank}/{inst.tp}"
        per_rank = max(1, inst.kv_heads // inst.tp)
        first = self.rank // max(1, inst.tp // inst.kv_heads) * per_rank
        return f"kv{first}+{per_rank}"

    def _tokens(self, st) -> list[int]:
        return list(st.prompt_token_ids) + list(st.output_token_ids)

    def _decode(self, raw: bytes, tokens, layer: int, key, block_id: int) -> int | str:
        if block_id == 0:
            return "null"
        if not any(raw):
            return "zero"
        for t in range(len(tokens), -1, -1):
            if state_value(tokens[:t], layer, key, len(raw)) == raw:
                return t
        return "other"

    @staticmethod
    def _block_bytes(tensors, block_id: int) -> bytes:
        return b"".join(t[block_id].contiguous().view(_torch.uint8).numpy().tobytes() for t in tensors)

    @staticmethod
    def _write_block(tensors, block_id: int, value: bytes) -> None:
        off = 0
        for t in tensors:
            view = t[block_id]
            n = view.numel() * view.element_size()
            src = _torch.frombuffer(bytearray(value[off : off + n]), dtype=_torch.uint8).view(view.dtype).view(view.shape)
            view.copy_(src)
            off += n

    def content(self, req_id: str, layer_name: str, block_index: int) -> int | str:
        """What this rank's block ``block_index`` of ``req_id`` holds for ``layer_name`` now: the
        tokens its value covers (this rank's slice), or "null" / "zero" / "other". Valid while the
        runner still has the request (until the step after it finishes)."""
        st = self.requests[req_id]
        block_id = st.block_ids[self.inst.group_of[layer_name]][block_index]
        cache = self.layers[layer_name].kv_cache
        tensors = list(list.__iter__(cache)) if layer_name in self.inst.gdn_layers else cache
        layer, key = self.inst.layer_index[layer_name], self.rank_key(layer_name)
        return self._decode(self._block_bytes(tensors, block_id), self._tokens(st), layer, key, block_id)

    # ------------------------------------------------------------------ compute stand-ins
    def gdn_compute(self, name: str) -> None:
        inst, so = self.inst, self.so
        layer = inst.layer_index[name]
        group = inst.group_of[name]
        tensors = list.__iter__(self.layers[name].kv_cache)
        tensors = list(tensors)
        key = self.rank_key(name)
        bs = inst.block_size
        for req_id in self.input_batch.req_ids:
            st = self.requests[req_id]
            tokens = self._tokens(st)
            done, n = st.num_computed_tokens, so.num_scheduled_tokens[req_id]
            idx = (done + n - 1) // bs  # mamba_get_block_table_tensor (align): the block GDN reads and writes
            block_id = st.block_ids[group][idx]
            nbytes = sum(t[0].numel() * t[0].element_size() for t in tensors)
            ok = True
            if done > 0:  # has_initial_state
                raw = self._block_bytes(tensors, block_id)
                actual = self._decode(raw, tokens, layer, key, block_id)
                inst.reads.append(GDNRead(inst.name, self.rank, inst.steps, req_id, name, "gdn", idx, block_id, done, actual))
                ok = actual == done
            value = state_value(tokens[: done + n], layer, key, nbytes)
            if not ok:  # computed on the wrong state: so is everything after
                value = state_value([*tokens[: done + n], -1, *raw[:16]], layer, key, nbytes)
            self._write_block(tensors, block_id, value)

    def attention(self, query, layer_name):
        inst, so = self.inst, self.so
        layer = inst.layer_index[layer_name]
        group = inst.group_of[layer_name]
        k, v = self.layers[layer_name].kv_cache
        key = self.rank_key(layer_name)
        bs = inst.block_size
        nbytes = k[0].numel() * k[0].element_size() * 2
        for req_id in self.input_batch.req_ids:
            st = self.requests[req_id]
            tokens = self._tokens(st)
            done, n = st.num_computed_tokens, so.num_scheduled_tokens[req_id]
            ok = True
            for b in range(-(-done // bs)):
                block_id = st.block_ids[group][b]
                want = min((b + 1) * bs, done)
                actual = self._decode(self._block_bytes((k, v), block_id), tokens, layer, key, block_id)
                inst.reads.append(GDNRead(inst.name, self.rank, inst.steps, req_id, layer_name, "attn", b, block_id, want, actual))
                ok = ok and actual == want
            end = done + n
            for b in range(done // bs, -(-end // bs)):
                upto = min((b + 1) * bs, end)
                value = state_value(tokens[:upto], layer, key, nbytes) if ok else state_value([*tokens[:upto], -1], layer, key, nbytes)
                self._write_block((k, v), st.block_ids[group][b], value)
        return query

    # ------------------------------------------------------------------ execute_model, replayed
    def _update_states(self, so) -> None:
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                mm_features=[],
                sampling_params=new.sampling_params,
                generator=None,
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests[req_id]
            st.num_computed_tokens = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = tuple(list(ids) for ids in new_ids)
                st.output_token_ids = list(st.output_token_ids[: cached.num_output_tokens[i]])
                continue
            if cached.num_output_tokens[i] < len(st.output_token_ids):
                # the scheduler discarded output tokens (a KV load failure rolled the request back):
                # the runner aligns its cached state, as vLLM's GPU runner does
                del st.output_token_ids[cached.num_output_tokens[i] :]
            if new_ids is not None:
                for ids, more in zip(st.block_ids, new_ids):
                    ids.extend(more)
        self.input_batch.req_ids = [r for r in so.num_scheduled_tokens if r in self.requests]
        self.input_batch.num_accepted_tokens_cpu[:] = 1

    def execute(self, so):
        rt = _runtime()
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

        self.so = so
        with _transfer_group(self.connector):
            if self.connector is not None:
                self.connector.handle_preemptions(so.kv_connector_metadata)
            self._update_states(so)
            if not so.total_num_scheduled_tokens:
                if self.connector is None:
                    return EMPTY_MODEL_RUNNER_OUTPUT
                return rt.runner.kv_connector_no_forward(so, self.config)
            bufs = self.mamba_bufs.preprocess
            rt.runner_module.mamba_utils.preprocess_mamba(
                so,
                self.kv_cache_config,
                self.config.cache_config,
                self.mamba_state_idx,
                self.input_batch,
                self.requests,
                self.config.compilation_config.static_forward_context,
                self.inst.copy_funcs,
                bufs,
            )
            metadata = {name: GDNAttentionMetadata(1, 1, 0, 0, 0, 0, 1) for name in self.inst.gdn_layers}
            metadata.update({name: object() for name in self.inst.attn_layers})
            defer = self.config.speculative_config is not None
            with (
                set_forward_context(metadata, self.config, slot_mapping={}),
                rt.runner.maybe_get_kv_connector_output(so, defer_finalize=defer) as kv_output,
            ):
                # vllm-ascend 0.30's runner: a connector with prepare_mamba_state_copy stages the copy per
                # layer (after each layer's load) and is told finish_mamba_state_copy after the forward
                staged = getattr(self.connector, "prepare_mamba_state_copy", None)
                staged = self.connector if callable(staged) and staged(bufs) else None
                if staged is None:
                    rt.runner_module.mamba_utils.do_mamba_copy_block(bufs)
                self._forward()
                if staged is not None:
                    staged.finish_mamba_state_copy()
        out_tokens = []
        for req_id in self.input_batch.req_ids:
            st = self.requests[req_id]
            tokens = self._tokens(st)
            end = st.num_computed_tokens + so.num_scheduled_tokens[req_id]
            out_tokens.append([next_token(tokens[:end])] if end >= len(tokens) else [])
        for req_id, toks in zip(self.input_batch.req_ids, out_tokens):
            self.requests[req_id].output_token_ids.extend(toks)
        return ModelRunnerOutput(
            req_ids=list(self.input_batch.req_ids),
            req_id_to_index={r: i for i, r in enumerate(self.input_batch.req_ids)},
            sampled_token_ids=out_tokens,
            kv_connector_output=kv_output,
        )

    def _forward(self) -> None:
        rt = _runtime()
        self.in_forward = True
        try:
            for name in self.inst.layer_order:
                if name in self.inst.gdn_layers:
                    t = _torch.zeros(1, 1)
                    try:
                        self.layers[name]._forward_core(t, t, t, t)
                    except _GDNComputed:
                        pass
                    else:
                        raise AssertionError(f"{name}: _forward_core returned without reading its state")
                    rt.gdn.maybe_save_kv_layer_to_connector("", [])  # the original's own last line
                else:
                    self.inst.attention_op(_torch.zeros(1), name)
        finally:
            self.in_forward = False


class PoolInstance:
    """One vLLM instance (scheduler + ``tp`` worker ranks), attached to ``pool`` or to none.

    ``pool=None``: no KV connector at all (plain prefix caching). ``block_size`` tokens per block in
    every group; ``pattern``: one letter per layer, G = GDN, A = full attention (the last layer
    should be attention, as in Qwen3.5 / Qwen3-Next); ``max_num_batched_tokens`` sets the chunk.
    """

    def __init__(
        self,
        pool: PoolService | None,
        *,
        name: str = "A",
        pattern: str = "GAGA",
        tp: int = 1,
        kv_heads: int = 2,
        block_size: int = 16,
        num_blocks: int = 64,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 256,
        max_model_len: int = 512,
        layerwise: bool = True,
        kv_role: str = "kv_both",
        extra_config: dict | None = None,
        num_speculative_blocks: int = 0,
        kv_load_failure_policy: str = "fail",  # vLLM's default
        additional_config: dict | None = None,  # vllm-ascend's (``--additional-config``)
        model_dir: str | None = None,  # the checkpoint folder (``_model_dir``); default: one per (pattern, kv_heads)
        pp: int = 1,  # pipeline stages (the harness runs stage 0's ranks; see stage_workers)
        long_prefill_token_threshold: int = 0,  # vLLM's per-request chunk limit (0: none)
        async_scheduling: bool = False,  # vLLM's AsyncScheduler, stepped as step_with_batch_queue (depth 2)
    ):
        _runtime()
        from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, SchedulerConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
        from vllm.model_executor.models import ModelRegistry
        from vllm.utils.hashing import sha256 as _sha256
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_kv_cache_configs,
            get_request_block_hasher,
            init_none_hash,
        )
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.pool, self.name, self.tp, self.kv_heads = pool, name, tp, kv_heads
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.pattern = pattern
        model_config = _model_config(pattern, kv_heads, max_model_len, model_dir)
        extra = {"use_layerwise": layerwise, "backend": "memcache", **(extra_config or {})}

        def config(rank: int) -> VllmConfig:
            cfg = VllmConfig(
                model_config=model_config,
                cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True, mamba_cache_mode="align"),
                parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=rank),
                scheduler_config=SchedulerConfig(
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                    max_model_len=max_model_len,
                    is_encoder_decoder=False,
                    enable_chunked_prefill=True,
                    async_scheduling=async_scheduling,  # False: EngineCore.step (no batch queue)
                    long_prefill_token_threshold=long_prefill_token_threshold,
                ),
                kv_transfer_config=(
                    KVTransferConfig(
                        kv_connector="AscendStoreConnector",
                        kv_role=kv_role,
                        kv_connector_extra_config=extra,
                        kv_load_failure_policy=kv_load_failure_policy,
                    )
                    if pool is not None
                    else None
                ),
                additional_config=dict(additional_config or {}),
            )
            cfg.cache_config.block_size = block_size  # as EngineCore sets it from the KV cache groups
            if hasattr(cfg.cache_config, "get_resolved_kv_cache_layout"):  # vLLM 0.30: EngineCore resolves
                cfg.cache_config.kv_cache_layout = "LBNHC"  # one layout (NHD: the harness's K/V views)
            return cfg

        self.configs = [config(r) for r in range(tp)]
        self.layer_order = [f"model.layers.{i}." + ("linear_attn" if c == "G" else "self_attn.attn") for i, c in enumerate(pattern)]
        self.layer_index = {n: i for i, n in enumerate(self.layer_order)}
        self.gdn_layers = [n for n in self.layer_order if "linear_attn" in n]
        self.attn_layers = [n for n in self.layer_order if n not in self.gdn_layers]
        kv_per_rank = max(1, kv_heads // tp)
        attn = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_per_rank, head_size=16, dtype=_torch.bfloat16)
        mamba = MambaSpec(
            block_size=block_size,
            shapes=((8, 3), (2, 4, 4)),
            dtypes=(_torch.bfloat16, _torch.float32),
            page_size_padded=attn.page_size_bytes,
            mamba_type="gdn_attention",
            mamba_cache_mode="align",
            num_speculative_blocks=num_speculative_blocks,
        )
        self.specs = {n: (mamba if n in self.gdn_layers else attn) for n in self.layer_order}
        group_size = max(len(self.gdn_layers), len(self.attn_layers))
        memory = attn.page_size_bytes * num_blocks * group_size
        worker_cfgs = get_kv_cache_configs(self.configs[0], [dict(self.specs)], [memory])
        self.kv_cache_config = worker_cfgs[0]
        sched_cfg = generate_scheduler_kv_cache_config(worker_cfgs)
        self.group_of = {n: g for g, grp in enumerate(self.kv_cache_config.kv_cache_groups) for n in grp.layer_names}
        model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
        if hasattr(model_cls, "get_mamba_state_copy_funcs"):  # vLLM 0.30: by mamba type (the runner's own call)
            from vllm.v1.worker import mamba_utils as _mamba_utils

            types = {spec.mamba_type for spec in _mamba_utils.get_mamba_groups(self.kv_cache_config)}
            self.copy_funcs = model_cls.get_mamba_state_copy_funcs(types)
        else:
            self.copy_funcs = model_cls.get_mamba_state_copy_func()

        if pool is not None:
            byte_store.install(pool)
        if not getattr(_RT, "none_hash", False):  # once: instances sharing a pool share PYTHONHASHSEED
            init_none_hash(_sha256)
            _RT.none_hash = True
        self.hasher = get_request_block_hasher(block_size, _sha256)
        cfg0 = self.configs[0]
        for cfg in self.configs:  # EngineCore._initialize_kv_caches
            cfg.cache_config.num_gpu_blocks = sched_cfg.num_blocks
        self.scheduler = cfg0.scheduler_config.get_scheduler_cls()(
            vllm_config=cfg0,
            kv_cache_config=sched_cfg,
            structured_output_manager=StructuredOutputManager(cfg0),
            block_size=block_size,
            hash_block_size=block_size,
            log_stats=False,
        )
        self.reads: list[GDNRead] = []
        self.kv_outputs: list = []
        self.steps = 0
        self.outputs: dict[str, list[int]] = {}
        self.after_schedule = None  # callable(inst, scheduler_output): runs before the ranks execute
        #: async scheduling: EngineCore's batch queue (depth 2, as with async_scheduling and no PP)
        self.batch_queue_size = 2 if async_scheduling else 0
        self.batch_queue: collections.deque = collections.deque()
        self.ranks = [_Rank(self, r) for r in range(tp)]
        self.aggregator = (
            KVOutputAggregator.from_connector(self.scheduler.connector, tp) if self.scheduler.connector is not None else None
        )

        def attention(query, layer_name):
            return self._current_rank.attention(query, layer_name)

        self.attention_op = maybe_transfer_kv_layer(attention)
        self._current_rank = self.ranks[0]

    def stage_workers(self) -> list:
        """One more AscendStore worker half per pipeline stage (TP rank 0 of each), built as a
        worker process of that stage builds it (its global rank in the parallel config); their
        caches are not registered and no layer thread runs: for what they key, not for serving."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        workers = []
        for stage in range(self.configs[0].parallel_config.pipeline_parallel_size):
            cfg = copy.copy(self.configs[0])
            cfg.parallel_config = copy.copy(cfg.parallel_config)
            cfg.parallel_config.rank = stage * self.tp
            with _process_of_rank(0, self.tp):
                connector = KVConnectorFactory.create_connector(
                    config=cfg, role=KVConnectorRole.WORKER, kv_cache_config=self.kv_cache_config
                )
            workers.append(connector.connector_worker)
        return workers

    def pool_register(self, raw) -> None:
        if self.pool is not None:
            self.pool.register_region(raw.data_ptr(), raw.numel())

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt: list[int], max_tokens: int = 1):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, block_hasher=self.hasher)
        self.scheduler.add_request(request)
        return request

    def has_work(self) -> bool:
        """``EngineCoreProc.has_work`` for one engine without DP or a batch queue."""
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self):
        """``EngineCore.step``: schedule, execute on every rank, aggregate, update. None if idle.

        Runs under a watchdog: a step still running after ``STEP_LIMIT_S`` fails the test (its
        thread is left behind, blocked) instead of hanging the run."""
        done: dict = {}

        def run():
            try:
                done["so"] = self._step_with_batch_queue() if self.batch_queue_size else self._step()
            except BaseException as exc:  # handed to the caller's thread
                done["error"] = exc

        thread = threading.Thread(target=run, name=f"pool-step-{self.name}-{self.steps}", daemon=True)
        thread.start()
        thread.join(STEP_LIMIT_S)
        if thread.is_alive():
            import sys
            import traceback

            where = "".join(traceback.format_stack(sys._current_frames().get(thread.ident)))
            raise AssertionError(f"instance {self.name}: step {self.steps} still running after {STEP_LIMIT_S} s (hung) at\n{where}")
        if "error" in done:
            raise done["error"]
        return done["so"]

    def _step(self):
        if not self.scheduler.has_requests():
            return None
        so = self.scheduler.schedule()
        if self.after_schedule is not None:  # e.g. the pool evicts a key between hit check and load
            self.after_schedule(self, so)
        outputs = []
        for rank in self.ranks:
            self._current_rank = rank
            # each worker deserializes its own copy of the scheduler output, and the executor gets a
            # fresh copy of each worker's output: a rank with nothing to report returns vLLM's
            # module-global EMPTY_MODEL_RUNNER_OUTPUT (kv_connector_no_forward), on which the
            # aggregator would set this step's aggregated kv_connector_output -- every later empty
            # step of every instance in this process would report it again (stale completed events)
            outputs.append(copy.copy(rank.execute(copy.deepcopy(so))))
        output = self.aggregator.aggregate(outputs, 0) if self.aggregator is not None else outputs[0]
        self.kv_outputs.append(output.kv_connector_output)  # what the scheduler is told, per step
        for req_id, toks in zip(output.req_ids, output.sampled_token_ids):
            if toks:
                self.outputs.setdefault(req_id, []).extend(toks)
        self.scheduler.update_from_output(so, output)
        self.steps += 1
        return so

    def _execute(self, so):
        """Every rank executes ``so``; the aggregated output (what the executor's future yields)."""
        outputs = []
        for rank in self.ranks:
            self._current_rank = rank
            outputs.append(copy.copy(rank.execute(copy.deepcopy(so))))  # see _step
        output = self.aggregator.aggregate(outputs, 0) if self.aggregator is not None else outputs[0]
        self.kv_outputs.append(output.kv_connector_output)
        for req_id, toks in zip(output.req_ids, output.sampled_token_ids):
            if toks:
                self.outputs.setdefault(req_id, []).extend(toks)
        self.steps += 1  # counts executed batches (the step index of every read)
        return output

    def _step_with_batch_queue(self):
        """``EngineCore.step_with_batch_queue`` (vLLM 0.25 / 0.26), no structured output, no PP: schedule
        and submit while the queue has room and something was scheduled; else take the oldest batch's
        result and update the scheduler from it. The executor runs batches in submission order, so the
        ranks execute a batch when it is submitted (ahead of the scheduler, as a real worker may)."""
        queue = self.batch_queue
        assert len(queue) < self.batch_queue_size
        scheduled = None
        if self.scheduler.has_requests():
            scheduled = so = self.scheduler.schedule()
            if self.after_schedule is not None:
                self.after_schedule(self, so)
            output = self._execute(so)
            model_executed = so.total_num_scheduled_tokens > 0
            queue.appendleft((output, so))
            if len(queue) < self.batch_queue_size and (model_executed or self.scheduler.has_requests()):
                return scheduled
        elif not queue:
            return None
        output, so = queue.pop()
        self.scheduler.update_from_output(so, output)
        return scheduled if scheduled is not None else so

    # ------------------------------------------------------------------ what was read
    def reads_of(self, req_id: str | None = None, *, kind: str = "gdn", step: int | None = None) -> list[GDNRead]:
        return [
            r
            for r in self.reads
            if r.kind == kind and (req_id is None or r.req_id == req_id) and (step is None or r.step == step)
        ]

    def first_step_of(self, req_id: str) -> int | None:
        steps = [r.step for r in self.reads if r.req_id == req_id]
        return min(steps) if steps else None

    def wrong_reads(self, req_id: str | None = None, *, kind: str = "gdn") -> list[GDNRead]:
        return [r for r in self.reads_of(req_id, kind=kind) if not r.ok]

    # ------------------------------------------------------------------ time
    def scale_save_wait(self) -> None:
        """``save_kv_layer``'s 10 s wait for the step's last layer lasts 10 s x ``TIME_SCALE`` on
        every rank (its events become :class:`ScaledEvent` s, in the list the sending thread shares)."""
        for rank in self.ranks:
            worker = rank.connector.connector_worker
            events = worker.layer_save_finished_events
            for i, ev in enumerate(events):
                scaled = ScaledEvent()
                if ev.is_set():
                    scaled.set()
                events[i] = scaled


def engine_loop(inst: PoolInstance, *, max_steps: int = 1000, on_step=None) -> int:
    """Step ``inst`` exactly as ``EngineCoreProc.run_busy_loop`` does: only while it has work.

    Returns the number of steps taken. ``on_step(inst, scheduler_output)`` runs after each step.
    """
    n = 0
    while inst.has_work() and n < max_steps:
        so = inst.step()
        n += 1
        if on_step is not None:
            on_step(inst, so)
        if so is not None and not so.total_num_scheduled_tokens and inst.has_work():
            time.sleep(0.001)  # EngineCoreProc._process_engine_step: no model run, still has requests
    return n


# ==================================================================================================
# Liveness soak (issue 23): a slow store and a whole workload on one PoolInstance, measured every step
# ==================================================================================================
def slow_store(pool: PoolService, *, seed: int, factor=(1.5, 6.0), hang_p: float = 0.03, hang_s: float = 0.5, match=None):
    """Every matching save copy takes ``factor`` x save_kv_layer's (scaled) wait; ``hang_p`` of them
    hang ``hang_s`` instead (several forward steps). Returns the fault (``.gate.set()`` ends every
    delay at once)."""
    import random

    rng, lock, wait_s = random.Random(seed), threading.Lock(), 10.0 * TIME_SCALE

    def delay() -> float:
        with lock:
            return hang_s if rng.random() < hang_p else rng.uniform(*factor) * wait_s

    return pool.add_fault("delay", direction=byte_store.L2G, match=match, delay=delay)


#: The soak scenarios of issue 23, at the issue's sizes: name -> (PoolInstance kwargs, soak kwargs,
#: slow_store kwargs). tests/standins/test_send_shedding.py runs them smaller, scripts/soak_shedding.py
#: at these sizes over several seeds.
SOAK_SCENARIOS = {
    # 60 requests of 20-300 prompt tokens, 16 running, a 240-block pool
    "slow": (dict(num_blocks=240, max_num_seqs=16), dict(requests=60, prompt=(20, 300), output=(1, 4)), {}),
    # preemption and aborts: 110 blocks, 40-260-token prompts, 16-80 output tokens, 12 running
    "preempt": (
        dict(num_blocks=110, max_num_seqs=12),
        dict(requests=60, prompt=(40, 260), output=(16, 80), abort_p=0.05),
        {},
    ),
    # TP=2, only rank 1's store slow (keys end @<rank> at TP = KV heads), rank 0's fast
    "tp2": (
        dict(num_blocks=240, max_num_seqs=16, tp=2, kv_heads=2),
        dict(requests=60, prompt=(20, 300), output=(1, 4)),
        dict(match=lambda key: key.endswith("@1")),
    ),
}


def soak(
    inst: PoolInstance,
    *,
    seed: int,
    requests: int = 60,
    prompt=(20, 300),
    output=(1, 4),
    shared_prefix: float = 0.25,
    abort_p: float = 0.0,
    deadline_s: float = 60.0,
    on_finished=None,
) -> dict:
    """Serve ``requests`` random prompts (a ``shared_prefix`` share of them reuse an earlier prompt's
    first 64 tokens: prefix hits, loads) on ``inst`` with EngineCoreProc's loop (steps while
    ``has_work()``), aborting a running request with ``abort_p`` per step, until the loop stops by
    itself or ``deadline_s`` passed. ``on_finished(inst)`` runs once, at the step after which no
    request is left (e.g. to let a slow store catch up). Every step: block references and blocks
    held by open send events, blocks in use, unfinished requests, and no held block free (a send
    reading a freed block). Returns the figures."""
    import random

    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    sched = inst.scheduler
    cs = sched.connector.connector_scheduler if sched.connector is not None else None
    bp = sched.kv_cache_manager.block_pool
    prompts: list[list[int]] = []
    for i in range(requests):
        n = rng.randint(*prompt)
        toks = [rng.randrange(1000, 60000) for _ in range(n)]
        if prompts and rng.random() < shared_prefix:
            head = rng.choice(prompts)[:64]
            toks = head + toks[len(head) :] if n > len(head) else toks
        prompts.append(toks)
        inst.add_request(f"s{seed}-{i}", toks, max_tokens=rng.randint(*output))
    f = dict(steps=0, held_refs_max=0, held_blocks_max=0, used_max=0, preempted=0, aborted=0, freed_while_held=0)
    trace: list[tuple[float, int, int, int]] = []  # (t, held block refs, blocks in use, unfinished)
    start = f["_start"] = time.monotonic()
    while inst.has_work() and time.monotonic() - start < deadline_s:
        if abort_p and sched.running and rng.random() < abort_p:
            sched.finish_requests(rng.choice(sched.running).request_id, RequestStatus.FINISHED_ABORTED)
            f["aborted"] += 1
        so = inst.step()
        f["steps"] += 1
        if so is not None and so.preempted_req_ids:
            f["preempted"] += len(so.preempted_req_ids)
        refs = blocks = 0
        if cs is not None:
            held = [b for ids in cs.sending_blocks.values() for b in ids]
            refs, blocks = len(held), len(set(held))
            f["freed_while_held"] += sum(1 for b in held if bp.blocks[b].ref_cnt <= 0)
        used = bp.num_gpu_blocks - 1 - bp.get_num_free_blocks()
        unfinished = sched.get_num_unfinished_requests()
        trace.append((time.monotonic() - start, refs, used, unfinished))
        f["held_refs_max"] = max(f["held_refs_max"], refs)
        f["held_blocks_max"] = max(f["held_blocks_max"], blocks)
        f["used_max"] = max(f["used_max"], used)
        if not unfinished and "finished_s" not in f:
            f["finished_s"] = time.monotonic() - start
            if on_finished is not None:
                on_finished(inst)
        if so is not None and not so.total_num_scheduled_tokens and inst.has_work():
            time.sleep(0.001)  # EngineCoreProc: no model run, still has work
    f["stopped_s"] = time.monotonic() - start
    f["stopped"] = not inst.has_work()
    f["unfinished"] = sched.get_num_unfinished_requests()
    f["held_refs"] = sum(len(ids) for ids in cs.sending_blocks.values()) if cs is not None else 0
    f["open_events"] = len(cs.sending_events) if cs is not None else 0
    f["used"] = bp.num_gpu_blocks - 1 - bp.get_num_free_blocks()
    f["num_blocks"] = bp.num_gpu_blocks - 1
    if inst.pool is not None:
        with inst.pool.lock:
            writes = [t for blob in inst.pool.blobs.values() for _o, _n, t, ok in blob.writes if ok]
        f["last_write_s"] = max(writes) - start if writes else None
    f["trace"] = trace
    return f


# ==================================================================================================
# Async scheduling (issue 23): a step still running on the device when the scheduler moves on


class InFlightWrites:
    """Stands in for a device that is still running a step: the cache writes of the batch executed
    after :meth:`hold_next` (every rank) are held back. They land at the next executed batch's first
    layer compute (stream order: that step's compute runs after them, its ungated layer loads need
    not), or when the held batch's output is processed (``update_from_output``: the device finished
    it), whichever comes first. ``landed`` lists ``(layer name, block id)`` of each write as it lands."""

    def __init__(self, inst: PoolInstance):
        self.inst, self.armed, self.capturing, self.batch = inst, False, False, None
        self.pending: list[tuple] = []
        self.landed: list[tuple[str, int]] = []
        self._layer = None
        execute, update = inst._execute, inst.scheduler.update_from_output

        def _execute(so):
            if not self.armed:
                return execute(so)
            self.armed, self.capturing, self.batch = False, True, so
            try:
                return execute(so)
            finally:
                self.capturing = False

        def update_from_output(so, output):
            if so is self.batch:
                self.land()
            return update(so, output)

        inst._execute, inst.scheduler.update_from_output = _execute, update_from_output
        for rank in inst.ranks:
            self._wrap(rank)

    def _wrap(self, rank: _Rank) -> None:
        gdn, attention = rank.gdn_compute, rank.attention

        def write(tensors, block_id, value):
            if self.capturing:
                self.pending.append((self._layer, tensors, block_id, value))
            else:
                _Rank._write_block(tensors, block_id, value)

        def gdn_compute(name):
            self._enter(name)
            return gdn(name)

        def attn(query, layer_name):
            self._enter(layer_name)
            return attention(query, layer_name)

        rank._write_block, rank.gdn_compute, rank.attention = write, gdn_compute, attn

    def _enter(self, layer: str) -> None:
        self._layer = layer
        if not self.capturing and self.pending:
            self.land()

    def hold_next(self) -> None:
        self.armed = True

    def land(self) -> None:
        for layer, tensors, block_id, value in self.pending:
            _Rank._write_block(tensors, block_id, value)
            self.landed.append((layer, block_id))
        self.pending.clear()


class DelayedUploads:
    """Stands in for the device's non-blocking upload of a rank's pinned pre-copy rows
    (``CpuGpuBuffer.copy_to_gpu`` on ``src_ptrs`` / ``dst_ptrs`` / ``sizes``): the harness copies at
    once (its forward needs the rows), but the read the device would do is deferred until an event
    recorded after it is synchronized (:meth:`event` stands in for ``torch.npu.Event``), or -- the
    device running a step behind -- until the rank uploads the same buffer again (its next step).
    ``wrong_rows`` counts the rows such a late read finds rewritten (the device would copy them)."""

    def __init__(self, inst: PoolInstance, rank: int = 0):
        self.pending: list[tuple] = []  # (upload number, buffer, rows as uploaded)
        self.uploads = self.wrong_rows = self.rows = 0
        bufs = inst.ranks[rank].mamba_bufs.preprocess
        for buf in (bufs.src_ptrs, bufs.dst_ptrs, bufs.sizes):
            self._wrap(buf)

    def _wrap(self, buf) -> None:
        upload = buf.copy_to_gpu

        def copy_to_gpu(n=None):
            if any(b is buf for _, b, _ in self.pending):  # the next step's upload: the last one ran
                self.execute()
            self.uploads += 1
            self.pending.append((self.uploads, buf, buf.np[: len(buf.np) if n is None else n].copy()))
            return upload(n)

        buf.copy_to_gpu = copy_to_gpu

    def execute(self, upto: int | None = None) -> None:
        """The device reads the pending uploads (those numbered up to ``upto``, or all)."""
        keep = []
        for number, buf, rows in self.pending:
            if upto is not None and number > upto:
                keep.append((number, buf, rows))
                continue
            self.rows += len(rows)
            self.wrong_rows += int((buf.np[: len(rows)] != rows).sum())
        self.pending = keep

    def event(self, *args, **kwargs):
        """A ``torch.npu.Event`` stand-in: ``synchronize`` completes the uploads before its ``record``."""
        owner = self

        class _Event:
            mark = None

            def record(self, *a):
                self.mark = owner.uploads

            def synchronize(self):
                if self.mark is not None:
                    owner.execute(upto=self.mark)

        return _Event()
# Connector stats as vLLM's front end sees them (issue 26)
class StatsTap:
    """Turns ``inst``'s scheduler's ``log_stats`` on and hands every ``SchedulerStats`` its
    ``update_from_output`` makes to vLLM's own loggers: a ``PrometheusStatLogger`` whose metrics live
    in a registry of their own (``self.registry``, never vLLM's global one) and the
    ``KVConnectorLogging`` behind the "KV Transfer metrics" log line (``log_lines()``)."""

    def __init__(self, inst: PoolInstance):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
        from vllm.v1.metrics.loggers import PrometheusStatLogger
        from vllm.v1.metrics.stats import PrefixCacheStats

        self.registry = registry = CollectorRegistry()

        def own(cls):
            def __init__(self, *args, **kwargs):
                kwargs["registry"] = registry
                cls.__init__(self, *args, **kwargs)

            return type(cls.__name__, (cls,), {"__init__": __init__})

        metric = {"_gauge_cls": own(Gauge), "_counter_cls": own(Counter), "_histogram_cls": own(Histogram)}
        prom_cls = type("OwnKVConnectorProm", (KVConnectorProm,), dict(metric))
        logger_cls = type("OwnPrometheusStatLogger", (PrometheusStatLogger,), {**metric, "_kv_connector_cls": prom_cls})
        cfg = inst.configs[0]
        self.prom = logger_cls(cfg)
        self.logging = KVConnectorLogging(cfg.kv_transfer_config)
        self.stats: list = []  # every SchedulerStats, in order
        self.lines: list[str] = []
        sched = inst.scheduler
        sched.log_stats = True
        sched.kv_cache_manager.log_stats = True
        sched.kv_cache_manager.prefix_cache_stats = PrefixCacheStats()
        update = sched.update_from_output

        def update_from_output(scheduler_output, model_runner_output):
            outputs = update(scheduler_output, model_runner_output)
            for out in outputs.values():
                if out.scheduler_stats is not None:
                    self.stats.append(out.scheduler_stats)
                    self.prom.record(out.scheduler_stats, None, engine_idx=0)
                    if out.scheduler_stats.kv_connector_stats:
                        self.logging.observe(out.scheduler_stats.kv_connector_stats)
            return outputs

        sched.update_from_output = update_from_output

    def log_lines(self) -> list[str]:
        """Log the interval's "KV Transfer metrics" line as vLLM's LoggingStatLogger.log does; every line so far."""
        self.logging.log(log_fn=lambda fmt, *args: self.lines.append(fmt % args))
        return self.lines

    def scrape(self, prefix: str = "vllm:") -> dict[str, float]:
        """``generate_latest`` of the own registry: ``{'name{labels}': value}`` for samples under ``prefix``."""
        from prometheus_client import generate_latest

        out = {}
        for line in generate_latest(self.registry).decode().splitlines():
            if line.startswith(prefix):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out
