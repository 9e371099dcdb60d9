"""Group ``pool_metrics``: mamba state bytes loaded from the pool (worker, the layerwise receiving thread).

The receiving thread's ``_handle_request`` copies one layer of every KV cache group in one
``_batch_copy_with_limits`` call (pool -> device, direction 1). Before it runs, the wrapper sums the
bytes of the layer's mamba-group (GDN state) tasks: blocks in the task's shared block data (built once
per step and group by the worker; what the copy's address arrays are built from) times the bytes of
one block of that layer, read once per (group, layer) from the group's own ``LayerBatchBuilder``
(``_build_transfer_arrays`` for one block: the same sizes the copy uses, on both releases' layouts).
The copy's wrapper counts them in ``pool_events`` (``mamba_state_bytes_loaded``) only when the copy
returned 0: a failed, raising (load_failures turns that into -1 on 0.25) or skipped copy counts
nothing. Mamba groups (KV cache groups of ``MambaSpec`` layers) are read from the worker's
``kv_cache_config`` once, when ``KVPoolWorker._build_shared_load_data`` first runs (the thread has no
link to its worker; the ReqMeta it gets does not say which group is mamba).
"""

from __future__ import annotations

import functools
import importlib

from ... import pool_events
from .._checks import expects as _expects
from .._checks import source as _source
from .._targets import STORE

_BYTES = "_ascend_layerwise_patch_mamba_bytes"  # receiving thread: this layer's mamba bytes, until its copy
_MAMBA = "_ascend_layerwise_patch_mamba_groups"  # receiving thread: its worker's mamba group ids
_BLOCK = "_ascend_layerwise_patch_mamba_block_bytes"  # receiving thread: {(group, layer idx): bytes of one block}
G2L = 1  # _batch_copy_with_limits' direction for a load


def _block_bytes(thread, group_id: int, layer_idx: int) -> int:
    table = thread.__dict__.get(_BLOCK)
    if table is None:
        table = thread.__dict__[_BLOCK] = {}
    n = table.get((group_id, layer_idx))
    if n is None:
        import numpy as np

        builders = getattr(thread, "group_builders", None)
        builder = builders[group_id] if builders else thread.layer_batch_builder
        one = np.ones(1, dtype=np.int64)  # block id / GVA of one block: only the sizes are read
        _addrs, sizes, _gvas = builder._build_transfer_arrays(one, one, layer_idx)
        n = table[(group_id, layer_idx)] = int(sizes.sum())
    return n


def mamba_bytes(thread, tasks) -> int:
    """Bytes of the mamba-group blocks this layer's load copies (0 if none)."""
    mamba = thread.__dict__.get(_MAMBA)
    if not mamba:
        return 0
    total = 0
    for task in tasks:
        if task.group_id in mamba:
            shared = task.shared_block_data  # None: the worker built none (no block ranges), nothing copied
            if shared is not None and len(shared.block_ids_arr):
                total += len(shared.block_ids_arr) * _block_bytes(thread, task.group_id, task.layer_idx_in_group)
    return total


def _mamba_groups(worker) -> frozenset[int]:
    """The worker's KV cache groups of MambaSpec layers (GDN states)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    config = getattr(worker, "kv_cache_config", None)
    groups = set()
    for group_id, group in enumerate(config.kv_cache_groups if config is not None else ()):
        spec = group.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        specs = inner.values() if inner else (spec,)
        if any(isinstance(s, MambaSpec) for s in specs):
            groups.add(group_id)
    return frozenset(groups)


def make_build_shared_load(original):
    """``KVPoolWorker._build_shared_load_data``: tell the receiving thread (once) which groups are mamba."""

    @functools.wraps(original)
    def _build_shared_load_data(self):
        result = original(self)
        recv = self.kv_recv_thread
        if recv is not None and _MAMBA not in recv.__dict__:
            recv.__dict__[_MAMBA] = _mamba_groups(self)
        return result

    return _build_shared_load_data


def make_recv_handle(original):
    @functools.wraps(original)
    def _handle_request(self, data):
        n = mamba_bytes(self, data.transfer_tasks)  # before the thread clears the list
        if not n:
            return original(self, data)
        self.__dict__[_BYTES] = n
        try:
            return original(self, data)
        finally:
            self.__dict__.pop(_BYTES, None)

    return _handle_request


def make_batch_copy(original):
    @functools.wraps(original)
    def _batch_copy_with_limits(self, gvas, addrs, sizes, direction, *args, **kwargs):
        res = original(self, gvas, addrs, sizes, direction, *args, **kwargs)
        if direction == G2L:
            n = self.__dict__.pop(_BYTES, 0)
            if n and res == 0:
                pool_events.bump("mamba_state_bytes_loaded", n)
        return res

    return _batch_copy_with_limits


# ----------------------------------------------------------------------------- checks on targets
def _handle_ok(original) -> str | None:
    problem = _expects(["self", "data"], needs=("transfer_tasks", "_batch_copy_with_limits", "shared_block_data"))(original)
    if problem:
        return problem
    kv_transfer = importlib.import_module(f"{STORE}.kv_transfer")
    params = list(__import__("inspect").signature(kv_transfer.LayerBatchBuilder._build_transfer_arrays).parameters)
    if params != ["self", "block_ids_arr", "base_gvas_arr", "layer_id"]:
        return f"LayerBatchBuilder._build_transfer_arrays parameters are {params}"
    if "build_addrs" not in _source(original) or "_build_transfer_arrays" not in _source(kv_transfer.LayerBatchBuilder.build_addrs):
        return "the receiving thread no longer builds its addresses with LayerBatchBuilder._build_transfer_arrays"
    return None


def build_shared_ok(original) -> str | None:
    problem = _expects(["self"], needs=("kv_recv_thread", "shared_block_data"))(original)
    if problem:
        return problem
    if "self.kv_cache_config =" not in _source(original.__globals__["KVPoolWorker"].__init__):
        return "KVPoolWorker no longer keeps its kv_cache_config"
    return None


_COPY = ["self", "gvas", "addrs", "sizes", "direction", "max_transfer_blocks", "max_transfer_bytes"]
copy_ok = _expects(_COPY, needs=("batch_copy",))
handle_ok = _handle_ok
