"""Layerwise send backlog: a store slower than the model sheds saves instead of pinning the block pool.

Target   vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_scheduler
         .KVPoolScheduler.build_connector_meta (scheduler half), plus a hook in the
         ``mamba_lifetime`` wrapper of ``touch_sending_mamba_blocks`` (same group: one send path).
Versions vLLM >=0.25.0,<0.26; vllm-ascend >=0.25.1,<0.26 (base releases). On vllm-ascend 0.25.1rc1
         ``save_kv_layer`` gives up on the step's last layer after 10 s, so every slow step leaves
         its sends queued and the backlog grows without limit. Not on 0.26.0rc1 (out of range, the
         rest of the group applies): its ``save_kv_layer`` waits for the last layer without a
         limit, so a rank that saves at its last layer is never more than a step behind; a rank
         that saves nothing there (the non-leader ranks at TP > KV heads with ``gdn_tp_keys``)
         does not wait: its sends pile up behind a slow store (236 of 240 blocks held in the
         soak), until its sending thread finds a layer's finished event still set, its own
         assertion stops the thread and the worker raises ("failed during asynchronous
         transfer"): the engine stops (tests/standins/test_send_shedding.py shows it). The bound at
         its defaults was tried there and does not prevent that stop (same error, earlier), so it
         is not declared for 0.26: that pair's defect is the fatal assertion, not the backlog.
Why      With the lifetime patch each step's saves hold the blocks they read (mamba and full
         attention) under a send event until every worker's sending thread is past them: freeing
         them earlier would be a use-after-free. Nothing bounds how many steps the sending threads
         may fall behind. A store slower than the model (every copy 1.5-6x save_kv_layer's wait,
         a few hanging for several steps) turns into an exhausted block pool: held blocks, then
         preemptions, requests that cannot get blocks while the queued sends drain (hours at the
         real 10 s wait) and a busy loop without a forward step. Saving to the pool is an
         optimisation: when the store cannot keep up the server must serve as if it had no pool.
How      The scheduler half already knows the backlog: the open send events and the blocks they
         reference (``sending_events`` / ``sending_blocks``). At each ``build_connector_meta`` the
         wrapper notes the references held now, the limit -- ``ASCEND_LAYERWISE_PATCH_SEND_BACKLOG``
         x the pool's blocks (default ``DEFAULT_FRACTION``) -- and how many earlier steps still
         have open events. The touch hook admits a request's save only if fewer than
         ``ASCEND_LAYERWISE_PATCH_SEND_BACKLOG_STEPS`` steps (default ``DEFAULT_STEPS``; async
         scheduling keeps two open while the store keeps up) are in flight and the references it
         would add keep the total within the limit (or nothing is held at all: a store that keeps
         up is never shed, whatever the pool's size). Otherwise the save is shed:
         its ``can_save`` is cleared before any block is touched, so no event is opened, no block
         held, and every worker skips it (no task queued, no MemCache key allocated or created --
         vllm-ascend's save and GVA allocation both skip a request that cannot save). All TP
         ranks read the same metadata, so a save is shed on every rank or on none. Loads are
         untouched (a request's load spec is separate). The pool then holds fewer prefixes,
         never wrong ones: keys are per block and chained by hash, a hit is a run of ready keys
         from the start, so a shed chunk ends the reachable prefix there. Shed saves are counted
         in ``counters()`` (``status()`` / ``check --json``) and logged as a WARNING at most once
         per ``SHED_REPEAT_S`` through vLLM's logger. ``..._SEND_BACKLOG=off`` (or 0) leaves the
         backlog unbounded (upstream's behaviour); ``..._SEND_BACKLOG_STEPS=off`` keeps the block
         bound alone. The step bound is what keeps the server's pace: on 0.25.1rc1 every step
         that queues a save behind a backlog waits save_kv_layer's whole 10 s for its last layer,
         so admitting saves up to the block bound alone still cost 1.1-1.6x the time of the same
         workload without saving in the soak (1.05-1.32x with both; scripts/soak_shedding.py).
Removal  When vllm-ascend bounds its open layerwise sends itself (detected: a scheduler that
         compares the size of ``sending_blocks`` / ``sending_events`` skips this patch), or with
         the lifetime group.
"""

