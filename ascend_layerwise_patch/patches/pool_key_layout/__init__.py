"""Layerwise pool keys name the layout their bytes depend on; PP > 1 is refused; the GVA cache is kept true.

Target   vllm_ascend...ascend_store.pool_scheduler: KVPoolScheduler.__init__ (scheduler half);
         vllm_ascend...ascend_store.pool_worker: KVPoolWorker.__init__ and
         KVPoolWorker.process_layer_data (worker half).
Versions vLLM >=0.25.0,<0.27; vllm-ascend >=0.25.1,<0.27 (base releases). Both releases key the
         layerwise GVA path the same way (``<model_name>@<group>@<hash>@<rank>``).
Why      Every layerwise MemCache key starts with ``model_name``, the last path component of the
         checkpoint, and names nothing else of the layout its bytes depend on:
         - TP size: rank r holds another slice of the GDN heads at TP 4 than at TP 8, and another
           set of KV heads at TP 1 than at TP 2; instances of different TP sharing one pool (P/D
           through the pool, a mixed fleet) load each other's slices on every hit
           (``infer_tp_mismatch_info`` does not fire for 2-KV-head hybrids);
         - the checkpoint: two checkpoints in folders of the same name share every key;
         - the pipeline stage: with PP > 1 every stage writes and reads the same keys, and the
           worker's ``physical_layer_to_group_layers`` is keyed by the global layer index but looked
           up with the stage-local one (every layer of stage >= 1 falls back to group 0);
         - a format: keys written by processes without this library (null mamba blocks published
           under real hashes, head-indexed GDN keys) keep being served after an in-place upgrade.
         And 0.25.1rc1's ``_allocated_gvas`` (the keys this worker already saved) is never
         refreshed: a key MemCache evicted, or finished as failed, stays "saved" for the worker's
         lifetime (that prefix is never saved again: a miss that never recovers), its stale GVA is
         written again by a later save that starts below it, and the map grows without bound.
How      - Both halves, after their own ``__init__``, and only on the layerwise GVA path
           (``use_gva_layerwise``: use_layerwise with the MemCache backend), set ``model_name`` to
           a namespace, :func:`namespace`: ``alp<FORMAT>.<name>.<digest>.tp<size>.pp<size>s<stage>``
           (``.cp<pcp>x<dcp>`` when context parallel is on; ``.d<n>`` when a draft model puts ``n``
           layers in the KV cache -- MTP's layer sits in the target's attention group, so its
           blobs hold one layer more than a run without MTP: an instance without MTP read an MTP
           instance's blobs at other offsets, found by the pool simulation), where ``digest`` is 12 hex digits of
           SHA-256 over the checkpoint's full path (``model_config.model``) and revision, or over
           ``ASCEND_LAYERWISE_PATCH_POOL_MODEL_ID`` when set (instances that mount one checkpoint
           under different paths name it the same way there). Every layerwise key -- upstream's,
           ``gdn_tp_keys``' per-rank keys, 0.26's partial keys, the scheduler's hit check -- is
           built from ``model_name``, so all of them move into the namespace together; the
           non-layerwise path keeps its ``KeyMetadata`` (built during ``__init__``) and its
           TP-mismatch reads. A key of another layout, another checkpoint, another format or a
           process without this library is never asked for: a miss, never wrong bytes.
           Full-attention blocks of TP sizes with the same heads per rank (TP 4 and TP 8 at 2 KV
           heads) hold the same bytes but are keyed apart too: a hybrid hit needs the GDN state of
           the same TP size anyway (``mamba_pool_hit`` ends a hit where every mamba group is ready).
         - ``pipeline_parallel_size > 1`` on the layerwise GVA path: both ``__init__`` raise a
           ``ValueError`` naming the reason (vLLM's start-up stops with it).
         - ``process_layer_data``: before the step's saves are planned, the cached keys the step's
           save ranges name are checked in MemCache (``batch_is_exist``, one call per step, only
           when one is cached) and dropped when gone, so the prefix is saved again and no stale GVA
           is written; vllm-ascend 0.26.0rc1 does this itself (``_refresh_allocated_gvas`` in its
           allocation), detected, and left to it. After the step, on both releases, the map keeps
           at most ``ASCEND_LAYERWISE_PATCH_GVA_CACHE_MAX`` entries (default 65,536, oldest out
           first): a key dropped by the bound that is still in MemCache is answered by MemCache as
           existing when saved again (upstream logs ``alloc_gvas FAIL`` once and saves nothing).
Cost     The first pool of an upgraded fleet is cold once: nothing written before the upgrade is
         read (it ages out of MemCache).
Removal  When vllm-ascend's layerwise keys name the TP size and the stage (detected by calling
         ``_make_layerwise_gva_key`` on two probes that differ only in them: the group skips).
vllm-ascend 0.30.0rc2 (vLLM 0.29 / 0.30; members ``pool_layout_keys_030``, ``pool_gva_cache_030``)
         Its layerwise keys are built by the MemCache protocol's ``bind_layerwise_keys`` (bound once by
         the pool scheduler, once by each pool worker) from ``model_name`` = the checkpoint's last path
         component: ``<name>@<group>[@pp<stage>]@<hash>@<rank>``. It names the stage itself now (and
         its workers look layers up stage-locally), so PP > 1 is served, not refused; but not the PP
         size (stage 0 of PP 2 and of PP 4 build the same key and hold other layer ranges), not the
         checkpoint (two folders of one name share every key: tests/standins/test_pool_key_layout.py
         on v0300, library off: B loads A's 3 keys) and not a format. ``pool_layout_keys_030`` binds
         the builder with :func:`namespace` (``stage=None``: upstream names it) as ``model_name``;
         ``pool_key_tp`` (its own group) adds the TP size to the rank field of the same builder.
         0.30 refreshes evicted keys itself (``_refresh_allocated_gvas``), but its ``_allocated_gvas``
         still grows by a key per saved block and group for the worker's lifetime:
         ``pool_gva_cache_030`` keeps the bound after each step's ``process_layer_data``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import os
from types import SimpleNamespace

from .._checks import Group
from .._ranges import V025_026, V029_030
from .._targets import STORE
from .._checks import expects, source
from .._checks import param_names as _params

FORMAT = 1
ENV_MODEL_ID = "ASCEND_LAYERWISE_PATCH_POOL_MODEL_ID"
ENV_GVA_MAX = "ASCEND_LAYERWISE_PATCH_GVA_CACHE_MAX"
GVA_CACHE_MAX = 65536
RISK = "layerwise pool keys name no TP size, stage or checkpoint: another layout's bytes are read as a hit"


def namespace(model, revision, *, tp: int, pp: int, stage: int | None, pcp: int = 1, dcp: int = 1, draft: int = 0, model_id=None) -> str:
    """The ``model_name`` of every layerwise key of this layout (no ``@``: keys are split on it);
    ``stage=None`` where upstream's key names the stage itself (vllm-ascend 0.30); ``draft``: the
    draft model's layers in the KV cache (MTP), which the layerwise blobs hold too."""
    ident = model_id if model_id else f"{model}\0{revision or ''}"
    digest = hashlib.sha256(str(ident).encode()).hexdigest()[:12]
    named = str(model_id) if model_id else str(model)
    name = next((part for part in reversed(named.split("/")) if part), "model").replace("@", "_")
    layout = f"tp{tp}.pp{pp}" + ("" if stage is None else f"s{stage}") + (f".cp{pcp}x{dcp}" if pcp * dcp > 1 else "")
    layout += f".d{draft}" if draft else ""
    return f"alp{FORMAT}.{name}.{digest}.{layout}"


