"""The align-mode mamba pre-copy waits for the layerwise load of its source block.

Target   vllm.v1.worker.mamba_utils: collect_mamba_copy_meta (records which request / layer each
         copy row belongs to) and do_mamba_copy_block (splits the rows); the GDN layer entry of
         ``gdn_layerwise`` applies a layer's deferred rows. Same group as ``gdn_layerwise``.
Versions vLLM >=0.25.0,<0.31 but 0.27 / 0.28; vllm-ascend >=0.25.1,<0.31 but 0.27-0.29 (0.30.0rc2: issue 25). vllm-ascend 0.26.0rc1's execute_model still
         calls ``do_mamba_copy_block`` right after ``maybe_get_kv_connector_output`` (same defect).
Why      ``NPUModelRunner.execute_model`` collects the pre-copy rows with
         ``mamba_utils.preprocess_mamba`` (vllm-ascend's version: source block
         ``(num_computed - 1) // block_size`` -> destination ``cdiv(num_computed + scheduled,
         block_size) - 1``), enters ``maybe_get_kv_connector_output`` (bind + ``start_load_kv``) and
         calls ``do_mamba_copy_block`` at once. In layerwise mode ``start_load_kv`` only builds the
         per-layer load tasks; each layer's load runs from that layer's wait. So on a pool hit
         the copy reads its source block before the load has written it, and every GDN layer of the
         request's first step computes from the destination block's stale bytes.
How      ``collect_mamba_copy_meta`` (when a KV connector exists) remembers, per call, the row range,
         the request and the source block index; rows are laid out group -> layer -> state, so the
         layer of every row is known. ``do_mamba_copy_block``, when the bound connector metadata of
         a layerwise connector has loads this step, keeps upstream's bulk copy for every row whose
         source no load writes, and defers the others: rows are reordered (bulk first, then per
         layer), uploaded once, the bulk slice copied at once with the same batch-copy kernel
         (``mamba_utils.batch_memcpy``), and each layer's slice is copied by that GDN layer's entry
         right after its ``wait_for_kv_layer_from_connector`` (load complete) and before it reads
         its state. No extra device synchronisation, no per-layer upload. A row counts as written by
         a load when its source block index lies in the request's load range of that mamba group,
         ``[vllm_cached_tokens // block_size, cdiv(kvpool_cached_tokens, block_size))`` (deferring a
         row is always safe: it still runs before its layer reads). Without a connector, without
         layerwise loads, and for requests without a load, the path is upstream's, unchanged.
         Pinned rows vs async scheduling (issue 23): ``preprocess_mamba`` fills the pinned
         ``src_ptrs`` / ``dst_ptrs`` / ``sizes`` inside ``synchronize_input_prep`` but the upload
         (``copy_to_gpu``, non-blocking) is enqueued later, after that block recorded its event: the
         next step's wait does not cover it, and its ``preprocess_mamba`` can rewrite the rows before
         the device read them (vllm-ascend 0.25.1rc1 and 0.26.0rc1 alike; with or without a pool).
         ``do_mamba_copy_block`` records an NPU event (``torch.npu.Event``, blocking) after the
         upload -- upstream's path or ours -- and the next step's first ``collect_mamba_copy_meta``
         (offset 0, before any row is written) synchronizes it. Counted in ``status()``.
         Why the same group as ``gdn_layerwise``: only a process whose GDN layers wait per layer can
         apply the rows per layer; a process that waits per layer but pre-copies in bulk is the bug.
Removal  When vLLM-Ascend's runner defers the pre-copy itself (upstream did it on its V2 model
         runner after 0.26; detected: the group skips itself when ``model_runner_v1`` no longer
         calls ``do_mamba_copy_block``).
"""

from __future__ import annotations

import functools
import importlib

from .._checks import param_names as _params
from .._targets import STATE
from ._group import GROUP  # applies with the GDN per-layer wait, or not at all

MAMBA_UTILS = "vllm.v1.worker.mamba_utils"
COLLECT_PARAMS = [
    "copy_bufs",
    "kv_cache_config",
    "mamba_state_copy_funcs",
    "mamba_group_ids",
    "src_block_idx",
    "dest_block_idx",
    "accept_token_bias",
    "req_state",
    "forward_context",
]

#: rows collected this step: (first row, end row, request id, source block index, group ids, states per layer, kv_cache_config)
_ROWS: list[tuple] = []
#: layer name -> (src, dst, sizes) device slices still to copy this step
PENDING: dict[str, tuple] = {}
#: attributes this module keeps on a runner's MambaCopyBuffers: the upload's event, and whether it
#: was recorded since the last wait
UPLOAD_EVENT, UPLOAD_PENDING = "_alp_upload_event", "_alp_upload_pending"
_COUNTS = {"upload_events": 0, "upload_waits": 0}


