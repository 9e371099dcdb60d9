"""The patch engine: declarative patch specs, applied through wrapt's post-import hooks.

The engine knows nothing of any particular patch. A patch is a :class:`PatchSpec` (data plus
three callables); specs that share a ``group`` apply together or not at all.

- :mod:`.spec`        what a patch is and what it became (``PatchSpec``, ``PatchStatus``, states)
- :mod:`.switches`    the environment, read once per activation
- :mod:`.activation`  the registry: groups in force, hooks, status, revert (:class:`Registry`)
- :mod:`.apply`       one group applied, all or nothing; every copy of a target kept pointed at ours
- :mod:`.install`     putting replacements in place and the one undo
- :mod:`.summary`     the one-line summary in vLLM's log

Replacements are whatever the spec's factory returns -- for hot paths a plain function, since a
wrapt ``FunctionWrapper`` costs ~0.45 us per call and Dynamo refuses it inside compiled forwards.
Every replacement is tagged with ``__ascend_layerwise_patch__`` (the spec name) and
``__wrapped__`` (the original), so a second activation -- even from a second engine --
recognises it by identity and never wraps twice.
"""

from .activation import Registry
from .spec import (
    APPLIED,
    CONFLICT,
    FAILED,
    MARKER,
    PENDING,
    REVERTED,
    SKIPPED,
    Check,
    PLAIN,
    Context,
    Expect,
    Host,
    PatchError,
    PatchSpec,
    PatchStatus,
)
from .switches import ENV_ENABLE, ENV_SKIP, ENV_STRICT, Switches

__all__ = [
    "APPLIED", "CONFLICT", "FAILED", "PENDING", "REVERTED", "SKIPPED", "MARKER",
    "ENV_ENABLE", "ENV_SKIP", "ENV_STRICT", "Check", "Context", "Expect", "Host", "PLAIN", "PatchError", "PatchSpec", "PatchStatus",
    "Registry", "Switches",
]
