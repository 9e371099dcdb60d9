"""Process-wide setup and state, each once per process: vLLM's plugins and vllm-ascend's patches
(:func:`setup_runtime`), vLLM's NONE_HASH (:func:`set_none_hash`), the tiny Qwen3-Next checkpoints
(:func:`checkpoint_dir`) and model configs, every rank's cache tensors with the NPU batch copy's
host stand-in, and the parallel state / KV transfer group one rank's worker half sees."""

from __future__ import annotations

import ctypes as _ctypes
import json as _json
import os as _os
import tempfile as _tempfile
from contextlib import contextmanager as _contextmanager
from pathlib import Path as _Path
from types import SimpleNamespace as _NS

from byte_store import PoolService


_CHILD_SITE = _Path(__file__).resolve().parent.parent / "child_site"
_MODEL_DIRS: dict[tuple, str] = {}
_MODEL_CONFIGS: dict[tuple, object] = {}
_HOST_REGIONS: list[tuple[int, int]] = []  # every cache tensor of every rank (batch_memcpy bounds)
_RT = _NS(ready=False)


def make_pool(store: str | None = None) -> PoolService:
    """A fresh pool; instances created with it share it. ``store``: "memcache" (the real MemCache,
    ``memcache_pool``: one key namespace on this process's MetaService) or "bytes" (``byte_store``);
    None: :func:`default_store`."""
    store = store or default_store()
    if store == "bytes":
        return PoolService()
    if store != "memcache":
        raise ValueError(f"store must be 'memcache' or 'bytes', not {store!r}")
    import memcache_pool

    return memcache_pool.MemcachePool(memcache_cluster())


#: the MemCache versions the pool suite runs on by default (every pair's own: 1.3.0 on v0251 / v0250,
#: 1.2.0 on v0260 / v0300 / v0290; scripts/matrix.sh runs v0250's and v0290's on the byte store)
DEFAULT_ON = ("1.2.", "1.3.")


def default_store() -> str:
    """The store :func:`make_pool` uses: ``$ALP_POOL_STORE`` ("memcache" / "bytes"), else the real
    MemCache where the pair's venv has a version of ``DEFAULT_ON``, else the byte store."""
    import memcache_host

    chosen = _os.environ.get("ALP_POOL_STORE")
    if chosen:
        return chosen
    return "memcache" if (memcache_host.version() or "").startswith(DEFAULT_ON) else "bytes"


def memcache_cluster():
    """This process's MetaService and MemCache agents (started on first use, stopped at exit)."""
    if getattr(_RT, "cluster", None) is None:
        import atexit

        import memcache_host

        _RT.cluster = memcache_host.Cluster()
        atexit.register(_RT.cluster.close)
    return _RT.cluster


def setup_runtime():
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


def set_none_hash(value: bytes | None = None) -> None:
    """vLLM's ``NONE_HASH`` (the parent hash of every request's first block), after
    :func:`setup_runtime`. ``value`` None: ``init_none_hash`` once per process (instances sharing a
    pool share it, as processes sharing ``PYTHONHASHSEED`` do); else ``value`` (another process's,
    so that its block hashes and this one's agree), kept by every instance made afterwards."""
    setup_runtime()
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    if value is None and getattr(_RT, "none_hash", False):
        return
    kv_cache_utils.init_none_hash(sha256)
    if value is not None:
        kv_cache_utils.NONE_HASH = kv_cache_utils.BlockHash(value)
    _RT.none_hash = True


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


def checkpoint_dir(pattern: str, kv_heads: int, folder: str | None = None) -> str:
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
                model=model_dir or checkpoint_dir(pattern, kv_heads), skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16"
            )
        finally:
            if old is None:
                _os.environ.pop("PYTHONPATH", None)
            else:
                _os.environ["PYTHONPATH"] = old
    return _MODEL_CONFIGS[key]


def _speculative_config(model_config, num_tokens: int):
    """vLLM's SpeculativeConfig for the stand-in model's MTP (``qwen3_next_mtp``: the checkpoint is a
    Qwen3-Next one; Qwen3.5's ``qwen3_5_mtp`` is the same method family, ``use_eagle()`` true), with
    ``num_tokens`` speculative tokens. vLLM inspects the draft architecture in a subprocess: it gets
    the CPU stand-ins as ``_model_config`` gives them."""
    from vllm.config import ParallelConfig, SpeculativeConfig

    old = _os.environ.get("PYTHONPATH")
    _os.environ["PYTHONPATH"] = _os.pathsep.join(p for p in (str(_CHILD_SITE), old) if p)
    try:
        return SpeculativeConfig(
            method="qwen3_next_mtp",
            num_speculative_tokens=num_tokens,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        )
    finally:
        if old is None:
            _os.environ.pop("PYTHONPATH", None)
        else:
            _os.environ["PYTHONPATH"] = old


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