def draft_layers(vllm_config) -> int:
    """The draft model's layers that vLLM puts in the KV cache (MTP: ``n_predict``), 0 without one."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is None:
        return 0
    hf = getattr(draft, "hf_config", None)
    return int(getattr(hf, "n_predict", None) or getattr(hf, "num_nextn_predict_layers", None) or 1)


def layout_name(vllm_config, *, tp: int, pp: int, stage: int | None, pcp: int, dcp: int) -> str:
    """:func:`namespace` of this process's checkpoint (its path and revision, or
    ``ASCEND_LAYERWISE_PATCH_POOL_MODEL_ID`` when set) at this layout."""
    model_config = vllm_config.model_config
    return namespace(
        model_config.model,
        getattr(model_config, "revision", None),
        tp=tp,
        pp=pp,
        stage=stage,
        pcp=pcp,
        dcp=dcp,
        draft=draft_layers(vllm_config),
        model_id=os.environ.get(ENV_MODEL_ID),
    )


def refusal(pp: int) -> str:
    return (
        f"ascend_layerwise_patch: the layerwise MemCache pool (use_layerwise=true) is refused with "
        f"pipeline_parallel_size={pp}: vllm-ascend's layerwise keys name no pipeline stage (stages would "
        f"overwrite and load each other's layers) and its pool worker looks layers up by stage-local index "
        f"in a map keyed by global index (every layer of stage >= 1 would be taken for group 0). Serve "
        f"with --pipeline-parallel-size 1, or without use_layerwise."
    )


def _vllm_config(original, args, kwargs):
    return inspect.signature(original).bind(None, *args, **kwargs).arguments["vllm_config"]


def make_init(original):
    """``__init__`` of either half: refuse PP > 1, then name the layout in ``model_name``."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not getattr(self, "use_gva_layerwise", False):
            return
        if self.pp_size > 1:
            raise ValueError(refusal(self.pp_size))
        self.model_name = layout_name(
            _vllm_config(original, args, kwargs),
            tp=self.tp_size,
            pp=self.pp_size,
            stage=self.pp_rank,
            pcp=getattr(self, "pcp_size", 1),
            dcp=getattr(self, "dcp_size", 1),
        )

    return __init__


