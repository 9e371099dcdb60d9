"""Layerwise pool keys name the TP size their slice was cut for (vllm-ascend 0.30.0rc2).

Target   vllm_ascend...ascend_store.backend.memcache_backend: bind_layerwise_keys (the MemCache
         layerwise protocol's key builder, bound once by the pool scheduler and once by each pool
         worker; ``get_layerwise_protocol`` returns the module, so both look the function up there).
Versions vLLM >=0.29,<0.31; vllm-ascend 0.30.0rc2 (>=0.30,<0.31). On 0.25 / 0.26 the same defect is
         pool_key_layout's (versioned keys naming the layout) and gdn_tp_keys'.
Why      0.30's full-block key is ``model@group@hash@rank`` (``@pp<stage>`` with PP): a GDN key names
         the TP rank, an attention key the KV head, and neither names how many ranks the model was
         cut into. Two instances of one checkpoint at different TP sizes share a pool (P/D through
         the pool, a mixed fleet, a TP change on upgrade -- also a pool left by 0.25 / 0.26, whose
         GDN keys were per KV head): the hit check finds every key it asks for, and each GDN layer
         loads another layout's slice of its state. Pool harness (tests/standins/test_pool_key_tp.py):
         written at TP 4, read at TP 2 -- 4 wrong GDN reads of 4 off, 0 on.
How      The builder's ``make_full_key`` (used for saves, loads and every hit-check key) gets the TP
         size in its rank field: ``...@<rank>`` -> ``...@<rank>tp<size>``. Instances of one TP size
         share keys as before; other TP sizes (and keys written before this patch) miss and
         recompute. Partial-block keys name their request and are never shared: unchanged. The pool
         is cold once after the upgrade.
Removal  When upstream's keys name the TP size (detected: the real builder, bound for two TP sizes,
         gives two keys for one block; the group skips itself).
"""

from __future__ import annotations

import dataclasses
import functools

from .._checks import Group
from .._checks import param_names as _params
from .._ranges import V029_030
from .._targets import STORE

BIND = f"{STORE}.backend.memcache_backend:bind_layerwise_keys"
PARAMS = ["vllm_config", "kv_cache_config", "model_name", "use_hybrid", "grouped_block_size"]


def _precondition(original) -> str | None:
    if _params(original) != PARAMS:
        return f"bind_layerwise_keys parameters are {_params(original)}, expected {PARAMS}"
    try:
        builder = original(**_probe_args(1))
    except Exception as exc:  # noqa: BLE001 - any failure is drift
        return f"bind_layerwise_keys no longer binds a probe configuration ({exc!r})"
    if not dataclasses.is_dataclass(builder) or "make_full_key" not in {f.name for f in dataclasses.fields(builder)}:
        return f"bind_layerwise_keys returns {type(builder).__name__}, not a builder with make_full_key"
    return None


def _probe_args(tp: int) -> dict:
    from types import SimpleNamespace

    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1)
    return dict(
        vllm_config=SimpleNamespace(parallel_config=parallel),
        kv_cache_config=None,
        model_name="alp-probe",
        use_hybrid=True,
        grouped_block_size=[16, 16],
    )


def _fixed_upstream(original) -> str | None:
    try:
        keys = {original(**_probe_args(tp)).make_full_key(0, "ab", 0, 0) for tp in (2, 4)}
    except Exception:  # noqa: BLE001 - the precondition reports it
        return None
    if len(keys) == 2:
        return "the layerwise key builder already names the TP size (two TP sizes, two keys)"
    return None


def tp_named_keys(original):
    """``bind_layerwise_keys`` whose ``make_full_key`` names the TP size in the rank field."""

    @functools.wraps(original)
    def bind_layerwise_keys(*, vllm_config, kv_cache_config, model_name, use_hybrid, grouped_block_size):
        builder = original(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            model_name=model_name,
            use_hybrid=use_hybrid,
            grouped_block_size=grouped_block_size,
        )
        tp = vllm_config.parallel_config.tensor_parallel_size
        make = builder.make_full_key

        def make_full_key(group: int, block_hash: str, head: int, stage: int) -> str:
            return make(group, block_hash, f"{head}tp{tp}", stage)

        return dataclasses.replace(builder, make_full_key=make_full_key)

    return bind_layerwise_keys


GROUP = Group("pool_key_tp", V029_030)

SPECS = (
    GROUP.spec(
        "pool_key_tp",
        BIND,
        tp_named_keys,
        why="0.30's layerwise pool keys name the TP size: instances at another TP size (or 0.25/0.26 head-indexed keys) miss instead of loading another layout's GDN slice",
        precondition=_precondition,
        fixed_upstream=_fixed_upstream,
        risk="instances of different TP sizes sharing a pool load each other's GDN slices",
        after=("pool_layout_keys_030",),  # pool_key_layout's 0.30 member binds the builder with its namespace
    ),
)
