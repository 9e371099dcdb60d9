"""vLLM general plugin: ``vllm.general_plugins`` entry point ``ascend_layerwise_patch``.

vLLM calls :func:`register` in every process it starts (API server, engine core, each worker),
filtered by ``VLLM_PLUGINS``. vLLM aborts its start-up if a plugin function raises, so this one
only raises in strict mode (``ASCEND_LAYERWISE_PATCH_STRICT=1``), where that is the point.
"""

from __future__ import annotations


def register() -> None:
    from .host import logger
    from .registry import PatchError

    try:
        from . import activate  # importing the package activates; calling again is a no-op

        activate()
    except PatchError:
        raise
    except Exception:  # noqa: BLE001 - never take vLLM down for a patch that did not apply
        logger().exception("ascend_layerwise_patch: activation failed; this process stays unpatched")
