"""The pool simulation (``harness_pool.simulation``): seeded random episodes of 2-3 engines sharing one
store, with store faults, each request held token for token against a run without the pool.

CI runs :data:`CI_SEEDS`, :data:`FLEET_SEEDS` on v0251, v0260 and v0300 and every shrunk regression episode;
``scripts/simulate.py`` runs long (``ALP_SIM_SEEDS=start:count``, results as JSON lines in
``ALP_SIM_OUT``) and shrinks what fails.
"""

from __future__ import annotations

import json
import os

import pytest

from support import PAIR

PAIRS = ("v0251", "v0260", "v0300")
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from harness_pool.simulation import Episode, Fault, Req, Shape, check, episode_from_seed, run_episode  # noqa: E402,F401

pytestmark = pytest.mark.pairs(*PAIRS)

#: the seeds every CI run holds
CI_SEEDS = range(20)  # ~30 s a pair on 2 cores: the matrix stays inside its 45 minutes (the long run: scripts/simulate.py)

#: the fleet seeds every CI run holds (``fleet``: one deployment of TP 2-8, faults aimed at one rank)
FLEET_SEEDS = range(4)
#: the episode space of the long run and the shrinker (scripts/simulate.py --space)
SPACE = os.environ.get("ALP_SIM_SPACE", "mixed")

#: episodes the simulation found failing, shrunk (scripts/simulate.py prints them): each is a defect
#: the library fixed, kept as a regression case
REGRESSIONS: list[Episode] = [
    # seed 18 (v0251, no fault): an instance with MTP 1 and one without share the pool; the one without
    # MTP hits the other's first block and read its attention blobs at another layer layout (MTP's layer
    # is in the attention group): wrong tokens. pool_key_layout's keys now name the draft layers (.d1).
    Episode(seed=18, shapes=(Shape(mtp=1, num_blocks=48), Shape()), starts=(0, 0), requests=(
        Req(instance=0, at=0, prompt=tuple(range(1000, 1033)), max_tokens=1),
        Req(instance=1, at=0, prompt=tuple(range(1000, 1020)), max_tokens=1),
    )),
    # seed 47 (v0251): async scheduling, MTP 3, a pool load that raised; the rollback discarded one
    # in-flight frame per placeholder (1 + 3 a step) instead of one per step: the good frames after
    # the recovery were dropped and the request ran past max_tokens (load_failures_rollback).
    Episode(seed=47, shapes=(Shape(mtp=3), Shape(async_=True, mtp=3, num_blocks=48)), starts=(3, 5), requests=(
        Req(instance=0, at=0, prompt=tuple(range(3000, 3047)), max_tokens=1),
        Req(instance=1, at=4, prompt=tuple(range(3000, 3031)), max_tokens=3),
    ), faults=(Fault(kind="load_raise", instance=1, at=8),)),
    # seed 0 (v0260, save faults added to the generator): one save copy returned an error; 0.26's
    # sending thread raised and the engine stopped (17 of seeds 0-29 stopped so). pool_save_failures
    # now finishes that copy's keys as failed and serving goes on (0.30 stopped alike).
    Episode(seed=0, shapes=(Shape(num_blocks=128),), starts=(4,), requests=(
        Req(instance=0, at=5, prompt=tuple(range(1000, 1017)), max_tokens=1),
    ), faults=(Fault(kind="save_error", instance=0, at=8),)),
    # seed 435 (v0260, no fault): one engine schedules, in the same step, two hits on one pool prefix:
    # 69 tokens (GDN resumes at block 3: blocks 0-2 of its mamba group are null) and a 48-token prompt
    # (its hit ends at block 2, the block it computes is a real block 2). mamba_pool_null_loads took
    # that real block for a load and looked the null block's key up for the first request: never
    # published, so vllm-ascend 0.26 stopped the engine ("Layerwise multi-group KV load failed").
    # Now only blocks inside a request's own load range count.
    Episode(seed=435, shapes=(Shape(tp=2, kv_heads=1, num_blocks=128, chunk=32), Shape(tp=2, kv_heads=1, num_blocks=128, chunk=0)),
            starts=(0, 0), requests=(
        Req(instance=1, at=4, prompt=tuple(range(1000, 1064)) + (38, 39, 40, 41, 42), max_tokens=1),
        Req(instance=0, at=0, prompt=tuple(range(1000, 1064)), max_tokens=1),
        Req(instance=1, at=4, prompt=tuple(range(1000, 1048)), max_tokens=1),
    )),
]


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_seeded_episode(seed):
    result = run_episode(episode_from_seed(seed))
    print(f"\n{PAIR} seed {seed}: {result.requests} requests, {result.tokens} tokens compared, faults hit "
          f"{ {k: sum(getattr(x, 'hits', x) for x in v) for k, v in result.faults.items()} }")
    check(result)


