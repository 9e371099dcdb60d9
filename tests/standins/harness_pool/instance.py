"""One vLLM instance (:class:`PoolInstance`): vLLM's scheduler and ``tp`` worker ranks (in this
process, or one process each: ``rank_procs``), attached to a byte-level MemCache pool or to none,
stepped as ``EngineCore.step`` / ``step_with_batch_queue``."""

from __future__ import annotations

import collections
import copy
import threading
import weakref

import torch as _torch

import byte_store
import rank_procs
from byte_store import PoolService

from . import timing
from .model import sample
from .rank import _Rank
from .rank_step import GDNRead
from .runtime import _model_config, _process_of_rank, _speculative_config, set_none_hash, setup_runtime
from .timing import ScaledEvent


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
        #: MTP speculative decoding: a speculative config with the model's MTP method and this many
        #: speculative tokens (the scheduler and the pool scheduler see it as vLLM builds it; the
        #: mamba spec reserves as many speculative blocks), the MTP attention layer in the KV cache
        #: (``mtp.layers.0.self_attn.attn``, as vLLM names Qwen3-Next's / Qwen3.5's) and a stand-in
        #: drafter (:meth:`~harness_pool.rank_step._RankStep.draft`). 0: none
        mtp: int = 0,
        #: under MTP, the drafter replayed as a captured graph: its MTP layer computes without the
        #: connector's layer hooks (a full graph runs no Python wrapper)
        draft_graph: bool = False,
        kv_load_failure_policy: str = "fail",  # vLLM's default
        additional_config: dict | None = None,  # vllm-ascend's (``--additional-config``)
        model_dir: str | None = None,  # the checkpoint folder (``checkpoint_dir``); default: one per (pattern, kv_heads)
        pp: int = 1,  # pipeline stages (the harness runs stage 0's ranks; see stage_workers)
        long_prefill_token_threshold: int = 0,  # vLLM's per-request chunk limit (0: none)
        async_scheduling: bool = False,  # vLLM's AsyncScheduler, stepped as step_with_batch_queue (depth 2)
        #: one process per TP rank with a real gloo TP group (rank_procs), as vLLM's MultiprocExecutor
        #: runs TP > 1; None: processes at TP > 1, the ranks in this process at TP 1 (UniProcExecutor)
        processes: bool | None = None,
    ):
        setup_runtime()
        from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, SchedulerConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
        from vllm.model_executor.models import ModelRegistry
        from vllm.utils.hashing import sha256 as _sha256
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_kv_cache_configs,
            get_request_block_hasher,
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
                speculative_config=speculative,
            )
            cfg.cache_config.block_size = block_size  # as EngineCore sets it from the KV cache groups
            if hasattr(cfg.cache_config, "get_resolved_kv_cache_layout"):  # vLLM 0.30: EngineCore resolves
                cfg.cache_config.kv_cache_layout = "LBNHC"  # one layout (NHD: the harness's K/V views)
            return cfg

        speculative = _speculative_config(model_config, mtp) if mtp else None
        if mtp:
            num_speculative_blocks = max(num_speculative_blocks, mtp)
        self.configs = [config(r) for r in range(tp)]
        self.layer_order = [f"model.layers.{i}." + ("linear_attn" if c == "G" else "self_attn.attn") for i, c in enumerate(pattern)]
        self.gdn_layers = [n for n in self.layer_order if "linear_attn" in n]
        self.attn_layers = [n for n in self.layer_order if n not in self.gdn_layers]
        #: the draft model's attention layer (its KV cache sits in the target's attention group, as the
        #: runner's KV cache spec holds every attention layer of the forward context); its values are
        #: those of layer ``num_hidden_layers`` (the MTP layer follows the target's last)
        self.mtp = mtp
        self.max_model_len = max_model_len
        self.draft_graph = draft_graph
        self.mtp_layers = ["mtp.layers.0.self_attn.attn"] if mtp else []
        self.layer_index = {n: i for i, n in enumerate([*self.layer_order, *self.mtp_layers])}
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
        self.specs = {n: (mamba if n in self.gdn_layers else attn) for n in [*self.layer_order, *self.mtp_layers]}
        group_size = max(len(self.gdn_layers), len(self.attn_layers) + len(self.mtp_layers))
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
        set_none_hash()  # once: instances sharing a pool share PYTHONHASHSEED
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
        #: every proposal of the stand-in drafter, per rank (:class:`~harness_pool.rank_step.Draft`)
        self.drafts: list = []
        #: (step, request, layer) of every state a GDN layer wrote into the null block (block 0)
        self.null_writes: list[tuple[int, str, str]] = []
        self.kv_outputs: list = []
        self.steps = 0
        self.outputs: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.after_schedule = None  # callable(inst, scheduler_output): runs before the ranks execute
        #: callable(inst, scheduler_output, output): runs on the aggregated output before the scheduler
        #: is updated from it (EngineCore.step; sync scheduling only), e.g. to add a connector report
        self.before_update = None
        #: async scheduling: EngineCore's batch queue (depth 2, as with async_scheduling and no PP)
        self.batch_queue_size = 2 if async_scheduling else 0
        self.batch_queue: collections.deque = collections.deque()
        self.aggregator = (
            KVOutputAggregator.from_connector(self.scheduler.connector, tp) if self.scheduler.connector is not None else None
        )

        def attention(query, layer_name):
            return self._current_rank.attention(query, layer_name)

        self.attention_op = maybe_transfer_kv_layer(attention)
        self.procs = self._current_rank = None
        if processes is None:
            processes = tp > 1
        if mtp and tp > 1 and not processes:
            raise ValueError("MTP at TP > 1 needs one process per rank: a speculative step's verification reads the all-reduced hidden state")
        #: under MTP, the draft tokens the runner proposed at the last step, by request (the engine
        #: hands them to the scheduler after it, as EngineCore.post_step does with sync scheduling)
        self.proposals: dict[str, list[int]] = {}
        if processes:  # vLLM's MultiprocExecutor: each rank's state lives in its own process
            self.ranks = []
            self.procs = rank_procs.RankProcesses(self, _Rank)
            weakref.finalize(self, self.procs.close)
        else:  # every rank in this process (UniProcExecutor's shape at TP 1)
            self.ranks = [_Rank(self, r) for r in range(tp)]
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

    def pool_alloc(self, size: int):
        """A cache tensor's memory: ``size`` zeroed bytes at a 2 MiB boundary (vllm-ascend's
        register_kv_caches aligns regions down to 2 MiB); on the real MemCache, device memory its
        client maps (``memcache_host.device_buffer``)."""
        if getattr(self.pool, "real", False):  # MemcachePool, or a rank process's RemoteService of one
            import memcache_host

            return memcache_host.device_buffer(size)[:size]
        align = 2 * 1024 * 1024
        raw = _torch.zeros(size + align, dtype=_torch.uint8)
        start = (-raw.data_ptr()) % align
        return raw[start : start + size]

    def pool_register(self, raw) -> None:
        if self.pool is not None:
            self.pool.register_region(raw.data_ptr(), raw.numel())

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt: list[int], max_tokens: int = 1):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, block_hasher=self.hasher)
        self.max_tokens[req_id] = max_tokens
        self.scheduler.add_request(request)
        return request

    def has_work(self) -> bool:
        """``EngineCoreProc.has_work`` for one engine without DP or a batch queue."""
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self):
        """``EngineCore.step``: schedule, execute on every rank, aggregate, update. None if idle.

        Runs under a watchdog: a step still running after ``timing.STEP_LIMIT_S`` fails the test (its
        thread is left behind, blocked) instead of hanging the run."""
        done: dict = {}

        def run():
            try:
                done["so"] = self._step_with_batch_queue() if self.batch_queue_size else self._step()
            except BaseException as exc:  # handed to the caller's thread
                done["error"] = exc

        thread = threading.Thread(target=run, name=f"pool-step-{self.name}-{self.steps}", daemon=True)
        thread.start()
        thread.join(timing.STEP_LIMIT_S)
        if thread.is_alive():
            import sys
            import traceback

            where = "".join(traceback.format_stack(sys._current_frames().get(thread.ident)))
            raise AssertionError(f"instance {self.name}: step {self.steps} still running after {timing.STEP_LIMIT_S} s (hung) at\n{where}")
        if "error" in done:
            raise done["error"]
        return done["so"]

    def _step(self):
        if not self.scheduler.has_requests():
            return None
        so = self.scheduler.schedule()
        if self.after_schedule is not None:  # e.g. the pool evicts a key between hit check and load
            self.after_schedule(self, so)
        output = self._execute(so, before_update=self.before_update)
        self.scheduler.update_from_output(so, output)
        if self.proposals and so.total_num_scheduled_tokens:  # EngineCore.post_step (sync scheduling)
            from vllm.v1.outputs import DraftTokenIds

            self.scheduler.update_draft_token_ids(DraftTokenIds(list(self.proposals), [list(p) for p in self.proposals.values()]))
        return so

    def _run_ranks(self, so) -> list:
        """Every rank executes ``so``; their outputs, each rank's sampled tokens already kept."""
        if self.procs is not None:
            return self.procs.execute(so, self.steps, self)
        outputs = []
        for rank in self.ranks:
            self._current_rank = rank
            # each worker deserializes its own copy of the scheduler output, and the executor gets a
            # fresh copy of each worker's output: a rank with nothing to report returns vLLM's
            # module-global EMPTY_MODEL_RUNNER_OUTPUT (kv_connector_no_forward), on which the
            # aggregator would set this step's aggregated kv_connector_output -- every later empty
            # step of every instance in this process would report it again (stale completed events)
            outputs.append(copy.copy(rank.execute(copy.deepcopy(so))))
        if self.tp > 1:  # ranks in one process: TP's all-reduce of the last hidden states, then sampling
            self._combine(outputs)
        for rank, output in zip(self.ranks, outputs):
            rank.accept(output)
        return outputs

    def _combine(self, outputs) -> None:
        ranks = self.ranks
        for i, req_id in enumerate(outputs[0].req_ids):
            if not outputs[0].sampled_token_ids[i]:
                continue
            st = ranks[0].requests[req_id]
            tokens = ranks[0]._tokens(st)[: st.num_computed_tokens + ranks[0].so.num_scheduled_tokens[req_id]]
            hidden = sum(rank.hidden[req_id] for rank in ranks)
            clean = all(rank.clean[req_id] for rank in ranks)
            token = sample(tokens, hidden, clean)
            for output in outputs:
                output.sampled_token_ids = list(output.sampled_token_ids)
                output.sampled_token_ids[i] = [token]

    def _execute(self, so, before_update=None):
        """Every rank executes ``so``; the aggregated output (what the executor's future yields)."""
        first_draft = len(self.drafts)
        outputs = self._run_ranks(so)
        output = self.aggregator.aggregate(outputs, 0) if self.aggregator is not None else outputs[0]
        if self.mtp:  # the runner's draft tokens: the drafter's proposal (right on every rank), or zeros
            drafted = {req_id: d for (_step, req_id, _pos), d in _by_proposal(self.drafts[first_draft:]).items()}
            self.proposals = {
                r: drafted[r].proposal(self.mtp) if r in drafted else [0] * self.mtp
                for r, toks in zip(output.req_ids, output.sampled_token_ids)
                if toks
            }
        if before_update is not None:  # sync scheduling: a hook on the output before the scheduler sees it
            before_update(self, so, output)
        self.kv_outputs.append(output.kv_connector_output)  # what the scheduler is told, per step
        for req_id, toks in zip(output.req_ids, output.sampled_token_ids):
            if toks:
                # a speculative step's tokens past max_tokens are dropped (the scheduler's stop check)
                got = self.outputs.setdefault(req_id, [])
                got.extend(toks[: max(0, self.max_tokens.get(req_id, len(got) + len(toks)) - len(got))])
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

    def acceptance(self, req_id: str | None = None) -> dict[str, int]:
        """The stand-in drafter's proposals verified against the tokens the target sampled after them
        (vLLM's rejection sampler at temperature 0: a draft token counts while it and every one before
        it equal the target's): ``proposed`` draft tokens that had a target token to meet, ``accepted``
        of them, over ``drafts`` proposals. A proposal is right only where its MTP reads were right on
        every rank (``Draft.ok``, combined over the ranks here)."""
        by_proposal = _by_proposal(d for d in self.drafts if req_id is None or d.req_id == req_id)
        proposed = accepted = 0
        for d in by_proposal.values():
            later = self.outputs.get(d.req_id, [])[d.position + 1 : d.position + 1 + self.mtp]
            proposed += len(later)
            for got, want in zip(d.proposal(self.mtp), later):
                if got != want:
                    break
                accepted += 1
        return {"drafts": len(by_proposal), "proposed": proposed, "accepted": accepted}

    def first_step_of(self, req_id: str) -> int | None:
        steps = [r.step for r in self.reads if r.req_id == req_id]
        return min(steps) if steps else None

    def wrong_reads(self, req_id: str | None = None, *, kind: str = "gdn") -> list[GDNRead]:
        return [r for r in self.reads_of(req_id, kind=kind) if not r.ok]

    # ------------------------------------------------------------------ time
    def on_ranks(self, fn, *args) -> list:
        """``fn(rank, *args)`` on every rank, in its process (``fn``: a module-level function)."""
        if self.procs is not None:
            return self.procs.call(fn, *args)
        return [fn(rank, *args) for rank in self.ranks]

    def contents(self, req_id: str, layers, block_index: int) -> dict[tuple[int, str], int | str]:
        """What every rank's block ``block_index`` of ``req_id`` holds now for each of ``layers``
        (:meth:`_Rank.content`), by (rank, layer)."""
        per_rank = self.on_ranks(_contents, req_id, list(layers), block_index)
        return {(r, name): value for r, values in enumerate(per_rank) for name, value in zip(layers, values)}

    def rank_records(self) -> list:
        """The WARNING (and above) records vLLM's logger got in the rank processes, as
        ``logging.LogRecord`` s with a ``rank`` attribute; [] when the ranks live in this process
        (their records went to this process's handlers, e.g. the ``vllm_log`` fixture)."""
        import logging

        if self.procs is None:
            return []
        return [logging.makeLogRecord(d) for per_rank in self.procs.call(rank_procs.log_records) for d in per_rank]

    def close(self) -> None:
        """Ends the rank processes (nothing to do when the ranks live in this process)."""
        if self.procs is not None:
            self.procs.close()

    def scale_save_wait(self) -> None:
        """``save_kv_layer``'s 10 s wait for the step's last layer lasts 10 s x ``timing.TIME_SCALE`` on
        every rank (its events become :class:`ScaledEvent` s, in the list the sending thread shares)."""
        self.on_ranks(_scale_save_wait)


def _by_proposal(drafts) -> dict:
    """The ranks' records of each proposal combined, by (step, request, position): right only where
    every rank's MTP reads were right."""
    combined: dict = {}
    for d in drafts:
        key = (d.step, d.req_id, d.position)
        combined[key] = combined.get(key, d)._replace(ok=combined.get(key, d).ok and d.ok)
    return combined


def _contents(rank: _Rank, req_id: str, layers, block_index: int) -> list:
    return [rank.content(req_id, name, block_index) for name in layers]


def _scale_save_wait(rank: _Rank) -> None:
    events = rank.connector.connector_worker.layer_save_finished_events
    for i, ev in enumerate(events):
        scaled = ScaledEvent()
        if ev.is_set():
            scaled.set()
        events[i] = scaled