def _collect_precondition(original) -> str | None:
    if _params(original) != COLLECT_PARAMS:
        return f"collect_mamba_copy_meta parameters are {_params(original)}, expected {COLLECT_PARAMS}"
    return None


def _copy_precondition(original) -> str | None:
    import inspect

    if _params(original) != ["copy_bufs"]:
        return f"do_mamba_copy_block parameters are {_params(original)}"
    if "batch_memcpy" not in inspect.getsource(original):
        return "do_mamba_copy_block no longer launches mamba_utils.batch_memcpy"
    utils = importlib.import_module(MAMBA_UTILS)
    fields = getattr(utils.MambaCopyBuffers, "__dataclass_fields__", {})
    missing = {"src_ptrs", "dst_ptrs", "sizes", "offset"} - set(fields)
    if missing:
        return f"MambaCopyBuffers lost {sorted(missing)}"
    if "__slots__" in vars(utils.MambaCopyBuffers):
        return "MambaCopyBuffers has __slots__: no room for the upload's event"
    return None


ASCEND_STORE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector"


def _defines(module: str, cls: str, method: str) -> bool:
    """Whether ``module``'s source defines ``cls.method`` (read, never imported: the connector module
    imports this one's target)."""
    import ast

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return False
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return any(
        isinstance(node, ast.ClassDef)
        and node.name == cls
        and any(isinstance(item, ast.FunctionDef) and item.name == method for item in node.body)
        for node in tree.body
    )


def _fixed_upstream(original) -> str | None:
    spec = importlib.util.find_spec("vllm_ascend.worker.model_runner_v1")
    if spec is None or not spec.origin:
        return None
    with open(spec.origin, encoding="utf-8") as f:
        runner = f.read()
    if "do_mamba_copy_block(" not in runner:
        return "vllm-ascend's model runner no longer pre-copies in bulk"
    # 0.30: the runner hands the copy to the connector, which stages it per layer after each layer's
    # load; the bulk copy stays only as the fallback for connectors that cannot
    if "prepare_mamba_state_copy" in runner and _defines(ASCEND_STORE, "AscendStoreConnector", "prepare_mamba_state_copy"):
        return "vllm-ascend's runner lets the AscendStore connector copy per layer after its load (prepare_mamba_state_copy)"
    return None


def record_rows(original):
    """``collect_mamba_copy_meta`` that remembers which request and layers its rows belong to."""
    state = importlib.import_module(STATE)

    @functools.wraps(original)
    def collect_mamba_copy_meta(
        copy_bufs,
        kv_cache_config,
        mamba_state_copy_funcs,
        mamba_group_ids,
        src_block_idx,
        dest_block_idx,
        accept_token_bias,
        req_state,
        forward_context,
    ):
        start = copy_bufs.offset
        if start == 0:  # the step's first write into the pinned rows: the last upload must have read them
            _wait_for_upload(copy_bufs)
        original(
            copy_bufs,
            kv_cache_config,
            mamba_state_copy_funcs,
            mamba_group_ids,
            src_block_idx,
            dest_block_idx,
            accept_token_bias,
            req_state,
            forward_context,
        )
        if state._KV_CONNECTOR_AGENT is not None and copy_bufs.offset > start:
            if start == 0:
                _ROWS.clear()  # preprocess_mamba starts every step at offset 0
            _ROWS.append(
                (start, copy_bufs.offset, req_state.req_id, src_block_idx, tuple(mamba_group_ids), len(mamba_state_copy_funcs), kv_cache_config)
            )

    return collect_mamba_copy_meta


def _layerwise_loads(state) -> dict | None:
    """{request id: (vllm_cached_tokens, kvpool_cached_tokens)} of this step's layerwise loads."""
    connector = state._KV_CONNECTOR_AGENT
    if connector is None or not getattr(connector, "use_layerwise", False) or not connector.has_connector_metadata():
        return None
    loads = {}
    for req in getattr(connector._get_connector_metadata(), "requests", ()):
        spec = getattr(req, "load_spec", None)
        if spec is not None and spec.can_load and spec.kvpool_cached_tokens > spec.vllm_cached_tokens:
            loads[req.req_id] = (spec.vllm_cached_tokens, spec.kvpool_cached_tokens)
    return loads


