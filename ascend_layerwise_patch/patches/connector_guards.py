"""Connector guards: no connector call while no connector metadata is bound.

Target   vllm_ascend.attention.utils: wait_for_kv_layer_from_connector,
         maybe_save_kv_layer_to_connector (and every ``from ... import`` copy of them)
Versions vLLM >=0.25.0,<0.26; vllm-ascend >=0.25.1,<0.26 (base releases)
Why      Both helpers call the connector whenever a KV transfer group exists and the forward
         context carries attention metadata -- also in the profile run and in dummy runs, where
         the scheduler bound no connector metadata. The AscendStore pool worker counts layers
         (``current_layer``) on every wait/save, so each such call shifts every later layer of
         the next real step onto the wrong layer's KV. vLLM's own ``maybe_transfer_kv_layer``
         checks ``connector.has_connector_metadata()`` first; these helpers did not.
How      A plain function in front of each helper: if there is no V1 transfer group, or it has no
         metadata bound, return without calling anything; otherwise call the original.
Removal  When vllm-ascend's helpers check ``has_connector_metadata()`` themselves (the
         fixed-upstream detector then skips this patch on its own).
"""

from __future__ import annotations

import functools
import inspect

from ..registry import PatchSpec

VLLM = ">=0.25.0,<0.26"
VLLM_ASCEND = ">=0.25.1,<0.26"
MODULE = "vllm_ascend.attention.utils"

#: modules that copy the helpers with ``from vllm_ascend.attention.utils import ...``
COPIED_INTO = (
    "vllm_ascend.ops.gdn",
    "vllm_ascend.attention.mla_v1",
    "vllm_ascend.attention.sfa_v1",
    "vllm_ascend.attention.dsa_v1",
    "vllm_ascend.attention.context_parallel.dsa_cp",
    "vllm_ascend._310p.ops.fla.gdn_310",
)

_NEEDED_GLOBALS = ("has_kv_transfer_group", "get_kv_transfer_group", "is_v1_kv_transfer_group")


def _expects(params: list[str]):
    def check(original) -> str | None:
        got = list(inspect.signature(original).parameters)
        if got != params:
            return f"parameters are {got}, expected {params}"
        missing = [n for n in _NEEDED_GLOBALS if n not in getattr(original, "__globals__", {})]
        if missing:
            return f"{original.__module__} no longer imports {', '.join(missing)}"
        return None

    return check


def _already_guarded(original) -> str | None:
    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return None
    if "has_connector_metadata" in source:
        return f"{original.__qualname__} already checks has_connector_metadata()"
    return None


def guard(original):
    """The guarded helper: calls ``original`` only when a V1 connector has metadata bound."""
    g = original.__globals__
    has_group = g["has_kv_transfer_group"]
    get_group = g["get_kv_transfer_group"]
    is_v1 = g["is_v1_kv_transfer_group"]

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        if has_group() and is_v1() and get_group().has_connector_metadata():
            return original(*args, **kwargs)
        return None

    return guarded


def _spec(name: str, params: list[str]) -> PatchSpec:
    return PatchSpec(
        name="guard_" + ("wait" if name.startswith("wait") else "save"),
        group="connector_guards",
        target=f"{MODULE}:{name}",
        factory=guard,
        why="skip connector calls while no connector metadata is bound (profile / dummy runs)",
        vllm=VLLM,
        vllm_ascend=VLLM_ASCEND,
        aliases=tuple(f"{module}:{name}" for module in COPIED_INTO),
        precondition=_expects(params),
        fixed_upstream=_already_guarded,
    )


SPECS = (
    _spec("wait_for_kv_layer_from_connector", ["layer_name"]),
    _spec("maybe_save_kv_layer_to_connector", ["layer_name", "kv_cache_layer"]),
)
