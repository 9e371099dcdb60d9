"""Import-time patches for vllm-ascend's layerwise KV pool on GDN hybrid models.

``import ascend_layerwise_patch`` activates every patch whose vLLM / vllm-ascend range matches
what is installed: it registers post-import hooks and imports neither torch, vLLM nor
vllm-ascend. vLLM processes get the same through the ``vllm.general_plugins`` entry point
``ascend_layerwise_patch`` (see :mod:`ascend_layerwise_patch.plugin`).
"""

from __future__ import annotations

from .patches import SPECS
from .registry import PatchError, PatchSpec, PatchStatus, Registry

__version__ = "0.1.0"
__all__ = ["REGISTRY", "PatchError", "PatchSpec", "PatchStatus", "activate", "revert", "status"]

REGISTRY = Registry(SPECS)


def activate(environ=None) -> list[PatchStatus]:
    """Activate every in-range patch in this process (idempotent)."""
    return REGISTRY.activate(environ)


def revert() -> list[PatchStatus]:
    """Undo every patch this process applied."""
    return REGISTRY.revert()


def status() -> list[PatchStatus]:
    return REGISTRY.status()


activate()
