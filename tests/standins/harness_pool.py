"""The pool harness: vLLM + vllm-ascend's layerwise KV pool on real objects, on a CPU (one harness).

:class:`PoolInstance` is one vLLM instance (scheduler + TP worker ranks) attached to a byte-level
MemCache pool (``byte_store``); :func:`make_pool`, :func:`engine_loop` (EngineCoreProc's loop) and
:class:`GDNRead` (what each layer read) go with it, and further sections add drivers on top of it:
:func:`soak` / :func:`slow_store` (liveness under a slow store), :class:`InFlightWrites` /
:class:`DelayedUploads` (async scheduling), :class:`StatsTap` (connector stats), and
:class:`Lifetime` / :class:`BlockOwners` (block lifetime under layerwise sends: which request's
block each save copy reads, copies held at a gate, failing or raising).

Usage:

  pool = make_pool()                                   # a byte-level MemCache pool (byte_store)
  a = PoolInstance(pool, name="A")                     # one vLLM instance attached to it
  a.add_request("a", prompt); engine_loop(a)           # EngineCoreProc's loop
  b = PoolInstance(pool, name="B")                     # a second instance, same pool
  ...; b.wrong_reads("b")                              # what each GDN layer read, right or not

Real: vLLM's ``Scheduler`` (``scheduler_config.get_scheduler_cls()``) with its KVCacheManager /
HybridKVCacheCoordinator in mamba ``align`` mode, with vllm-ascend's process-wide patches applied
as its platform plugin applies them (``load_general_plugins`` + ``pre_register_and_update`` ->
``adapt_patch(is_global_patch=True)``; the worker patches as its NPU worker applies them,
``adapt_patch()``); the AscendStore connector's scheduler and worker halves made by vLLM's
``KVConnectorFactory`` from a ``kv_transfer_config`` (use_layerwise, MemCache backend), the
worker's ``register_kv_caches`` and the layer sending / receiving threads it starts; vLLM's
``KVOutputAggregator``; ``NPUModelRunner.execute_model``'s order replayed with the functions
looked up where it looks them up (``handle_preemptions``, ``mamba_utils.preprocess_mamba``,
``NPUModelRunner.maybe_get_kv_connector_output`` / ``kv_connector_no_forward``,
``mamba_utils.do_mamba_copy_block``), each GDN layer entered through its (patched or not)
``AscendGatedDeltaNetAttention._forward_core`` and saved by ``ops.gdn``'s
``maybe_save_kv_layer_to_connector``, each attention layer through vLLM's
``maybe_transfer_kv_layer``.

Stood in for, and why:
- the model config is a tiny Qwen3-Next (``config.json`` in a temp dir, no weights, no hub);
  vLLM's model inspection subprocess gets the CPU stand-ins through a ``sitecustomize``;
- the KV cache specs are the harness's (``block_size`` tokens in every group, small states, the
  mamba page padded to the attention page): vllm-ascend's platform forces 128-token attention
  blocks for this model; the scheduler's block size is set the way EngineCore sets it (min of
  the groups' block sizes);
- MemCache: ``byte_store`` (real bytes, bounds-checked, faults, per-key write records);
- the NPU batch-copy kernel (``mamba_utils.batch_memcpy``, a Triton launcher on NPU): host
  ``memmove`` of the same (src, dst, size) rows, bounds-checked against the cache tensors;
- the NPU caches: host tensors laid out as vLLM lays out shared hybrid pages (one raw tensor per
  ``KVCacheTensor``, attention K/V and mamba conv/SSM views with the page as block stride);
- one process per TP rank: each rank's worker half is built while vllm-ascend's pool worker and
  MemCache backend see that rank's parallel state; each rank's step runs with its connector as
  the process's transfer group;
- the model's compute: a GDN layer "computes" when the original ``_forward_core`` first reads its
  state (``self.kv_cache[1]``): the harness records what the state block of each request holds
  (a :class:`GDNRead`), writes the state after this step's tokens, and stops the original there
  (the NPU kernels that follow cannot run on a CPU). Attention layers check their computed blocks
  and write the new ones the same way. Every state / KV block value names its content: "the
  state of layer L (TP slice R) after the first t tokens of this token sequence"
  (:func:`state_value`); a wrong read propagates (the layer writes a value derived from what it
  read), as a real model would compute on.
"""

