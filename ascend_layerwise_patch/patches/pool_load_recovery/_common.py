"""What the pool_load_recovery groups share: their declarations (names, ranges, risk) and marks."""

from __future__ import annotations

from .._checks import Group
from .._ranges import V030

RISK = "a failed hybrid pool load ends the engine (every request with it)"

#: request (scheduler): its pool load failed once; it resumes from local hits and recomputes
NO_RELOAD = "_ascend_layerwise_patch_no_reload_030"

WHY = (
    "a hybrid request whose pool load fails is reported, rolled back (evict + preempt) and recomputed, "
    "instead of ending the engine"
)

# V030: vLLM 0.29's scheduler unpacks one KV cache group: a hybrid report raises there
GROUP = Group("pool_load_recovery", V030, risk=RISK, why=WHY)

#: the platform's config check: imported long before the rest
POLICY_GROUP = Group("pool_load_recovery_policy", V030, risk=RISK, why=WHY)