# -------------------------------------------------------------------------------- the GVA cache
def gva_cache_max() -> int:
    raw = os.environ.get(ENV_GVA_MAX, "")
    try:
        return max(1, int(raw)) if raw else GVA_CACHE_MAX
    except ValueError:
        return GVA_CACHE_MAX


def _cached_save_keys(worker, requests, helpers) -> list[str]:
    """The keys this step's save ranges name that the worker believes it already saved."""
    get_block_hashes, to_str = helpers
    cache = worker._allocated_gvas
    found: dict[str, None] = {}
    for request in requests:
        if not getattr(request, "can_save", None) or not request.block_hashes:
            continue
        for group_id in range(worker.num_kv_cache_groups):
            size = worker._get_effective_group_block_size(group_id)
            hashes = get_block_hashes(request.block_hashes, size, worker.hash_block_size)
            for index in range(request.save_start_token // size, min(request.save_end_token // size, len(hashes))):
                key = worker._make_layerwise_gva_key(group_id, to_str(hashes[index]))
                if key in cache:
                    found[key] = None
    return list(found)


def _refreshes_itself(worker_cls) -> bool:
    """vllm-ascend checks its cached keys in MemCache before a save (0.26: ``_refresh_allocated_gvas``)."""
    alloc = inspect.unwrap(worker_cls._alloc_gvas_for_save)  # under other groups' wrappers
    names = set(alloc.__code__.co_names)
    if "batch_is_exist" in names:
        return True
    callees = (getattr(worker_cls, n, None) for n in names)  # the worker's own methods it calls
    return any("batch_is_exist" in getattr(getattr(f, "__code__", None), "co_names", ()) for f in callees)


def _trim(cache: dict, limit: int) -> None:
    """Keep the newest ``limit`` keys of the worker's GVA map (insertion order: oldest out first)."""
    excess = len(cache) - limit
    if excess > 0:
        for key in [k for _, k in zip(range(excess), iter(cache))]:
            cache.pop(key, None)


def make_process_layer_data(original):
    worker_cls = original.__globals__["KVPoolWorker"]
    helpers = (original.__globals__["get_block_hashes"], original.__globals__["block_hash_to_str"])
    refresh = not _refreshes_itself(worker_cls)
    limit = gva_cache_max()  # read once, when the patch is installed

    @functools.wraps(original)
    def process_layer_data(self, requests):
        if requests and self.use_gva_layerwise and refresh and self._allocated_gvas:
            keys = _cached_save_keys(self, requests, helpers)
            if keys:
                states = self.m_store.batch_is_exist(keys)
                for key, state in zip(keys, states):
                    if state != 1:  # evicted, or finished as failed: save it again
                        self._allocated_gvas.pop(key, None)
        original(self, requests)
        _trim(self._allocated_gvas, limit)

    return process_layer_data


# ------------------------------------------------------------------------ vllm-ascend 0.30.0rc2
def make_bind_030(original):
    """``bind_layerwise_keys`` bound with this layout's :func:`namespace` as ``model_name``."""

    @functools.wraps(original)
    def bind_layerwise_keys(*, vllm_config, kv_cache_config, model_name, use_hybrid, grouped_block_size):
        parallel = vllm_config.parallel_config
        name = layout_name(
            vllm_config,
            tp=parallel.tensor_parallel_size,
            pp=parallel.pipeline_parallel_size,
            stage=None,  # upstream's key names the stage (@pp<stage>)
            pcp=getattr(parallel, "prefill_context_parallel_size", 1),
            dcp=getattr(parallel, "decode_context_parallel_size", 1),
        )
        return original(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            model_name=name,
            use_hybrid=use_hybrid,
            grouped_block_size=grouped_block_size,
        )

    return bind_layerwise_keys


def make_process_layer_data_030(original):
    limit = gva_cache_max()  # read once, when the patch is installed

    @functools.wraps(original)
    def process_layer_data(self, requests):
        original(self, requests)
        _trim(self._allocated_gvas, limit)

    return process_layer_data


# ----------------------------------------------------------------------------- checks on targets
def _probe_key(worker_cls, **layout) -> str | None:
    probe = SimpleNamespace(
        model_name="m", num_kv_cache_groups=2, head_or_tp_rank=0, tp_rank=0, put_step=1, group_uses_align_state=[False, True],
        tp_size=2, pp_size=1, pp_rank=0, pcp_size=1, dcp_size=1, pcp_rank=0, dcp_rank=0, use_gva_layerwise=True,
    )
    for name, value in layout.items():
        setattr(probe, name, value)
    try:
        return worker_cls._make_layerwise_gva_key(probe, 1, "ab")
    except Exception:  # noqa: BLE001 (a probe it cannot read: not fixed)
        return None


def _fixed_upstream(_original) -> str | None:
    worker_cls = importlib.import_module(f"{STORE}.pool_worker").KVPoolWorker
    base = _probe_key(worker_cls)
    other_tp = _probe_key(worker_cls, tp_size=4)
    other_stage = _probe_key(worker_cls, pp_size=2, pp_rank=1)
    if base is not None and base != other_tp and base != other_stage and None not in (other_tp, other_stage):
        return "vllm-ascend's layerwise keys already name the TP size and the pipeline stage"
    return None


BIND_030 = f"{STORE}.backend.memcache_backend:bind_layerwise_keys"
_BIND_PARAMS = ["vllm_config", "kv_cache_config", "model_name", "use_hybrid", "grouped_block_size"]


def _bind_probe(original, *, model: str, pp: int) -> str:
    """The key the real builder makes for one block of group 1, stage 0, bound for this layout."""
    parallel = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=pp)
    config = SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace(model=model, revision=None))
    builder = original(
        vllm_config=config, kv_cache_config=None, model_name=model.rsplit("/", 1)[-1], use_hybrid=True, grouped_block_size=[16, 16]
    )
    return builder.make_full_key(1, "ab", 0, 0)


