"""What the load_failures groups share: their declarations (names, ranges, risk), and the marks they
leave on vLLM's and vllm-ascend's objects."""

from __future__ import annotations

from ...host import logger
from .._checks import Group
from .._ranges import V025, V030

RISK = "failed or late layerwise loads are computed on without telling vLLM (wrong tokens, silently)"

_WHY = (
    "failed, raised or timed-out layerwise loads are reported to vLLM's invalid-block handling, "
    "which handles hybrid (multi-group) requests"
)

#: on vLLM 0.30 + vllm-ascend 0.30.0rc2 the same fixes, written for that release's connector, are the
#: pool_load_recovery package's groups (named here, not imported: no group imports another)
_ON_030 = lambda group: ((V030, f"group {group}"),)  # noqa: E731

GROUP = Group("load_failures", V025, risk=RISK, why=_WHY, ported_to=_ON_030("pool_load_recovery"))

#: the platform's config check: imported long before the rest
POLICY_GROUP = Group("load_failures_policy", V025, risk=RISK, why=_WHY, ported_to=_ON_030("pool_load_recovery_policy"))

#: recompute = evict + preempt (own group: own switch)
ROLLBACK_GROUP = Group("load_failures_rollback", V025, risk=RISK, why=_WHY, ported_to=_ON_030("pool_load_recovery"))

#: a failed step's saves are finished failed (own group: own switch)
SAVES_GROUP = Group("load_failures_saves", V025, risk=RISK, why=_WHY, ported_to=_ON_030("pool_load_recovery"))

#: every TP rank learns of a load that failed on any rank (own group: a collective, own switch)
AGREEMENT_GROUP = Group("load_failures_agreement", V025, risk=RISK, why=_WHY, ported_to=_ON_030("pool_load_agreement"))


_FAILED_COPY = "_ascend_layerwise_patch_failed_copy"  # thread: result of the copy being handled


_RECV = "_ascend_layerwise_patch_recv"  # thread: _Recv


_STEP = "_ascend_layerwise_patch_load_step"  # worker: _Step


#: worker: req id computing on a failed load until its preemption (or end) reaches the worker -> the
#: block ids its ReqMeta of the failed step named: a request given one of them by a local prefix hit
#: computes on the failed load too (issue 32)
_TAINTED = "_ascend_layerwise_patch_tainted"


def taint(worker, meta) -> None:
    """``meta``'s request computes on a failed load: its saves are dropped until its preemption (or
    end) reaches the worker, and so are those of any request holding one of its blocks meanwhile
    (:func:`poison_sharing`)."""
    blocks = worker.__dict__.setdefault(_TAINTED, {}).setdefault(meta.req_id, set())
    blocks.update(int(b) for ids in (getattr(meta, "block_ids_by_group", None) or ()) for b in ids if b)


def poison_sharing(worker, requests, when: str) -> list[str]:
    """Marks (``_POISONED``) every ReqMeta of ``requests`` that holds a block of a tainted request:
    vLLM gave it that block by a local prefix hit -- in the failed step's own batch or, under async
    scheduling, in a step scheduled before the rollback -- so it computes on never-loaded blocks or
    on blocks computed from them, and its saves must not be published either (the scheduler preempts
    it with the failed request, ``_failed_load.sharing_requests``). A request sharing only blocks
    before the rollback point loses its saves of those steps: pool misses, never wrong bytes. Logs
    them (``when``: where the hit was taken) and returns the ids newly marked."""
    tainted = worker.__dict__.get(_TAINTED)
    if not tainted:
        return []
    held = set().union(*tainted.values())
    marked = []
    for meta in requests:
        if meta.req_id in tainted or meta.__dict__.get(_POISONED):
            continue
        if any(int(b) in held for ids in (getattr(meta, "block_ids_by_group", None) or ()) for b in ids):
            meta.__dict__[_POISONED] = True
            marked.append(meta.req_id)
    if marked:
        logger().warning(
            "ascend_layerwise_patch: TP rank %d: requests %s hold blocks of a request whose layerwise load failed "
            "(a local prefix hit %s); their pool keys of the step are finished as failed",
            getattr(worker, "tp_rank", 0),
            sorted(marked),
            when,
        )
    return marked


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


