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

#: every TP rank learns of a load that failed on any rank (own group: a collective, own switch)
AGREEMENT_GROUP = Group("pool_load_agreement", V030, risk="at TP > 1 with async scheduling a failed pool load stops the "
                        "failing rank and hangs the others in the next collective", why=WHY)

#: worker: the TP ranks agree on failed loads (pool_load_agreement in force): recovery is safe with async at TP > 1
AGREES = "_ascend_layerwise_patch_agrees"

#: the platform's config check: imported long before the rest
POLICY_GROUP = Group("pool_load_recovery_policy", V030, risk=RISK, why=WHY)

#: the layerwise layer wait is bounded (own group: it changes how long the engine waits; issue 32)
WAIT_BOUND_GROUP = Group("pool_load_wait_bound", V030, risk="a layerwise pool load copy that never returns hangs the "
                         "engine (the layer wait has no bound)", why=WHY)