from __future__ import annotations

import functools
import re
import threading
import time

from ... import pool_events
from ...host import OFF_WORDS, logger, switch
from .._checks import expects
from .._ranges import V025
from .._targets import STORE
from .._checks import source as _source
from ._group import GROUP  # the events it bounds are the lifetime patch's: one send path, all or nothing

ENV_BACKLOG = "ASCEND_LAYERWISE_PATCH_SEND_BACKLOG"
ENV_STEPS = "ASCEND_LAYERWISE_PATCH_SEND_BACKLOG_STEPS"
DEFAULT_FRACTION = 0.25  #: of the block pool: block references open layerwise sends may hold
DEFAULT_STEPS = 3  #: steps whose sends may be open at once (async scheduling keeps two open when healthy)
SHED_REPEAT_S = 60.0  #: at most one WARNING this often while saves are shed

_STEP = "_ascend_layerwise_patch_send_budget"  # scheduler: this build_connector_meta's _Budget
_STEPS = "_ascend_layerwise_patch_send_steps"  # scheduler: last event id of each step with events open

_counts_lock = threading.Lock()
_counts = {"shed_saves": 0, "shed_steps": 0, "send_backlog_peak": 0}
_warned = {"at": None, "since": 0}  # last warning (monotonic) and sheds since then


def counters() -> dict[str, int]:
    """This process's counts: request saves shed, steps that shed any, the most block references
    open sends held at a step's start."""
    with _counts_lock:
        return dict(_counts)


def fraction(environ=None) -> float | None:
    """The bound as a fraction of the block pool, or None (unbounded) for ``off`` / ``0``."""
    value = switch(ENV_BACKLOG, environ)
    if not value:
        return DEFAULT_FRACTION
    if value in OFF_WORDS:
        return None
    try:
        frac = float(value)
    except ValueError:
        logger().warning(
            "ascend_layerwise_patch: %s=%r is not a fraction of the block pool; using %s", ENV_BACKLOG, value, DEFAULT_FRACTION
        )
        return DEFAULT_FRACTION
    if frac <= 0:
        return None
    return min(frac, 1.0)


def steps_limit(environ=None) -> int | None:
    """How many steps' sends may be open at once, or None (no step bound) for ``off`` / ``0``."""
    value = switch(ENV_STEPS, environ)
    if not value:
        return DEFAULT_STEPS
    try:
        steps = int(value)
    except ValueError:
        if value not in OFF_WORDS:
            logger().warning("ascend_layerwise_patch: %s=%r is not a number of steps; using %s", ENV_STEPS, value, DEFAULT_STEPS)
            return DEFAULT_STEPS
        return None
    return steps if steps > 0 else None


class _Budget:
    """One ``build_connector_meta``: the block references open sends hold and may hold, and
    whether the sending side is too many steps behind to take any new save."""

    __slots__ = ("limit", "held", "shed", "behind")

    def __init__(self, limit: int, held: int, behind: bool = False) -> None:
        self.limit, self.held, self.shed, self.behind = limit, held, 0, behind


def admit(scheduler, req_meta, n: int) -> bool:
    """The touch hook: may this request's save hold ``n`` more block references? If not, the save
    is shed here (``can_save`` cleared: nothing touched, queued or keyed for it)."""
    budget = scheduler.__dict__.get(_STEP)
    if budget is None:  # shedding not applied, or touched outside a step's build
        return True
    if not budget.behind and (budget.held + n <= budget.limit or not budget.held):
        budget.held += n  # (the first save while nothing is held always goes: no backlog, no shedding)
        return True
    req_meta.can_save = False
    budget.shed += 1
    return False


def steps_in_flight(scheduler, steps: list[int]) -> int:
    """Steps whose send events are still open. ``steps`` holds, per earlier step that opened
    events, its last event id (ids grow; events of a step close together, in step order)."""
    events = scheduler.sending_events
    if not events:
        steps.clear()
        return 0
    oldest = next(iter(events))  # dicts keep insertion order, event ids grow
    while steps and steps[0] < oldest:
        steps.pop(0)
    return len(steps)