def _bind_030_ok(original) -> str | None:
    if _params(original) != _BIND_PARAMS:
        return f"bind_layerwise_keys parameters are {_params(original)}, expected {_BIND_PARAMS}"
    try:
        _bind_probe(original, model="/a/m", pp=1)
    except Exception as exc:  # noqa: BLE001 - any failure is drift
        return f"bind_layerwise_keys no longer binds a probe configuration ({exc!r})"
    return None


def _bind_030_fixed(original) -> str | None:
    try:  # two checkpoints in folders of one name, and two PP sizes: four layouts, four keys
        keys = {_bind_probe(original, model=m, pp=pp) for m in ("/a/m", "/b/m") for pp in (2, 4)}
    except Exception:  # noqa: BLE001 - the precondition reports it
        return None
    if len(keys) == 4:
        return "vllm-ascend's layerwise keys already name the checkpoint and the PP size"
    return None


_PROCESS_030_EXPECTS = expects(["self", "requests"], globals_=("KVPoolWorker",))


def _process_030_ok(original) -> str | None:
    problem = _PROCESS_030_EXPECTS(original)
    if problem:
        return problem
    if "self._allocated_gvas[" not in source(original.__globals__["KVPoolWorker"]):
        return "KVPoolWorker no longer keeps saved keys in _allocated_gvas"
    return None


