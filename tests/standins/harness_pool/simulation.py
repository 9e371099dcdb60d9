"""Seeded episodes on the pool harness: engines, requests and store faults drawn at random, every
request held token for token against a run without the pool.

An :class:`Episode` is data: 2-3 engine instances sharing ONE store, each with its shape (TP over 2 or
1 KV heads, sync or async scheduling, MTP, chunk size, a block pool small enough to preempt, vLLM's
``kv_load_failure_policy``) and the step at which it starts (later ones start into a warm pool, so
their first step may be a hit); requests drawn from a prefix tree (a few shared prefixes, suffixes
that diverge before, at and after block boundaries), each with its instance, arrival step and
length and, for some, an abort a few steps after arrival (during its load or its sends); faults at
chosen steps (a load copy that fails or raises, the keys of a prefix evicted between the hit check
and the load; a save copy that fails or raises, allocations that outlive their lease). The
instances step interleaved on one logical clock, so they write and read the same keys in turn.

Two spaces (:data:`SPACES`): ``mixed``, each engine its own shape, mostly TP 1 (hits across
layouts, the layout in the key); ``fleet``, the engines of one deployment (TP 2 / 4 / 8 over 2, 1
or 4 KV heads, one scheduling and MTP setting) where a late start is a restart into the warm pool,
and a fault may be aimed at one TP rank's process (its copies; ``evict``: the keys it saved).

The same generator draws from ``random.Random(seed)`` (:func:`episode_from_seed`: CI seeds and
``scripts/simulate.py``) or from Hypothesis (:func:`episodes`, whose shrinking reduces a failing
episode; :meth:`Episode.as_test` prints it as a pytest case).

The oracle (:func:`run_episode`): each request's tokens equal those of a run without the pool (an
instance of the same MTP setting and scheduling); no GDN / attention read was wrong; once idle, no
block is held (every block of each instance's pool is free); no step hung (the harness's step
watchdog); no engine stopped unless the pair stops by design on what the episode injected -- the
generator injects on each pair only faults its row of docs/failures.md says it survives (0.26.0rc1 stops on a
failed hybrid load by design: no load faults there).

Assumes what the harness assumes (``harness_pool``): the stand-in model's tokens depend on every
byte a step read; time is logical (steps), not measured.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from support import PAIR

from .engine import engine_loop
from .instance import PoolInstance

BLOCK = 16
#: the fault kinds each pair's engine survives (docs/failures.md, "What still stops"): 0.26.0rc1 stops on a
#: failed hybrid load by design (no load faults there); a failed or raising save copy costs its keys on
#: every pair (0.26 / 0.30: group pool_save_failures); ``save_lease``: the allocations being written
#: outlive MemCache's allocation lease just before a save copy (byte_store ``outlive_allocations``)
SAVE_FAULTS = ("save_error", "save_raise", "save_lease")
FAULT_KINDS = {
    "v0251": ("load_error", "load_raise", "evict", *SAVE_FAULTS),
    "v0260": SAVE_FAULTS,
    "v0300": ("load_error", "load_raise", "evict", *SAVE_FAULTS),
}.get(PAIR, ())
#: a failed load is recomputed under ``recompute`` (``fail``, vLLM's default, ends the request with an
#: error: a divergence). vllm-ascend refuses ``recompute`` for hybrid models without the library
#: (load_failures_policy): library-off runs set ``ALP_SIM_POLICY=fail``.
POLICY = os.environ.get("ALP_SIM_POLICY") or ("recompute" if set(FAULT_KINDS) - set(SAVE_FAULTS) else "fail")


@dataclass(frozen=True)
class Shape:
    tp: int = 1
    kv_heads: int = 2
    async_: bool = False
    mtp: int = 0
    chunk: int = 0  # long_prefill_token_threshold (0: vLLM's own chunking)
    num_blocks: int = 64

    def kwargs(self) -> dict:
        kw = dict(tp=self.tp, kv_heads=self.kv_heads, async_scheduling=self.async_, mtp=self.mtp, num_blocks=self.num_blocks)
        if self.chunk:
            kw["long_prefill_token_threshold"] = self.chunk
        return kw


@dataclass(frozen=True)
class Req:
    instance: int
    at: int  # the step of its instance's clock at which it arrives
    prompt: tuple[int, ...]
    max_tokens: int
    abort_after: int | None = None  # aborted this many steps after it arrived (during a load, a send)


@dataclass(frozen=True)
class Fault:
    kind: str  # load_error | load_raise | evict | save_error | save_raise | save_lease
    instance: int
    at: int  # the global step before which it is armed
    #: only the copies TP rank ``rank``'s process makes, and ``evict`` only the keys that rank's
    #: processes saved (its GDN state, its heads): one rank fails while the others load; None: the
    #: next copy of any rank
    rank: int | None = None


@dataclass(frozen=True)
class Episode:
    seed: int
    shapes: tuple[Shape, ...]
    starts: tuple[int, ...]  # the global step at which each instance starts
    requests: tuple[Req, ...]
    faults: tuple[Fault, ...] = ()

    def as_test(self, name: str = "") -> str:
        """A ready-to-paste pytest case that runs this episode."""
        return (
            f"def test_episode_{name or self.seed}():\n"
            f"    check(run_episode({self!r}))\n"
        )


# ----------------------------------------------------------------------------------------- drawing
class _Random:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def pick(self, options):
        return options[self.rng.randrange(len(options))]


class _Hypothesis:
    def __init__(self, data):
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        from hypothesis import strategies as st

        return self.data.draw(st.integers(lo, hi))

    def pick(self, options):
        from hypothesis import strategies as st

        return self.data.draw(st.sampled_from(options))


#: the episode spaces: ``mixed`` (CI_SEEDS, the long runs so far): 2-3 engines of mostly TP 1, each its
#: own shape (hits across engines only where two shapes agree); ``fleet``: 2-3 engines of one
#: production deployment (TP 2/4/8 over 2, 1 or 4 KV heads, the same scheduling and MTP), started at
#: different steps -- a later one is a restart into the warm pool -- with faults aimed at one TP rank
SPACES = ("mixed", "fleet")


def _draw(d, seed: int = 0, space: str = "mixed") -> Episode:
    n = d.int(2, 3)
    shapes = []
    if space == "fleet":
        tp, kv_heads, async_, mtp = d.pick((2, 4, 4, 8)), d.pick((2, 2, 1, 4)), bool(d.int(0, 1)), d.pick((0, 1, 3))
        for _ in range(n):
            chunk, num_blocks = d.pick((0, 16, 32)), d.pick((48, 64, 128))
            shapes.append(Shape(tp=tp, kv_heads=kv_heads, async_=async_, mtp=mtp, chunk=chunk, num_blocks=num_blocks))
        starts = tuple(sorted(d.int(0, 14) for _ in range(n)))
    else:
        for _ in range(n):
            tp = d.pick((1, 1, 2))
            shapes.append(
                Shape(
                    tp=tp,
                    kv_heads=d.pick((2, 1)) if tp == 2 else 2,
                    async_=bool(d.int(0, 1)),
                    mtp=d.pick((0, 0, 1, 3)),
                    chunk=d.pick((0, 16, 32)),
                    num_blocks=d.pick((48, 64, 128)),
                )
            )
        starts = tuple(sorted(d.int(0, 6) for _ in range(n)))
    # a prefix tree: 1-3 shared prefixes of 1-4 blocks (+ 0-15 tokens), each request one of them
    # and a suffix of 0-20 tokens, or a fresh prompt
    prefixes = []
    for p in range(d.int(1, 3)):
        length = d.int(1, 4) * BLOCK + d.pick((0, 0, 1, 8, 15))
        prefixes.append(tuple(range(1000 * (p + 1), 1000 * (p + 1) + length)))
    requests = []
    for r in range(d.int(2, 6)):
        base = prefixes[d.int(0, len(prefixes) - 1)] if d.int(0, 4) else ()
        suffix = tuple(7 + r * 31 + i for i in range(d.pick((0, 1, 5, 16, 20))))
        prompt = base + suffix or (5, 6, 7)
        abort_after = d.pick((None, None, None, None, 0, 1, 2))
        requests.append(Req(instance=d.int(0, n - 1), at=d.int(0, 5), prompt=prompt, max_tokens=d.int(1, 6), abort_after=abort_after))
    faults = []
    for _ in range(d.int(0, 2) if FAULT_KINDS else 0):
        kind, instance, at = d.pick(FAULT_KINDS), d.int(0, n - 1), d.int(0, 10)
        rank = None
        if space == "fleet":  # aimed at one rank; a load fault mostly at the engine that starts last (its hits)
            rank = d.pick((None, *range(shapes[0].tp)))
            if kind in ("load_error", "load_raise", "evict") and d.int(0, 2):
                instance, at = n - 1, starts[-1] + d.int(0, 6)
        faults.append(Fault(kind=kind, instance=instance, at=at, rank=rank))
    return Episode(seed, tuple(shapes), starts, tuple(requests), tuple(faults))


def episode_from_seed(seed: int, space: str = "mixed") -> Episode:
    if space not in SPACES:
        raise ValueError(f"episode space {space!r}: one of {', '.join(SPACES)}")
    return _draw(_Random(seed), seed, space)


def episodes(space: str = "mixed"):
    """A Hypothesis strategy of episodes (shrinks towards fewer instances, requests and faults)."""
    from hypothesis import strategies as st

    return st.data().map(lambda data: _draw(_Hypothesis(data), 0, space))


# ----------------------------------------------------------------------------------------- running
@dataclass
class Result:
    episode: Episode
    requests: int = 0
    tokens: int = 0
    divergences: list = field(default_factory=list)  # (instance, request, tokens, reference)
    wrong_reads: int = 0
    leaks: list = field(default_factory=list)  # (instance, held blocks)
    stops: list = field(default_factory=list)  # (instance, error)
    faults: dict = field(default_factory=dict)  # kind -> copies it hit (evict: keys)

    @property
    def ok(self) -> bool:
        return not (self.divergences or self.wrong_reads or self.leaks or self.stops)


def _reference(ep: Episode) -> dict[tuple[int, int], list[int]]:
    """Each request's tokens on an instance without the pool with its instance's MTP / scheduling."""
    out = {}
    by_kind: dict[tuple[int, bool], list[int]] = {}
    for i, req in enumerate(ep.requests):
        shape = ep.shapes[req.instance]
        by_kind.setdefault((shape.mtp, shape.async_), []).append(i)
    for (mtp, async_), idx in by_kind.items():
        ref = PoolInstance(None, name="reference", mtp=mtp, async_scheduling=async_, num_blocks=256)
        try:
            for i in idx:
                ref.add_request(f"r{i}", list(ep.requests[i].prompt), max_tokens=ep.requests[i].max_tokens)
            engine_loop(ref)
            for i in idx:
                out[i] = list(ref.outputs.get(f"r{i}", []))
        finally:
            ref.close()
    return out


def _rank_pids(inst: PoolInstance) -> list[int]:
    """The pid of each TP rank of ``inst`` (all this process's when its ranks live here)."""
    return [p.pid for p in inst.procs.procs] if inst.procs is not None else [os.getpid()] * inst.tp


def _arm(pool, inst: PoolInstance, fault: Fault, result: Result, saved_by: dict) -> None:
    from byte_store import G2L, L2G

    caller = None
    if fault.rank is not None:
        pid = _rank_pids(inst)[fault.rank]
        caller = lambda p: p == pid  # noqa: E731
    if fault.kind == "save_lease":
        result.faults.setdefault(fault.kind, []).append(pool.add_fault("expire", direction=L2G, times=1, caller=caller))
    elif fault.kind in ("load_error", "load_raise", "save_error", "save_raise"):
        direction = G2L if fault.kind.startswith("load") else L2G
        f = pool.add_fault("error" if fault.kind.endswith("error") else "raise", direction=direction, times=1, caller=caller)
        result.faults.setdefault(fault.kind, []).append(f)
    else:  # evict: the next step's hits lose their keys (one rank's, with ``rank``) between the hit check and the load
        def evict(_inst, so, _done=[]):  # noqa: B006 -- once
            if _done or not so.scheduled_new_reqs:
                return
            _done.append(True)
            gone = pool.evict((lambda key: True) if fault.rank is None else (lambda key: fault.rank in saved_by.get(key, ())))
            result.faults.setdefault("evict", []).append(len(gone))

        inst.after_schedule = evict


def run_episode(ep: Episode, pool=None, max_steps: int = 400) -> Result:
    from harness_pool import make_pool

    result = Result(ep, requests=len(ep.requests))
    reference = _reference(ep)
    pool = pool if pool is not None else make_pool("bytes")
    insts: list[PoolInstance | None] = [None] * len(ep.shapes)
    reqs: dict[int, object] = {}  # vLLM's Request of each request: its output_token_ids are what the user got
    stopped: set[int] = set()
    aborted: set[int] = set()  # their tokens are not compared (an abort ends a request early)
    rank_of: dict[int, int] = {}  # pid -> TP rank, of every instance's rank processes
    saved_by: dict[str, set] = {}  # key -> the TP ranks whose processes saved it

    def note_saves(direction, items, host) -> None:
        from byte_store import L2G

        if direction == L2G and host is not None:
            for key, *_ in items:
                saved_by.setdefault(key, set()).add(rank_of.get(host.pid))

    pool.observers.append(note_saves)
    try:
        for t in range(max_steps):
            for i, shape in enumerate(ep.shapes):
                if t == ep.starts[i]:
                    insts[i] = PoolInstance(pool, name=f"E{i}", kv_load_failure_policy=POLICY, **shape.kwargs())
                    if insts[i].procs is not None:
                        rank_of.update({pid: r for r, pid in enumerate(_rank_pids(insts[i]))})
            for fault in ep.faults:
                if fault.at == t and insts[fault.instance] is not None:
                    _arm(pool, insts[fault.instance], fault, result, saved_by)
            for i, inst in enumerate(insts):
                if inst is None or i in stopped:
                    continue
                for k, req in enumerate(ep.requests):
                    if req.instance == i and req.at == t - ep.starts[i]:
                        reqs[k] = inst.add_request(f"r{k}", list(req.prompt), max_tokens=req.max_tokens)
                for k, req in enumerate(ep.requests):
                    if req.instance == i and req.abort_after is not None and t - ep.starts[i] == req.at + req.abort_after:
                        from vllm.v1.request import RequestStatus

                        if k in reqs and not reqs[k].is_finished():
                            inst.scheduler.finish_requests(f"r{k}", RequestStatus.FINISHED_ABORTED)
                            aborted.add(k)
                if inst.has_work():
                    try:
                        inst.step()
                    except Exception as exc:  # an engine that stopped (RankFailure, RuntimeError, a hang)
                        result.stops.append((i, f"{type(exc).__name__}: {str(exc)[:400]}"))
                        stopped.add(i)
            last_arrival = max((ep.starts[r.instance] + r.at for r in ep.requests), default=0)
            if t > max(ep.starts) and t > last_arrival and not any(
                inst is not None and i not in stopped and inst.has_work() for i, inst in enumerate(insts)
            ):
                break
        for i, inst in enumerate(insts):
            if inst is None or i in stopped:
                continue
            for k, req in enumerate(ep.requests):
                if req.instance != i or k in aborted:
                    continue
                request = reqs[k]
                got = list(request.output_token_ids)
                result.tokens += len(reference[k])
                if got != reference[k] or request.status.name == "FINISHED_ERROR":
                    result.divergences.append((i, f"r{k}", got, reference[k], request.status.name))
            # a step whose load failed computed on what it did not load: its reads are wrong by design
            # and its tokens discarded (the requests are recomputed), so they are not counted. The
            # failure is reported in that step's output or up to two steps later (async scheduling's
            # batch queue; at TP > 1 the ranks' agreement round), and under async scheduling the step
            # after it was already in flight, built on it: the tokens are the oracle for those steps.
            reported = [s for s, out in enumerate(inst.kv_outputs) if out is not None and out.invalid_block_ids]
            failed_steps = {s + lag for s in reported for lag in range(-2, 3)}
            result.wrong_reads += sum(
                1 for kind in ("gdn", "attn") for r in inst.wrong_reads(kind=kind) if r.step not in failed_steps
            )
            block_pool = inst.scheduler.kv_cache_manager.block_pool
            held = block_pool.num_gpu_blocks - 1 - block_pool.get_num_free_blocks()
            if held:
                result.leaks.append((i, held))
    finally:
        pool.clear_faults()
        pool.observers.remove(note_saves)
        for inst in insts:
            if inst is not None:
                inst.close()
    return result


def check(result: Result) -> None:
    """Fails with the episode, what went wrong and a ready-to-paste case."""
    if result.ok:
        return
    raise AssertionError(
        f"episode {result.episode.seed}: divergences {result.divergences[:3]}, wrong reads {result.wrong_reads}, "
        f"leaks {result.leaks}, stops {result.stops}\n\n{result.episode.as_test()}"
    )


# --------------------------------------------------------------------------------------- shrinking
def _smaller(ep: Episode):
    """Episodes one step smaller than ``ep``: a fault, a request or an instance fewer, shorter outputs
    and prompts, later starts made earlier, simpler shapes."""
    import dataclasses

    for k in range(len(ep.faults)):
        yield dataclasses.replace(ep, faults=ep.faults[:k] + ep.faults[k + 1 :])
    for k in range(len(ep.requests)):
        if len(ep.requests) > 1:
            yield dataclasses.replace(ep, requests=ep.requests[:k] + ep.requests[k + 1 :])
    for i in range(len(ep.shapes)):
        if len(ep.shapes) > 1 and not any(r.instance == i for r in ep.requests):
            keep = [j for j in range(len(ep.shapes)) if j != i]
            renum = {j: n for n, j in enumerate(keep)}
            yield dataclasses.replace(
                ep,
                shapes=tuple(ep.shapes[j] for j in keep),
                starts=tuple(ep.starts[j] for j in keep),
                requests=tuple(dataclasses.replace(r, instance=renum[r.instance]) for r in ep.requests),
                faults=tuple(dataclasses.replace(f, instance=renum[f.instance]) for f in ep.faults if f.instance in renum),
            )
    for k, f in enumerate(ep.faults):
        if f.rank is not None:  # aimed at one rank -> at any rank's next copy
            yield dataclasses.replace(ep, faults=ep.faults[:k] + (dataclasses.replace(f, rank=None),) + ep.faults[k + 1 :])
    for k, r in enumerate(ep.requests):
        for smaller in (
            dataclasses.replace(r, max_tokens=1) if r.max_tokens > 1 else None,
            dataclasses.replace(r, at=0) if r.at else None,
            dataclasses.replace(r, abort_after=None) if r.abort_after is not None else None,
            dataclasses.replace(r, prompt=r.prompt[: len(r.prompt) - BLOCK]) if len(r.prompt) > BLOCK + 1 else None,
        ):
            if smaller is not None:
                yield dataclasses.replace(ep, requests=ep.requests[:k] + (smaller,) + ep.requests[k + 1 :])
    for i, s in enumerate(ep.shapes):
        for simpler in (
            dataclasses.replace(s, mtp=0) if s.mtp else None,
            dataclasses.replace(s, async_=False) if s.async_ else None,
            dataclasses.replace(s, chunk=0) if s.chunk else None,
            dataclasses.replace(s, tp=1, kv_heads=2) if s.tp > 1 and not any(f.instance == i and f.rank is not None for f in ep.faults) else None,
        ):
            if simpler is not None:
                yield dataclasses.replace(ep, shapes=ep.shapes[:i] + (simpler,) + ep.shapes[i + 1 :])
    if any(ep.starts):
        yield dataclasses.replace(ep, starts=tuple(0 for _ in ep.starts))


def size(ep: Episode) -> int:
    """What shrinking reduces: instances, requests, faults, output tokens, prompt blocks, shape options."""
    return (
        10 * len(ep.shapes) + 5 * len(ep.requests) + 5 * len(ep.faults)
        + sum(r.max_tokens + len(r.prompt) // BLOCK + (r.at > 0) + (r.abort_after is not None) for r in ep.requests)
        + sum((s.mtp > 0) + s.async_ + (s.chunk > 0) + (s.tp > 1) for s in ep.shapes) + (sum(ep.starts) > 0)
    )


def shrink(ep: Episode, fails, budget: int = 200) -> Episode:
    """Greedy delta debugging: the smallest episode found (within ``budget`` runs) for which
    ``fails(episode)`` still holds."""
    runs = 0
    improved = True
    while improved and runs < budget:
        improved = False
        for candidate in _smaller(ep):
            runs += 1
            if fails(candidate):
                ep, improved = candidate, True
                break
            if runs >= budget:
                break
    return ep
