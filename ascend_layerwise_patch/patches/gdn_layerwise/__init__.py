"""GDN layers take part in layerwise KV transfer.

Target   vllm_ascend.ops.gdn: AscendGatedDeltaNetAttention._forward_core, and the copy that
         vllm-ascend's worker patch ``patch_qwen3_5`` puts on vLLM's QwenGatedDeltaNetAttention
         (``_GDN_PATCH_TARGET``), whichever runs first. Separately (own group), the 310P variant
         vllm_ascend._310p.ops.fla.gdn_310: AscendGatedDeltaNetAttention310._forward_core, which
         ``patch_qwen3_5`` installs instead on 310P.
Versions vLLM 0.25, 0.26, 0.29, 0.30; vllm-ascend 0.25.1rc1, 0.26.0rc1, 0.30.0rc2 (0.30's main
         _forward_core waits itself: skipped there; its 310P one does not: applied). (Both are unchanged in
         vllm-ascend 0.26.0rc1; on vLLM 0.25.0, vllm-ascend 0.25.1rc1's
         ops.gdn does not import at all, so the group is skipped there: nothing can run it).
Why      Full-attention layers go through vLLM's ``maybe_transfer_kv_layer`` (wait for the layer,
         compute, save); GDN layers only save, at the end of ``_forward_core``. With
         ``use_layerwise=true`` a GDN layer can therefore compute on conv / SSM state that the
         layerwise loader is still writing, and MemCache's transfer threads never see the
         compute-start fence for that layer.
How      At the entry of ``_forward_core``, whenever a KV connector exists:
         ``wait_for_kv_layer_from_connector(self.prefix)``, then
         ``memcache_comm_fence.record_attention_compute_start()``; then the original (which keeps
         its ``maybe_save_kv_layer_to_connector`` at the end). With no connector in the process
         both are skipped: nothing to wait for, and no MemCache thread holds a fence gate.
         Why ``_forward_core`` and not ``forward``: vLLM compiles model forwards with Dynamo
         (``fullgraph=True``), and ``forward`` is traced; ``_forward_core`` runs eagerly inside the
         ``vllm::qwen_gdn_attention_core`` custom op, one of vLLM's splitting ops -- the reason
         vllm-ascend moved the layer save there ("Move KV layer saving to _forward_core for
         compilation support"). A connector call in ``forward`` would be traced into the graph or
         break it. The state the wait protects (``self.kv_cache``) is first read inside
         ``_forward_core``, so waiting at its entry keeps the ordering wait -> fence -> compute ->
         save. Between the wait and the fence the layer applies its align pre-copy rows that
         ``mamba_precopy`` (same group) deferred until the layer's load completed. Both helpers are
         looked up on their modules at call time, so the connector guard
         (patches.connector_guards) and any later fix of either helper apply here too.
         310P: ``AscendGatedDeltaNetAttention310._forward_core`` saves the layer the same way and
         has the same gap, so it gets the same change, as its own group: a 310P-only module that
         fails (it is never imported on other devices) must not take the main GDN patch with it.
Removal  When vllm-ascend's ``_forward_core`` waits for the layer itself (detected: the patch
         skips itself if the original already calls ``wait_for_kv_layer_from_connector``).
"""

from __future__ import annotations

import functools
import importlib

from .._checks import expects, source
from . import mamba_precopy
from ._group import GROUP, GROUP_310P
from .._targets import STATE

PARAMS = ["self", "mixed_qkv", "b", "a", "core_attn_out"]
#: where the compute-start fence lives: its own module up to 0.26, the AscendStore pool's package on 0.30
FENCES = ("vllm_ascend.memcache_comm_fence", "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.attention_fence")
QWEN_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention._forward_core"


#: the target's parameters, and the save it must still make (the wait is added next to it)
EXPECTS = expects(PARAMS, needs=("maybe_save_kv_layer_to_connector",))


def _precondition(original) -> str | None:
    """What the layer reaches besides its own method: the wait, the fence, the transfer group."""
    utils = importlib.import_module("vllm_ascend.attention.utils")
    fence = _fence()
    if fence is None:
        return f"the compute-start fence module is gone (looked for {', '.join(FENCES)})"
    if not callable(getattr(utils, "wait_for_kv_layer_from_connector", None)):
        return "vllm_ascend.attention.utils.wait_for_kv_layer_from_connector is gone"
    if not callable(getattr(fence, "record_attention_compute_start", None)):
        return f"{fence.__name__}.record_attention_compute_start is gone"
    if not hasattr(importlib.import_module(STATE), "_KV_CONNECTOR_AGENT"):
        return f"{STATE} no longer keeps the transfer group in _KV_CONNECTOR_AGENT"
    return None


def _fence():
    import importlib.util

    for name in FENCES:
        try:
            if importlib.util.find_spec(name) is not None:
                return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _fixed_upstream(original) -> str | None:
    if "wait_for_kv_layer_from_connector" in source(original):
        return "_forward_core already waits for its layer"
    return None


def join_layerwise(original):
    """``_forward_core`` that waits for its layer and records the compute-start fence first.

    Both calls are made whenever a KV connector exists in this process. Without one (plain
    serving, the common case) there is nothing to wait for and no MemCache thread that could be
    waiting on the fence (only AscendStore's pool worker creates the gate), so the entry then
    skips both: the fence takes a lock on every call, ~0.25 us per layer otherwise.
    """
    utils = importlib.import_module("vllm_ascend.attention.utils")
    fence = _fence()
    state = importlib.import_module(STATE)
    pending = mamba_precopy.PENDING

    @functools.wraps(original)
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        if state._KV_CONNECTOR_AGENT is not None:
            utils.wait_for_kv_layer_from_connector(self.prefix)
            if pending:  # this layer's align pre-copy, deferred until its load completed
                mamba_precopy.copy_for_layer(self.prefix)
            fence.record_attention_compute_start()
        return original(self, mixed_qkv, b, a, core_attn_out)

    return _forward_core


#: what the two layers' patches share: the same wait, on each layer class's ``_forward_core``
_WAIT = dict(
    why="GDN layers wait for their layer and record the compute-start fence before computing",
    aliases=(QWEN_GDN,),
    copied_by=("vllm_ascend.patch.worker.patch_qwen3_5",),
    expects=EXPECTS,
    precondition=_precondition,
    fixed_upstream=_fixed_upstream,
)

SPECS = (
    GROUP.spec("gdn_layerwise", "vllm_ascend.ops.gdn:AscendGatedDeltaNetAttention._forward_core", join_layerwise, **_WAIT),
    GROUP_310P.spec(
        "gdn_layerwise_310p",
        "vllm_ascend._310p.ops.fla.gdn_310:AscendGatedDeltaNetAttention310._forward_core",
        join_layerwise,
        **_WAIT,
    ),
)
