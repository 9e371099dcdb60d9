"""The library's switches, read from the environment once per activation."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import NamedTuple

ENV_ENABLE = "ASCEND_LAYERWISE_PATCH"
ENV_SKIP = "ASCEND_LAYERWISE_PATCH_SKIP"
ENV_STRICT = "ASCEND_LAYERWISE_PATCH_STRICT"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Switches(NamedTuple):
    """``disabled``: the value of ``ASCEND_LAYERWISE_PATCH`` that turned the library off, or
    ``None``; ``skip``: the patch and group names of ``..._SKIP``; ``strict``: ``..._STRICT``."""

    disabled: str | None
    skip: frozenset[str]
    strict: bool

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> Switches:
        env = os.environ if environ is None else environ
        enable = env.get(ENV_ENABLE)
        return cls(
            disabled=enable if (enable or "").strip().lower() in _FALSE else None,
            skip=frozenset(part.strip() for part in (env.get(ENV_SKIP) or "").split(",") if part.strip()),
            strict=(env.get(ENV_STRICT) or "").strip().lower() in _TRUE,
        )

    def errors(self, patches: Iterable[str], groups: Iterable[str]) -> list[str]:
        """Mistakes in the switches: a name in ``..._SKIP`` that is no patch and no group (a typo
        would otherwise leave on the patch it meant)."""
        patches, groups = list(patches), list(dict.fromkeys(groups))
        unknown = self.skip - set(patches) - set(groups)
        if not unknown:
            return []
        return [
            f"{ENV_SKIP} names no patch or group: {', '.join(sorted(unknown))} "
            f"(valid patches: {', '.join(patches)}; valid groups: {', '.join(groups)})"
        ]
