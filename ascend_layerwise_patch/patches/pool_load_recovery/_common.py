"""What the pool_load_recovery groups share: ranges, group names, marks, and how a spec is declared."""

from __future__ import annotations

from .._checks import PatchSpec

VLLM = ">=0.30,<0.31"  # vLLM 0.29's scheduler unpacks one KV cache group: a hybrid report raises there
VLLM_ASCEND = ">=0.30,<0.31"
GROUP = "pool_load_recovery"
POLICY_GROUP = "pool_load_recovery_policy"  # the platform's config check: imported long before the rest

RISK = "a failed hybrid pool load ends the engine (every request with it)"

#: request (scheduler): its pool load failed once; it resumes from local hits and recomputes
NO_RELOAD = "_ascend_layerwise_patch_no_reload_030"

WHY = (
    "a hybrid request whose pool load fails is reported, rolled back (evict + preempt) and recomputed, "
    "instead of ending the engine"
)


def spec(name: str, target: str, factory, precondition, fixed, *, group=GROUP, why=WHY, risk=RISK, context=False, after=(), counters=None):
    return PatchSpec(
        name=name,
        group=group,
        target=target,
        factory=factory,
        why=why,
        vllm=VLLM,
        vllm_ascend=VLLM_ASCEND,
        precondition=precondition,
        risk=risk,
        fixed_upstream=fixed,
        context=context,
        after=after,
        counters=counters,
    )