from __future__ import annotations

import collections
import copy
import ctypes as _ctypes
import hashlib as _hashlib
import itertools
import json as _json
import os as _os
import tempfile as _tempfile
import threading
import time
import weakref
from contextlib import contextmanager as _contextmanager
from dataclasses import dataclass
from pathlib import Path as _Path
from types import SimpleNamespace as _NS
from typing import Callable

import numpy as _np
import torch as _torch

# imported with the harness: the library's patches of them are in place once a test imports it
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import kv_transfer as _kv_transfer  # noqa: F401
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import pool_scheduler as _pool_scheduler  # noqa: F401
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import pool_worker as _pool_worker  # noqa: F401

import byte_store
import rank_procs
from byte_store import PoolService  # noqa: F401

TIME_SCALE = 0.003  # save_kv_layer's 10 s wait -> 30 ms
GATE_LIMIT_S = 20.0  # Lifetime.drain waits at most this long for the sending threads to go quiet
#: PoolInstance.step: a step taking longer fails the test (watchdog). vllm-ascend 0.25.1rc1 may wait
#: 10 s for each layer whose load never comes (unpatched runs), so a legitimate step can take 20 s+.
STEP_LIMIT_S = 60.0
#: when set, every rank's layer-load events time their waits out after ``timeout x LOAD_WAIT_SCALE``
#: (vllm-ascend 0.25.1rc1's ``wait_for_layer_load`` waits 10 s for a load that never comes when
#: the library is off: a library-off control can shorten that without changing what it shows)
LOAD_WAIT_SCALE: float | None = None


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
    """The token the model samples after ``tokens`` when every state and KV block it read was right
    (deterministic, the same on every instance and schedule)."""
    d = _hashlib.blake2b(_np.asarray(tokens, dtype=_np.int64).tobytes(), digest_size=4).digest()
    return 10 + int.from_bytes(d, "little") % 50000


# -------------------------------------------------------------- the stand-in model's hidden state
# Each request carries a hidden state through the layers of a step. A layer's output is a function
# of the hidden state coming in and of the bytes it read (its GDN state, or every computed KV block
# of the request): from right bytes and a right hidden state it is the layer's true output for the
# tokens (the same whatever the chunking, as a real model's would be); from anything else it is a
# hash of the hidden state and of the bytes read. Each TP rank contributes its slice and the slices
# are summed (TP's all-reduce: a real collective over the TP group when ranks are processes), so one
# wrong byte on any rank changes the hidden state of every rank from that layer on, every state and
# KV block written after it, and the token sampled (:func:`sample`).
HIDDEN_BITS = 40
_HIDDEN_MASK = (1 << HIDDEN_BITS) - 1
CORRUPT_TOKEN_BASE = 50010  # a corrupted hidden state samples from [50010, 65536): never a clean token


def _h40(*parts) -> int:
    h = _hashlib.blake2b(digest_size=8, person=b"alp-hidden")
    for part in parts:
        h.update(part if isinstance(part, (bytes, bytearray)) else repr(part).encode())
    return int.from_bytes(h.digest(), "little") & _HIDDEN_MASK


def true_output(tokens, layer: int, rank: int) -> int:
    """Rank ``rank``'s slice of layer ``layer``'s output for the last of ``tokens``, computed from
    right inputs."""
    return _h40("out", _np.asarray(tokens, dtype=_np.int64).tobytes(), layer, rank)


