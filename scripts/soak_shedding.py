"""Liveness soak of the layerwise send backlog bound (issue 23), bigger than CI's, with wall-time ratios.

    .matrix/v0251/bin/python scripts/soak_shedding.py [--quick] [--seeds 5] [--scenario slow,preempt,tp2]
        [--modes shed,off,nosave] [--deadline 120]

CPU, NPU runtime stood in, the pool harness of tests/standins/harness_pool (vLLM's real Scheduler,
vllm-ascend's AscendStore halves and layer threads, byte-level MemCache with a slow store; save_kv_layer's
10 s wait scaled to 30 ms). Modes: ``shed`` (this library, default bound), ``off``
(``ASCEND_LAYERWISE_PATCH_SEND_BACKLOG=off``: the library without the bound), ``shed<N>`` (the step
bound ``..._SEND_BACKLOG_STEPS=N``; ``shed0``: the block bound alone), ``nosave`` (no KV
connector: the same workload with saving turned off). Per seed and mode: wall time until every
request finished (``fin``), whether the loop stopped by itself, requests unfinished at the deadline,
the most block references / blocks held by open sends, blocks in use, preemptions, shed saves;
then the ratio of ``fin`` to the ``nosave`` run. Timings are not judged by CI (``--quick`` only runs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "standins")]

QUICK = {"requests": 16}


def activate(mode: str) -> None:
    import ascend_layerwise_patch as alp
    from ascend_layerwise_patch.patches.mamba_lifetime import send_shedding

    os.environ.pop(send_shedding.ENV_BACKLOG, None)
    os.environ.pop(send_shedding.ENV_STEPS, None)
    if mode == "off":
        os.environ[send_shedding.ENV_BACKLOG] = "off"
    elif mode.startswith("shed") and mode != "shed":  # shed<N>: the step bound N (shed0: blocks only)
        os.environ[send_shedding.ENV_STEPS] = mode[4:]
    alp.REGISTRY.revert()
    alp.REGISTRY.activate()
    alp.REGISTRY.apply_pending()


def run(scenario: str, mode: str, seed: int, deadline: float, quick: bool) -> dict:
    import harness_pool as hp
    from ascend_layerwise_patch.patches.mamba_lifetime import send_shedding

    inst_kw, soak_kw, slow_kw = hp.SOAK_SCENARIOS[scenario]
    soak_kw = {**soak_kw, **(QUICK if quick else {})}
    activate(mode)
    pool = hp.make_pool() if mode != "nosave" else None
    inst = hp.PoolInstance(pool, **inst_kw, max_model_len=512)
    fault = None
    if pool is not None:
        inst.scale_save_wait()
        fault = hp.slow_store(pool, seed=seed, **slow_kw)
    shed0 = send_shedding.counters()["shed_saves"]
    try:
        f = hp.soak(inst, seed=seed, deadline_s=deadline, **soak_kw)
        if fault is not None and not f["stopped"]:  # the store catches up: how long until everything is back
            fault.gate.set()
            t = time.monotonic()
            hp.engine_loop(inst, max_steps=1_000_000)
            f["drain_s"] = time.monotonic() - t
    finally:
        if fault is not None:
            fault.gate.set()
    f["shed"] = send_shedding.counters()["shed_saves"] - shed0
    f["bound"] = int(send_shedding.DEFAULT_FRACTION * f["num_blocks"]) if mode.startswith("shed") else None
    f["wrong_reads"] = len(inst.wrong_reads()) + len(inst.wrong_reads(kind="attn"))
    f["violations"] = len(pool.violations) if pool is not None else 0
    return f


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one seed, 16 requests, short deadline (CI smoke)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--scenario", default="slow,preempt,tp2")
    parser.add_argument("--modes", default="shed,off,nosave")
    parser.add_argument("--deadline", type=float, default=120.0)
    args = parser.parse_args()
    seeds = 1 if args.quick else args.seeds
    deadline = 20.0 if args.quick else args.deadline

    from ascend_layerwise_patch import cpu_standins

    cpu_standins.install()
    import ascend_layerwise_patch  # noqa: F401

    print(
        "scenario mode   seed   fin_s  stop_s stopped unfin  held_refs_max held_blocks_max bound used_max/blocks "
        "preempt abort  shed  wrong viol  ratio"
    )
    for scenario in args.scenario.split(","):
        for seed in range(seeds):
            rows = {}
            for mode in args.modes.split(","):
                rows[mode] = f = run(scenario, mode, seed, deadline, args.quick)
                base = rows.get("nosave")
                fin = f.get("finished_s")
                ratio = f"{fin / base['finished_s']:.2f}" if base and fin and base.get("finished_s") else "-"
                print(
                    f"{scenario:8} {mode:6} {seed:4} {fin if fin is not None else float('nan'):7.2f} {f['stopped_s']:7.2f} "
                    f"{str(f['stopped']):7} {f['unfinished']:5} {f['held_refs_max']:14} {f['held_blocks_max']:15} "
                    f"{str(f['bound']):>5} {f['used_max']:8}/{f['num_blocks']:<7} {f['preempted']:7} {f['aborted']:5} "
                    f"{f['shed']:5} {f['wrong_reads']:5} {f['violations']:4}  {ratio}",
                    flush=True,
                )
            if "nosave" in rows and rows["nosave"].get("finished_s"):
                for mode in rows:
                    if mode != "nosave" and rows[mode].get("finished_s"):
                        print(f"  {scenario} seed {seed}: {mode} / nosave = {rows[mode]['finished_s'] / rows['nosave']['finished_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
