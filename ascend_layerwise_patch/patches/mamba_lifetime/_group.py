"""The mamba_lifetime group, declared once: the lifetime patch (``__init__``), ``send_integrity`` and
``send_shedding`` are one send path, applied all or nothing."""

from __future__ import annotations

from .._checks import Group
from .._ranges import V025_026, V029_030

RISK = (
    "layerwise mamba block lifetime left to vllm-ascend: touched mamba blocks are never released "
    "(the block pool leaks in layerwise mode)"
)

# vllm-ascend 0.30.0rc2 reworked this group's targets and fixed its defects itself (v030.py: member
# mamba_lifetime_030 vouches for that fix; send_stuck_030 adds the warning it lacks)
GROUP = Group(
    "mamba_lifetime",
    V025_026,
    risk=RISK,
    ported_to=((V029_030, "member mamba_lifetime_030 (vllm-ascend's own end-of-step send fence) with send_stuck_030"),),
)
