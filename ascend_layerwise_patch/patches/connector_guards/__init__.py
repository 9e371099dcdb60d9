"""Connector guards: no connector call while no connector metadata is bound.

Target   vllm_ascend.attention.utils: wait_for_kv_layer_from_connector,
         maybe_save_kv_layer_to_connector (and every ``from ... import`` copy of them)
Versions vLLM >=0.25.0,<0.31 but 0.27 / 0.28; vllm-ascend >=0.25.1,<0.31 but 0.27-0.29 (0.30.0rc2: issue 25) (base releases); the helpers and their six
         copies are unchanged in vllm-ascend 0.26.0rc1
Why      Both helpers call the connector whenever a KV transfer group exists and the forward
         context carries attention metadata -- also in the profile run and in dummy runs, where
         the scheduler bound no connector metadata. The AscendStore pool worker counts layers
         (``current_layer``) on every wait/save, so each such call shifts every later layer of
         the next real step onto the wrong layer's KV. vLLM's own ``maybe_transfer_kv_layer``
         checks ``connector.has_connector_metadata()`` first; these helpers did not.
How      A plain function in front of each helper: if there is no V1 transfer group, or it has no
         metadata bound, return without calling anything; otherwise call the original. The copies
         are the known ones (COPIED_INTO) plus every module-level ``from vllm_ascend.attention.utils
         import`` of a helper in the installed vllm-ascend's source, found at activation; a copy
         that holds anything else fails the group.
Removal  When vllm-ascend's helpers check ``has_connector_metadata()`` themselves (the
         fixed-upstream detector then skips this patch on its own).
"""

from __future__ import annotations

import functools

from .._checks import Group
from .._ranges import SUPPORTED
from .._targets import STATE
from .._checks import copies_in_source

MODULE = "vllm_ascend.attention.utils"

#: modules known to copy each helper with ``from vllm_ascend.attention.utils import ...`` (0.25.1rc1);
#: the installed vllm-ascend's sources are scanned for more at activation (``find_copies``)
_ATTENTION = (
    "vllm_ascend.attention.mla_v1",
    "vllm_ascend.attention.sfa_v1",
    "vllm_ascend.attention.dsa_v1",
    "vllm_ascend.attention.context_parallel.dsa_cp",
)
COPIED_INTO = {
    "wait_for_kv_layer_from_connector": _ATTENTION,
    "maybe_save_kv_layer_to_connector": ("vllm_ascend.ops.gdn", *_ATTENTION, "vllm_ascend._310p.ops.fla.gdn_310"),
}

#: the transfer-group state module, read directly on the hot path (see ``guard``)


def _expects(params: list[str]):
    def check(original) -> str | None:
        import importlib
        import inspect

        got = list(inspect.signature(original).parameters)
        if got != params:
            return f"parameters are {got}, expected {params}"
        has_group = getattr(original, "__globals__", {}).get("has_kv_transfer_group")
        if getattr(has_group, "__module__", None) != STATE:
            return f"{original.__module__} no longer takes has_kv_transfer_group from {STATE}"
        state = importlib.import_module(STATE)
        if not hasattr(state, "_KV_CONNECTOR_AGENT"):
            return f"{STATE} no longer keeps the transfer group in _KV_CONNECTOR_AGENT"
        base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.base")
        v1 = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base").KVConnectorBase_V1
        if base.KVConnectorBaseType is not v1 or not callable(getattr(v1, "has_connector_metadata", None)):
            return "connectors are no longer all KVConnectorBase_V1 with has_connector_metadata()"
        return None

    return check


def _already_guarded(original) -> str | None:
    import inspect

    try:
        source = inspect.getsource(original)
    except (OSError, TypeError):
        return None
    if "has_connector_metadata" in source:
        return f"{original.__qualname__} already checks has_connector_metadata()"
    return None


def guard(original):
    """The guarded helper: calls ``original`` only when the connector has metadata bound.

    Hot path (once per layer per step): it reads the transfer group straight from vLLM's state
    module instead of calling has/is_v1/get (the precondition checks that this is where vLLM keeps
    it, and that every connector type of this vLLM is a ``KVConnectorBase_V1``), and takes the
    exact parameters of the original rather than ``*args`` -- a no-connector call then costs about
    what the original's own first check costs, since the original is not called at all.
    """
    import importlib

    state = importlib.import_module(STATE)
    params = list(original.__code__.co_varnames[: original.__code__.co_argcount])

    if params == ["layer_name"]:

        def guarded(layer_name):
            agent = state._KV_CONNECTOR_AGENT
            if agent is not None and agent.has_connector_metadata():
                return original(layer_name)
            return None

    else:

        def guarded(layer_name, kv_cache_layer):
            agent = state._KV_CONNECTOR_AGENT
            if agent is not None and agent.has_connector_metadata():
                return original(layer_name, kv_cache_layer)
            return None

    return functools.wraps(original)(guarded)


HELPERS = ("wait_for_kv_layer_from_connector", "maybe_save_kv_layer_to_connector")


@functools.lru_cache(maxsize=None)
def _copies() -> dict[str, tuple[str, ...]]:
    return copies_in_source("vllm_ascend", MODULE, HELPERS)


def find_copies(name: str):
    """Every ``from vllm_ascend.attention.utils import <name>`` in the installed vllm-ascend."""
    return lambda: _copies()[name]


def copied(name: str) -> dict:
    """A helper's copies: those known (``aliases``) and those found at activation (``find_aliases``)."""
    return {"aliases": tuple(f"{module}:{name}" for module in COPIED_INTO[name]), "find_aliases": find_copies(name)}


GROUP = Group(
    "connector_guards",
    SUPPORTED,
    why="skip connector calls while no connector metadata is bound (profile / dummy runs)",
    fixed_upstream=_already_guarded,
)

WAIT, SAVE = HELPERS
SPECS = (
    GROUP.spec("guard_wait", f"{MODULE}:{WAIT}", guard, precondition=_expects(["layer_name"]), **copied(WAIT)),
    GROUP.spec("guard_save", f"{MODULE}:{SAVE}", guard, precondition=_expects(["layer_name", "kv_cache_layer"]), **copied(SAVE)),
)