def _init_ok(key_method: str):
    def check(original) -> str | None:
        try:
            inspect.signature(original).bind(None, None, False)
        except TypeError:
            return f"{original.__qualname__} no longer takes (vllm_config, use_layerwise, ...)"
        if "vllm_config" not in inspect.signature(original).parameters:
            return f"{original.__qualname__} no longer takes vllm_config"
        cls = original.__globals__.get(original.__qualname__.split(".")[0])
        text = source(cls) if cls is not None else ""
        missing = [n for n in ("self.model_name =", "use_gva_layerwise", "pp_size", "tp_size", "pp_rank") if n not in text]
        if missing:
            return f"{original.__qualname__.split('.')[0]} no longer sets {', '.join(missing)}"
        method = getattr(cls, key_method, None)
        if method is None or "self.model_name" not in source(method):
            return f"{key_method} no longer builds layerwise keys from self.model_name"
        return None

    return check


_PROCESS_EXPECTS = expects(["self", "requests"], globals_=("KVPoolWorker", "get_block_hashes", "block_hash_to_str"))


def _process_ok(original) -> str | None:
    problem = _PROCESS_EXPECTS(original)
    if problem:
        return problem
    worker_cls = original.__globals__["KVPoolWorker"]
    text = source(worker_cls)
    missing = [
        n
        for n in ("_allocated_gvas", "save_start_token", "save_end_token", "_get_effective_group_block_size", "hash_block_size")
        if n not in text
    ]
    if missing:
        return f"KVPoolWorker no longer uses {', '.join(missing)}"
    return None


GROUP = Group(
    "pool_key_layout",
    V025_026,
    risk=RISK,
    fixed_upstream=_fixed_upstream,
    # vllm-ascend 0.30.0rc2 reworked the targets: the 0.30 members carry the same fix there
    ported_to=((V029_030, "pool_layout_keys_030 with pool_gva_cache_030 (0.30's key builder and GVA map)"),),
)


SPECS = (
    GROUP.spec(
        "pool_layout_scheduler",
        f"{STORE}.pool_scheduler:KVPoolScheduler.__init__",
        make_init,
        precondition=_init_ok("_make_layerwise_gva_keys_for_hit_check"),
        why="layerwise pool keys (hit check) name format, checkpoint, TP size and stage; PP > 1 refused at start-up",
    ),
    GROUP.spec(
        "pool_layout_worker",
        f"{STORE}.pool_worker:KVPoolWorker.__init__",
        make_init,
        precondition=_init_ok("_make_layerwise_gva_key"),
        why="layerwise pool keys (save, load) name format, checkpoint, TP size and stage; PP > 1 refused at start-up",
    ),
    GROUP.spec(
        "pool_gva_cache",
        f"{STORE}.pool_worker:KVPoolWorker.process_layer_data",
        make_process_layer_data,
        precondition=_process_ok,
        why="keys MemCache evicted or failed are saved again (0.26 checks itself), and the worker's GVA map stays bounded",
    ),
    GROUP.spec(
        "pool_layout_keys_030",
        BIND_030,
        make_bind_030,
        ranges=V029_030,
        precondition=_bind_030_ok,
        fixed_upstream=_bind_030_fixed,
        why="0.30's layerwise pool keys name format, checkpoint and PP size (it names the stage; pool_key_tp the TP size)",
    ),
    GROUP.spec(
        "pool_gva_cache_030",
        f"{STORE}.pool_worker:KVPoolWorker.process_layer_data",
        make_process_layer_data_030,
        ranges=V029_030,
        precondition=_process_030_ok,
        fixed_upstream=None,  # the group's detector probes 0.25/0.26's key method
        after=("pool_gva_cache",),  # its 0.25/0.26 twin; never both in range
        why="0.30's worker GVA map stays bounded (it refreshes evicted keys itself)",
    ),
)
