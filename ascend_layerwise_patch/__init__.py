"""Import-time patches for vllm-ascend's layerwise KV pool on GDN hybrid models.

``import ascend_layerwise_patch`` activates every patch whose vLLM / vllm-ascend range matches
what is installed: it registers post-import hooks and imports neither torch, vLLM nor
vllm-ascend (when vLLM is not imported yet, activation itself runs the moment it starts to be). vLLM processes get the same through the ``vllm.general_plugins`` entry point
``ascend_layerwise_patch`` (see :mod:`ascend_layerwise_patch.plugin`).
"""

from __future__ import annotations

import sys

from .patches import SPECS
from .host import HOST
from .registry import PatchError, PatchSpec, PatchStatus, Registry

__version__ = "0.1.0"
__all__ = ["REGISTRY", "PatchError", "PatchSpec", "PatchStatus", "activate", "revert", "status"]

REGISTRY = Registry(SPECS, host=HOST)


def activate(environ=None) -> list[PatchStatus]:
    """Activate every in-range patch in this process (idempotent)."""
    return REGISTRY.activate(environ)


def revert() -> list[PatchStatus]:
    """Undo every patch this process applied."""
    return REGISTRY.revert()


def status() -> list[PatchStatus]:
    return REGISTRY.status()


class _ActivateBeforeVLLM:
    """Meta-path entry that activates the registry when vLLM (or vllm-ascend) starts importing.

    Activation needs wrapt, package metadata and ``packaging``; deferring it to that moment keeps
    ``import ascend_layerwise_patch`` to a few milliseconds while still registering every hook
    before the first target module can load. It finds nothing itself and removes itself first.
    """

    def find_spec(self, name, path=None, target=None):
        if name in ("vllm", "vllm_ascend"):
            if self in sys.meta_path:
                sys.meta_path.remove(self)
                _activate_on_import()
        return None


def _activate_on_import() -> None:
    """The import itself never raises (vLLM's plugin loader would only log it and go on
    unpatched); in strict mode the plugin function and explicit ``activate()`` calls raise."""
    try:
        activate()
    except PatchError as exc:
        from .host import logger

        logger().error("ascend_layerwise_patch: strict mode: %s", exc)


if "vllm" in sys.modules or "vllm_ascend" in sys.modules:
    _activate_on_import()
else:
    sys.meta_path.insert(0, _ActivateBeforeVLLM())