def _split(rows, loads, n):
    """(bulk row indices, {layer: row indices}) or None when the rows are not all accounted for."""
    bulk: list[int] = []
    deferred: dict[str, list[int]] = {}
    covered = 0
    for start, end, req_id, src_idx, group_ids, n_states, kv_cache_config in rows:
        covered += end - start
        load = loads.get(req_id)
        if load is None:
            bulk.extend(range(start, end))
            continue
        row = start
        for gid in group_ids:
            group = kv_cache_config.kv_cache_groups[gid]
            bs = group.kv_cache_spec.block_size
            written = load[0] // bs <= src_idx < -(-load[1] // bs)
            for name in group.layer_names:
                target = deferred.setdefault(name, []) if written else bulk
                target.extend(range(row, row + n_states))
                row += n_states
        if row != end:
            return None
    if covered != n:
        return None
    return bulk, deferred


def defer_loaded_rows(original):
    """``do_mamba_copy_block`` that leaves rows whose source a layerwise load writes to their layer."""
    state = importlib.import_module(STATE)
    utils = importlib.import_module(MAMBA_UTILS)

    @functools.wraps(original)
    def do_mamba_copy_block(copy_bufs):
        PENDING.clear()
        rows = list(_ROWS)
        _ROWS.clear()
        n = copy_bufs.offset
        loads = _layerwise_loads(state) if n and rows else None
        split = _split(rows, loads, n) if loads else None
        if not split or not split[1]:
            original(copy_bufs)
            if n:
                _record_upload(copy_bufs)
            return
        bulk, deferred = split
        order = bulk + [r for layer_rows in deferred.values() for r in layer_rows]
        for buf in (copy_bufs.src_ptrs, copy_bufs.dst_ptrs, copy_bufs.sizes):
            buf.np[:n] = buf.np[order]
        src, dst, sizes = (buf.copy_to_gpu(n) for buf in (copy_bufs.src_ptrs, copy_bufs.dst_ptrs, copy_bufs.sizes))
        _record_upload(copy_bufs)
        nb = len(bulk)
        if nb:
            utils.batch_memcpy(src[:nb], dst[:nb], sizes[:nb])
        pos = nb
        for layer, layer_rows in deferred.items():
            end = pos + len(layer_rows)
            PENDING[layer] = (src[pos:end], dst[pos:end], sizes[pos:end])
            pos = end

    return do_mamba_copy_block


def _new_event():
    """A device event as vllm-ascend makes its own (``torch.npu.Event``), blocking (sleeps instead
    of spinning, as vLLM's ``prepare_inputs_event``); None where there is no NPU API."""
    import torch

    npu = getattr(torch, "npu", None)
    factory = getattr(npu, "Event", None)
    if factory is None:
        return None
    try:
        return factory(blocking=True)
    except TypeError:
        return factory()


def _record_upload(copy_bufs) -> None:
    """Mark the end of this step's non-blocking upload of the pinned rows (the current stream)."""
    event = getattr(copy_bufs, UPLOAD_EVENT, None)
    if event is None:
        event = _new_event()
        if event is None:
            return
        setattr(copy_bufs, UPLOAD_EVENT, event)
    event.record()
    _COUNTS["upload_events"] += 1
    setattr(copy_bufs, UPLOAD_PENDING, True)


def _wait_for_upload(copy_bufs) -> None:
    """Before the next step rewrites the pinned rows: the last upload has read them."""
    if getattr(copy_bufs, UPLOAD_PENDING, False):
        setattr(copy_bufs, UPLOAD_PENDING, False)
        getattr(copy_bufs, UPLOAD_EVENT).synchronize()
        _COUNTS["upload_waits"] += 1


def counters() -> dict[str, int]:
    return dict(_COUNTS)


def copy_for_layer(layer_name: str) -> None:
    """Apply ``layer_name``'s deferred pre-copy rows (its load has completed). Called by the GDN
    layer entry (``gdn_layerwise``) between the layer's wait and its first state read."""
    rows = PENDING.pop(layer_name, None)
    if rows is not None:
        importlib.import_module(MAMBA_UTILS).batch_memcpy(*rows)


SPECS = (
    GROUP.spec(
        "mamba_precopy_rows",
        f"{MAMBA_UTILS}:collect_mamba_copy_meta",
        record_rows,
        why="remembers which request / layer each align pre-copy row belongs to",
        precondition=_collect_precondition,
        fixed_upstream=_fixed_upstream,
    ),
    GROUP.spec(
        "mamba_precopy_defer",
        f"{MAMBA_UTILS}:do_mamba_copy_block",
        defer_loaded_rows,
        why="pre-copies whose source a layerwise load writes run per layer, after that layer's load",
        precondition=_copy_precondition,
        fixed_upstream=_fixed_upstream,
        counters=counters,
    ),
)
