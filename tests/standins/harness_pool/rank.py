"""One TP rank (:class:`_Rank`): its caches laid out as vLLM lays out shared hybrid pages, its
layers (a GDN layer's state read is probed: :class:`_StateProbe`), its worker connector half and
runner state, and what its blocks hold; what it does in a step is :class:`~harness_pool.rank_step._RankStep`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as _np
import torch as _torch

import byte_store

from . import timing
from .model import CONV_ROWS, CONV_WINDOW, conv_rows, state_value, temporal_value
from .rank_step import _GDNComputed, _RankStep
from .runtime import _HOST_REGIONS, _placements, _process_of_rank, setup_runtime
from .timing import _ScaledWait

if TYPE_CHECKING:
    from .instance import PoolInstance


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


class _Rank(_RankStep):
    """One TP rank: its caches, layers, worker connector half and runner state."""

    def __init__(self, inst: "PoolInstance", rank: int):
        rt = setup_runtime()
        self.inst, self.rank = inst, rank
        #: the TP group's CPU (gloo) group when the ranks are processes (``PoolInstance(processes=True)``)
        self.group = None
        self.hidden: dict[str, int] = {}
        self.clean: dict[str, bool] = {}
        self.config = inst.configs[rank]
        self.kv_cache_config = inst.kv_cache_config
        self.in_forward = False
        self.so = None
        self.draft_pass = 0  # which draft token the MTP layer computes (the drafter's pass)
        self.draft_ok: dict[str, bool] = {}  # this step: the MTP layer read right, per request
        bs = inst.block_size
        self.layers: dict[str, _torch.nn.Module] = {}
        kv_caches: dict[str, object] = {}
        nb = self.kv_cache_config.num_blocks
        self._raw = []  # the raw allocations (registered with the pool once each)
        tensors = self.kv_cache_config.kv_cache_tensors
        # vLLM <= 0.29: one allocation per KVCacheTensor (its ``shared_by`` layers share it); vLLM 0.30:
        # every KVCacheTensor places its layers in ONE backing allocation of ``size`` bytes, and the
        # cache groups overlay each other (block b of a GDN layer and of an attention layer can be the
        # same bytes: allocate_kv_cache)
        self.one_backing = not all(hasattr(t, "shared_by") for t in tensors)
        for tensor in tensors:
            if self.one_backing and self._raw:
                raw = self._raw[0]
                assert tensor.size == raw.numel(), "KV cache tensors must share one backing allocation"
            else:
                raw = inst.pool_alloc(tensor.size)
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
            if timing.LOAD_WAIT_SCALE is not None and events:  # the list the receiving thread shares
                for i, ev in enumerate(events):
                    events[i] = _ScaledWait(timing.LOAD_WAIT_SCALE, set_=ev.is_set())
        # runner state
        from vllm.v1.worker import mamba_utils
        from vllm.v1.utils import CpuGpuBuffer

        self.requests: dict[str, object] = {}
        self.mamba_state_idx: dict[str, int] = {}
        self.input_batch = _InputBatch(inst.max_num_seqs)
        #: the accepted-token count each request's next GDN read starts from (the runner's
        #: ``num_accepted_tokens``, by request: the batch's rows move between steps)
        self.num_accepted: dict[str, int] = {}
        #: the draft tokens this rank proposed at its last step, by request (the runner's
        #: ``_draft_token_ids``: what async scheduling's placeholders stand for)
        self.next_drafts: dict[str, list[int]] = {}
        #: (draft tokens scheduled, accepted) of each request at this rank's previous step (async
        #: scheduling: the scheduler counted them all as computed)
        self.prev_spec: dict[str, tuple[int, int]] = {}
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

    def _write_gdn(self, tensors, conv_block: int, temporal_blocks: dict, seq, n: int, layer: int, key, corrupt=None) -> None:
        """A GDN layer's state writes: the conv state (the window ending at ``n`` tokens of ``seq``)
        into ``conv_block``, the temporal state after ``m`` tokens into each
        ``temporal_blocks[block] = m``; ``corrupt`` (an output hash): computed from a wrong read or
        hidden state, the values of no token sequence."""
        conv, ssm = tensors
        tb = ssm[0].numel() * ssm[0].element_size()
        rb = conv[0][0].numel() * conv[0].element_size()
        assert conv.shape[1] == CONV_ROWS, f"the harness's conv state has {CONV_ROWS} rows, not {conv.shape[1]}"
        if corrupt is None:
            value = b"".join(conv_rows(seq, n, layer, key, rb))
        else:
            value = state_value([*seq[:n], -1, corrupt], layer, f"{key}/conv", rb * CONV_ROWS)
        self._write_block([conv], conv_block, value)
        for block_id, m in temporal_blocks.items():
            if corrupt is None:
                value = temporal_value(seq, m, layer, key, tb)
            else:
                value = state_value([*seq[:m], -1, corrupt], layer, f"{key}/ssm", tb)
            self._write_block([ssm], block_id, value)

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
        layer, key = self.inst.layer_index[layer_name], self.rank_key(layer_name)
        if layer_name in self.inst.gdn_layers:
            return self._decode_gdn(list(list.__iter__(cache)), block_id, block_id, 0, self._tokens(st), layer, key)
        return self._decode(self._block_bytes(cache, block_id), self._tokens(st), layer, key, block_id)

    def _decode_gdn(self, tensors, conv_block: int, temporal_block: int, offset: int, tokens, layer: int, key) -> int | str:
        """The tokens a GDN state covers, read as the kernel reads it: the temporal state of
        ``temporal_block``, the conv window at row ``offset`` of ``conv_block``; both must name the
        same count (else "other")."""
        conv, ssm = tensors
        if 0 in (conv_block, temporal_block):
            return "null"
        c_raw, t_raw = self._block_bytes([conv], conv_block), self._block_bytes([ssm], temporal_block)
        if not any(c_raw) and not any(t_raw):
            return "zero"
        for t in range(len(tokens), -1, -1):
            if temporal_value(tokens, t, layer, key, len(t_raw)) == t_raw:
                break
        else:
            return "other"
        rb = len(c_raw) // CONV_ROWS
        window = [c_raw[(offset + i) * rb : (offset + i + 1) * rb] for i in range(CONV_WINDOW)]
        return t if window == conv_rows(tokens, t, layer, key, rb)[:CONV_WINDOW] else "other"