def true_hidden(tokens, layer: int, tp: int) -> int:
    """The all-reduced output of layer ``layer`` from right inputs on every one of ``tp`` ranks."""
    return sum(true_output(tokens, layer, r) for r in range(tp))


def sample(tokens, hidden: int, clean: bool) -> int:
    """The token sampled from the last layer's hidden state."""
    return next_token(tokens) if clean else CORRUPT_TOKEN_BASE + hidden % (65536 - CORRUPT_TOKEN_BASE)


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
        #: the TP group's CPU (gloo) group when the ranks are processes (``PoolInstance(processes=True)``)
        self.group = None
        self.hidden: dict[str, int] = {}
        self.clean: dict[str, bool] = {}
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
        outputs = {}
        for req_id in self.input_batch.req_ids:
            st = self.requests[req_id]
            tokens = self._tokens(st)
            done, n = st.num_computed_tokens, so.num_scheduled_tokens[req_id]
            idx = (done + n - 1) // bs  # mamba_get_block_table_tensor (align): the block GDN reads and writes
            block_id = st.block_ids[group][idx]
            nbytes = sum(t[0].numel() * t[0].element_size() for t in tensors)
            ok, raw = True, b""
            if done > 0:  # has_initial_state
                raw = self._block_bytes(tensors, block_id)
                actual = self._decode(raw, tokens, layer, key, block_id)
                inst.reads.append(GDNRead(inst.name, self.rank, inst.steps, req_id, name, "gdn", idx, block_id, done, actual))
                ok = actual == done
            outputs[req_id] = out = self._layer_output(req_id, tokens[: done + n], layer, ok, raw)
            value = state_value(tokens[: done + n], layer, key, nbytes)
            if out is not None:  # computed on a wrong state or hidden state: so is everything after
                value = state_value([*tokens[: done + n], -1, out], layer, key, nbytes)
            if block_id == 0:  # vLLM's null block (BlockPool's first): shared by every request
                inst.null_writes.append((inst.steps, req_id, name))
            self._write_block(tensors, block_id, value)
        self._all_reduce(layer, outputs)

    def attention(self, query, layer_name):
        inst, so = self.inst, self.so
        layer = inst.layer_index[layer_name]
        group = inst.group_of[layer_name]
        k, v = self.layers[layer_name].kv_cache
        key = self.rank_key(layer_name)
        bs = inst.block_size
        nbytes = k[0].numel() * k[0].element_size() * 2
        outputs = {}
        for req_id in self.input_batch.req_ids:
            st = self.requests[req_id]
            tokens = self._tokens(st)
            done, n = st.num_computed_tokens, so.num_scheduled_tokens[req_id]
            ok, raw = True, []
            for b in range(-(-done // bs)):
                block_id = st.block_ids[group][b]
                want = min((b + 1) * bs, done)
                raw.append(self._block_bytes((k, v), block_id))
                actual = self._decode(raw[-1], tokens, layer, key, block_id)
                inst.reads.append(GDNRead(inst.name, self.rank, inst.steps, req_id, layer_name, "attn", b, block_id, want, actual))
                ok = ok and actual == want
            end = done + n
            outputs[req_id] = out = self._layer_output(req_id, tokens[:end], layer, ok, b"".join(raw))
            for b in range(done // bs, -(-end // bs)):
                upto = min((b + 1) * bs, end)
                # the KV of this step's tokens is computed from the hidden state coming in
                value = state_value(tokens[:upto], layer, key, nbytes) if out is None else state_value([*tokens[:upto], -1, out], layer, key, nbytes)
                self._write_block((k, v), st.block_ids[group][b], value)
        self._all_reduce(layer, outputs)
        return query

    # ------------------------------------------------------------------ the hidden state
    def _layer_output(self, req_id: str, tokens, layer: int, read_ok: bool, raw: bytes) -> int | None:
        """This rank's slice of the layer's output for ``req_id``: None when it is the true one (right
        bytes read, right hidden state coming in), else a hash of the hidden state and the bytes read."""
        if read_ok and self.clean[req_id]:
            return None
        return _h40("corrupt", layer, self.rank, self.hidden[req_id], raw)

    def _all_reduce(self, layer: int, outputs: dict) -> None:
        """TP's all-reduce of the layer's output slices: a SUM over the TP group's CPU (gloo) group
        when the ranks are processes; one rank's own slice otherwise (the instance sums the ranks'
        last hidden states when it samples, :meth:`PoolInstance._combine`)."""
        reqs = self.input_batch.req_ids
        ends = {r: self._tokens(self.requests[r])[: self.requests[r].num_computed_tokens + self.so.num_scheduled_tokens[r]] for r in reqs}
        mine = [true_output(ends[r], layer, self.rank) if outputs[r] is None else outputs[r] for r in reqs]
        if self.group is None:
            for r, value in zip(reqs, mine):
                self.hidden[r], self.clean[r] = value, outputs[r] is None
            return
        import torch.distributed as dist

        summed = _torch.tensor(mine, dtype=_torch.int64)
        dist.all_reduce(summed, group=self.group)
        for r, value in zip(reqs, summed.tolist()):
            self.hidden[r], self.clean[r] = value, value == true_hidden(ends[r], layer, self.inst.tp)

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
            # every request enters the first layer with the true embedding of its tokens
            self.hidden = dict.fromkeys(self.input_batch.req_ids, 0)
            self.clean = dict.fromkeys(self.input_batch.req_ids, True)
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
            out_tokens.append([sample(tokens[:end], self.hidden[req_id], self.clean[req_id])] if end >= len(tokens) else [])
        return ModelRunnerOutput(
            req_ids=list(self.input_batch.req_ids),
            req_id_to_index={r: i for i, r in enumerate(self.input_batch.req_ids)},
            sampled_token_ids=out_tokens,
            kv_connector_output=kv_output,
        )

    def accept(self, output) -> None:
        """The runner keeps the tokens sampled this step (the same on every rank)."""
        for req_id, toks in zip(output.req_ids, output.sampled_token_ids):
            if toks and req_id in self.requests:
                self.requests[req_id].output_token_ids.extend(toks)

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
        #: one process per TP rank with a real gloo TP group (rank_procs), as vLLM's MultiprocExecutor
        #: runs TP > 1; None: processes at TP > 1, the ranks in this process at TP 1 (UniProcExecutor)
        processes: bool | None = None,
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
        #: (step, request, layer) of every state a GDN layer wrote into the null block (block 0)
        self.null_writes: list[tuple[int, str, str]] = []
        self.kv_outputs: list = []
        self.steps = 0
        self.outputs: dict[str, list[int]] = {}
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
        output = self._execute(so, before_update=self.before_update)
        self.scheduler.update_from_output(so, output)
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
        outputs = self._run_ranks(so)
        output = self.aggregator.aggregate(outputs, 0) if self.aggregator is not None else outputs[0]
        if before_update is not None:  # sync scheduling: a hook on the output before the scheduler sees it
            before_update(self, so, output)
        self.kv_outputs.append(output.kv_connector_output)  # what the scheduler is told, per step
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
        """``save_kv_layer``'s 10 s wait for the step's last layer lasts 10 s x ``TIME_SCALE`` on
        every rank (its events become :class:`ScaledEvent` s, in the list the sending thread shares)."""
        self.on_ranks(_scale_save_wait)


def _contents(rank: _Rank, req_id: str, layers, block_index: int) -> list:
    return [rank.content(req_id, name, block_index) for name in layers]


def _scale_save_wait(rank: _Rank) -> None:
    events = rank.connector.connector_worker.layer_save_finished_events
    for i, ev in enumerate(events):
        scaled = ScaledEvent()
        if ev.is_set():
            scaled.set()
        events[i] = scaled


@_contextmanager
def groups_skipped(*groups: str):
    """Every target imported (:func:`_runtime`) and the library re-activated with ``groups`` skipped;
    afterwards re-activated as this process's environment says (``support.activate_skipping``)."""
    from support import activate_skipping

    _runtime()
    activate_skipping(*groups)
    try:
        yield
    finally:
        activate_skipping()


def reference_outputs(requests: dict[str, list[int]], max_tokens: int = 1, **kwargs) -> dict[str, list[int]]:
    """The tokens a run without the pool samples for each prompt (the same stand-in model)."""
    inst = PoolInstance(None, name="reference", **kwargs)
    for req_id, prompt in requests.items():
        inst.add_request(req_id, prompt, max_tokens=max_tokens)
    engine_loop(inst)
    return {req_id: list(inst.outputs.get(req_id, [])) for req_id in requests}


def differing_tokens(outputs: dict[str, list[int]], reference: dict[str, list[int]]) -> int:
    """How many of ``reference``'s tokens ``outputs`` does not have at their place."""
    return sum(sum(x != y for x, y in zip(outputs.get(r, []), ref)) + max(0, len(ref) - len(outputs.get(r, []))) for r, ref in reference.items())


def _ranks_here(inst: PoolInstance, driver: str) -> list:
    """The instance's ranks, for a driver that reaches into their memory from this process."""
    if inst.procs is not None:
        raise TypeError(f"{driver} reaches into the ranks' memory from the engine's process: build {inst.name} with processes=False")
    return inst.ranks


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
        for rank in _ranks_here(inst, "InFlightWrites"):
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
        bufs = _ranks_here(inst, "DelayedUploads")[rank].mamba_bufs.preprocess
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


# ==================================================================================================
# Block lifetime under layerwise sends (issue 24): which request's block each save copy reads
# ==================================================================================================
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
    return _os.getpid(), [(raw.data_ptr(), raw.numel(), raw.numel() // num_blocks) for raw in rank._raw]


def _send_backlog(rank: _Rank) -> int:
    return rank.connector.connector_worker.kv_send_thread.request_queue.qsize()


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
        g = int(key.split("@")[1])
        return (g, offset * len(groups[g].layer_names) // size) in wanted

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
        if not self.cs.sending_events:  # every send reported (the library keeps the loop going until then)
            return
        deadline = time.monotonic() + GATE_LIMIT_S
        while any(self.inst.on_ranks(_send_backlog)) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.02)  # the copy a thread took off its queue
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
        groups, gaps = self.inst.kv_cache_config.kv_cache_groups, []
        with self.pool.lock:
            for key in self.new_keys():
                blob = self.pool.blobs[key]
                if blob.state != "ready":
                    continue
                n, size = len(groups[int(key.split("@")[1])].layer_names), len(blob.data)
                if {off * n // size for off, _n, t, ok in blob.writes if ok and t <= blob.finished_at} != set(range(n)):
                    gaps.append(key)
        return gaps

    def finished(self) -> dict[str, int]:
        """This workload's finished keys and their results."""
        with self.pool.lock:
            return {k: self.pool.blobs[k].result for k in self.new_keys() if self.pool.blobs[k].state != "writing"}

    def unfinished(self) -> list[str]:
        """This workload's keys allocated but never finished (MemCache keeps them invisible)."""
        with self.pool.lock:
            return [k for k in self.new_keys() if self.pool.blobs[k].state == "writing"]


def make_lifetime(*, tp: int = 1, num_blocks: int = 16, chunk: int = 8, seed_skip_touch: bool = False) -> Lifetime:
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
        # as long as the cache allows (vLLM checks it); 128 as test_send_pool's instances (one model config)
        max_model_len=24 if num_blocks < 10 else 28 if num_blocks < 48 else 128,
    )
    inst.scale_save_wait()
    return Lifetime(inst, seed_skip_touch=seed_skip_touch)