def held_references(scheduler) -> int:
    """Block references held by open layerwise send events (a block held by two events counts twice)."""
    return sum(len(ids) for ids in scheduler.sending_blocks.values())


def _note(shed: int, held: int, limit: int, now: float | None = None) -> None:
    with _counts_lock:
        if held > _counts["send_backlog_peak"]:
            _counts["send_backlog_peak"] = held
        if not shed:
            return
        _counts["shed_saves"] += shed
        pool_events.bump("saves_shed", shed)
        _counts["shed_steps"] += 1
        _warned["since"] += shed
        now = time.monotonic() if now is None else now
        last = _warned["at"]
        if last is not None and now - last < SHED_REPEAT_S:
            return
        since, _warned["at"], _warned["since"] = _warned["since"], now, 0
    logger().warning(
        "ascend_layerwise_patch: layerwise KV store behind the model: %d request save(s) shed "
        "(not sent, no pool key) since the last warning; open sends hold %d block references "
        "(bound %d, %s) or span too many steps (%s); the pool keeps fewer prefixes, loads are unaffected",
        since,
        held,
        limit,
        ENV_BACKLOG,
        ENV_STEPS,
    )


# ------------------------------------------------------------------------------------- factory
def make_build_connector_meta(original, frac: float | None | str = "env", max_steps: int | None | str = "env"):
    frac = fraction() if frac == "env" else frac
    max_steps = steps_limit() if max_steps == "env" else max_steps

    @functools.wraps(original)
    def build_connector_meta(self, scheduler_output):
        pool = self._block_pool
        if frac is None or not self.use_layerwise or pool is None:
            return original(self, scheduler_output)
        held = held_references(self)
        steps = self.__dict__.get(_STEPS)
        if steps is None:
            steps = self.__dict__[_STEPS] = []
        behind = max_steps is not None and steps_in_flight(self, steps) >= max_steps
        budget = self.__dict__[_STEP] = _Budget(int(frac * (pool.num_gpu_blocks - 1)), held, behind)
        first = self.sending_event_id
        try:
            return original(self, scheduler_output)
        finally:
            self.__dict__.pop(_STEP, None)
            if self.sending_event_id != first:  # this step opened events
                steps.append(self.sending_event_id - 1)
            if budget.shed or held > _counts["send_backlog_peak"]:
                _note(budget.shed, held, budget.limit)

    return build_connector_meta


# ----------------------------------------------------------------------------- checks on targets
def _target_ok(original) -> str | None:
    cls = original.__globals__.get("KVPoolScheduler")
    for name in ("sending_blocks", "sending_events", "sending_event_id", "_block_pool"):
        if name not in _source(cls.__init__):
            return f"KVPoolScheduler no longer keeps {name}"
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_worker import KVPoolWorker

    for name in ("_process_save_for_layer_batch", "_alloc_gvas_for_save"):
        fn = getattr(KVPoolWorker, name, None)
        if fn is None or "can_save" not in _source(fn):
            return f"KVPoolWorker.{name} no longer skips a request that cannot save"
    return None


def _bounded_upstream(original) -> str | None:
    cls = original.__globals__.get("KVPoolScheduler")
    if re.search(r"len\(self\.sending_(blocks|events)\)", _source(cls)):
        return "KVPoolScheduler bounds its open send events itself"
    return None


SPECS = (
    GROUP.spec(
        "send_shedding",
        f"{STORE}.pool_scheduler:KVPoolScheduler.build_connector_meta",
        make_build_connector_meta,
        ranges=V025,  # 0.26.0rc1: its backlog ends in its own fatal assertion (see Versions)
        why="a layerwise store slower than the model sheds new saves once open sends hold the bound "
        "of the block pool, instead of pinning the pool",
        # build_connector_meta calls touch_sending_mamba_blocks before adding a request: the admission sits there
        expects=expects(["self", "scheduler_output"], needs=("touch_sending_mamba_blocks",)),
        precondition=_target_ok,
        risk="a slow store's send backlog can hold the whole block pool",
        fixed_upstream=_bounded_upstream,
        counters=counters,
    ),
)
