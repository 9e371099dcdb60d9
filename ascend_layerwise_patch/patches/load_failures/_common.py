"""What the load_failures groups share: ranges, group names, the marks they leave on vLLM's and
vllm-ascend's objects, and how their specs are declared."""

from __future__ import annotations

from .._checks import PatchSpec


VLLM = ">=0.25.0,<0.26"


VLLM_ASCEND = ">=0.25.1,<0.26"


GROUP = "load_failures"


POLICY_GROUP = "load_failures_policy"  # the platform's config check: imported long before the rest


ROLLBACK_GROUP = "load_failures_rollback"  # recompute = evict + preempt (own group: own switch)


SAVES_GROUP = "load_failures_saves"  # a failed step's saves are finished failed (own group: own switch)




RISK = "failed or late layerwise loads are computed on without telling vLLM (wrong tokens, silently)"


_FAILED_COPY = "_ascend_layerwise_patch_failed_copy"  # thread: result of the copy being handled


_RECV = "_ascend_layerwise_patch_recv"  # thread: _Recv


_STEP = "_ascend_layerwise_patch_load_step"  # worker: _Step


_TAINTED = "_ascend_layerwise_patch_tainted"  # worker: req ids computing on a failed load until preempted


_FRAMES = "_ascend_layerwise_patch_frames"  # request: [(a step's num_scheduled_tokens, frames it samples)]


#: request: its pool load failed once; it resumes from local hits and recomputes, never loads again
_NO_RELOAD = "_ascend_layerwise_patch_no_reload"


_POISONED = "_ascend_layerwise_patch_load_failed"  # a step's ReqMeta: its load failed, drop its saves


DROPPED = -1  #: the write result a save of a failed-load request is finished with (non-zero: failed)


def _as_scheduled(request, num_scheduled_tokens):
    """(tokens computed before, block ids) of ``request`` when the step being updated was scheduled,
    if recorded (async scheduling: a later step may have advanced it since, and align mode may have
    freed the mamba state block the failed load wrote); else None."""
    for entry in request.__dict__.get(_FRAMES) or ():
        if entry[0] is num_scheduled_tokens:
            return None if entry[3] is None else (entry[2], entry[3])
    return None


_WHY = (
    "failed, raised or timed-out layerwise loads are reported to vLLM's invalid-block handling, "
    "which handles hybrid (multi-group) requests"
)


def _spec(
    name: str, target: str, factory, precondition, fixed, group=GROUP, aliases=(), why=_WHY, risk=RISK, context=False, after=()
) -> PatchSpec:
    return PatchSpec(
        name=name,
        group=group,
        target=target,
        aliases=aliases,
        factory=factory,
        why=why,
        vllm=VLLM,
        vllm_ascend=VLLM_ASCEND,
        precondition=precondition,
        risk=risk,
        fixed_upstream=fixed,
        context=context,
        after=after,
    )