@pytest.mark.parametrize("seed", FLEET_SEEDS)
def test_fleet_episode(seed):
    result = run_episode(episode_from_seed(seed, "fleet"))
    print(f"\n{PAIR} fleet seed {seed}: {result.episode.shapes[0]}, {result.requests} requests, {result.tokens} tokens "
          f"compared, faults hit { {k: sum(getattr(x, 'hits', x) for x in v) for k, v in result.faults.items()} }")
    check(result)


@pytest.mark.parametrize("episode", REGRESSIONS, ids=lambda ep: f"seed{ep.seed}")
def test_shrunk_regression(episode):
    check(run_episode(episode))


@pytest.mark.pairs("v0251")
@pytest.mark.control("the library's own group isolation: with the library off none of its groups runs to raise")
def test_a_group_off_shows_its_own_defect_not_another_group_s_error():
    """``gdn_layerwise`` skipped (``--groups-off``): GDN layers do not wait for their loads (wrong reads:
    its defect), and ``load_failures``' layer wait, whose step used to begin at the GDN first layer,
    must not raise (it did: KeyError '_ascend_layerwise_patch_load_step', every episode a stop)."""
    from harness_pool import groups_skipped

    with groups_skipped("gdn_layerwise"):
        result = run_episode(episode_from_seed(0))
    print(f"\ngdn_layerwise off, seed 0: stops {[s[1][:120] for s in result.stops]}, wrong reads {result.wrong_reads}")
    assert result.stops == [] and result.wrong_reads > 0


def _long_run_seeds() -> list[int]:
    spec = os.environ.get("ALP_SIM_SEEDS")
    if not spec:
        return []
    start, count, *stride = (int(x) for x in spec.split(":"))  # start:count[:stride]
    step = stride[0] if stride else 1
    return list(range(start, start + count * step, step))


@pytest.mark.skipif(not os.environ.get("ALP_SIM_SEEDS"), reason="scripts/simulate.py's long run (ALP_SIM_SEEDS)")
@pytest.mark.control("the long run's driver: its failures are reported by scripts/simulate.py, not asserted here")
def test_long_run():
    """One pytest test for a slice of seeds: each episode's outcome is a JSON line in ALP_SIM_OUT."""
    import time

    out = os.environ["ALP_SIM_OUT"]
    for seed in _long_run_seeds():
        started = time.monotonic()
        ep = episode_from_seed(seed, SPACE)
        try:
            result = run_episode(ep)
            row = {
                "seed": seed, "requests": result.requests, "tokens": result.tokens,
                "faults": {k: sum(getattr(x, "hits", x) for x in v) for k, v in result.faults.items()},  # copies hit / keys evicted
                "divergences": len(result.divergences), "wrong_reads": result.wrong_reads,
                "leaks": len(result.leaks), "stops": [s[1][:200] for s in result.stops],
                "hangs": sum("hung" in s[1] for s in result.stops),
            }
        except Exception as exc:  # the harness itself failed: reported, the run goes on
            row = {"seed": seed, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        row["seconds"] = round(time.monotonic() - started, 2)
        row["episode"] = repr(ep)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.mark.skipif(not os.environ.get("ALP_SIM_SHRINK"), reason="scripts/simulate.py --shrink (ALP_SIM_SHRINK)")
@pytest.mark.control("the shrinker's driver: scripts/simulate.py prints what it found")
def test_shrink():
    """Shrinks the episode of seed ALP_SIM_SHRINK while it still fails; writes the pytest case to ALP_SIM_OUT."""
    from harness_pool.simulation import shrink, size

    ep = episode_from_seed(int(os.environ["ALP_SIM_SHRINK"]), SPACE)
    first = run_episode(ep)
    small = shrink(ep, lambda e: not run_episode(e).ok) if not first.ok else ep
    last = run_episode(small)
    with open(os.environ["ALP_SIM_OUT"], "w") as f:
        json.dump({"seed": ep.seed, "failed": not first.ok, "size": [size(ep), size(small)],
                   "still_fails": not last.ok, "case": small.as_test(), "what": repr(last.stops or last.divergences[:2] or last.leaks or last.wrong_reads)}, f)
