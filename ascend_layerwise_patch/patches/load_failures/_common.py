"""What the load_failures groups share: their declarations (names, ranges, risk), and the marks they
leave on vLLM's and vllm-ascend's objects."""

from __future__ import annotations

from .._checks import Group
from .._ranges import V025

RISK = "failed or late layerwise loads are computed on without telling vLLM (wrong tokens, silently)"

_WHY = (
    "failed, raised or timed-out layerwise loads are reported to vLLM's invalid-block handling, "
    "which handles hybrid (multi-group) requests"
)

GROUP = Group("load_failures", V025, risk=RISK, why=_WHY)

#: the platform's config check: imported long before the rest
POLICY_GROUP = Group("load_failures_policy", V025, risk=RISK, why=_WHY)

#: recompute = evict + preempt (own group: own switch)
ROLLBACK_GROUP = Group("load_failures_rollback", V025, risk=RISK, why=_WHY)

#: a failed step's saves are finished failed (own group: own switch)
SAVES_GROUP = Group("load_failures_saves", V025, risk=RISK, why=_WHY)

#: every TP rank learns of a load that failed on any rank (own group: a collective, own switch)
AGREEMENT_GROUP = Group("load_failures_agreement", V025, risk=RISK, why=_WHY)


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


