"""The mamba_lifetime group, declared once: the lifetime patch (``__init__``), ``send_integrity`` and
``send_shedding`` are one send path, applied all or nothing."""

from __future__ import annotations

from .._checks import Group
from .._ranges import V025_026

RISK = (
    "layerwise mamba block lifetime left to vllm-ascend: touched mamba blocks are never released "
    "(the block pool leaks in layerwise mode)"
)

# vllm-ascend 0.30 (issue 25) reworked this group's targets (the layerwise pool's hit check, keys and
# sending thread); not declared for it: out of range there, see the README's version table
GROUP = Group("mamba_lifetime", V025_026, risk=RISK)
