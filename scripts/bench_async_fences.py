"""Cost of the async free fence (async_fences) against today's code: the scheduler step with vs without
deferred block frees, side by side in one process.

    .matrix/v0251/bin/python scripts/bench_async_fences.py [--quick]

CPU, NPU runtime stood in, real vLLM 0.25.1 + vllm-ascend 0.25.1rc1 objects (tests/standins/harness_pool):
a kv_producer PoolInstance with async scheduling (EngineCore's batch queue, depth 2) serves a random
workload with aborts (``harness_pool.soak``: 40 requests of 20-300 tokens, 16 running, a quarter of
them sharing a prefix, a fast store). The patch only sets vLLM's ``defer_block_free`` at start-up;
"today" is the same instance with it put back to False. Measured: ``Scheduler.schedule()`` +
``update_from_output()`` per step (where vLLM advances the fence and drains deferred frees), summed
over the workload, the two alternated per run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "standins")]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smaller workload (CI smoke)")
    args = parser.parse_args()
    requests, runs = (8, 1) if args.quick else (40, 3)

    from ascend_layerwise_patch import cpu_standins

    cpu_standins.install()
    import ascend_layerwise_patch as alp
    import harness_pool as hp
    from ascend_layerwise_patch.patches import async_fences

    alp.REGISTRY.apply_pending()

    def workload(fenced: bool, seed: int) -> tuple[float, int, int]:
        inst = hp.PoolInstance(
            hp.make_pool(), num_blocks=240, max_num_seqs=16, max_model_len=512, kv_role="kv_producer", async_scheduling=True
        )
        sched = inst.scheduler
        assert sched.defer_block_free, f"async_free_fence is not applied: {async_fences.counters()}"
        sched.defer_block_free = fenced
        spent = [0.0, 0, 0]
        schedule, update = sched.schedule, sched.update_from_output

        def timed_schedule():
            t = time.perf_counter()
            so = schedule()
            spent[0] += time.perf_counter() - t
            spent[1] += 1
            return so

        def timed_update(so, out):
            t = time.perf_counter()
            spent[2] += bool(sched.deferred_frees)
            result = update(so, out)
            spent[0] += time.perf_counter() - t
            return result

        sched.schedule, sched.update_from_output = timed_schedule, timed_update
        figures = hp.soak(inst, seed=seed, requests=requests, abort_p=0.05, deadline_s=120.0)
        assert not figures["unfinished"], figures
        return spent[0], spent[1], spent[2]

    totals = {False: [0.0, 0, 0], True: [0.0, 0, 0]}
    for run in range(runs):
        for fenced in ((False, True) if run % 2 == 0 else (True, False)):
            s, n, d = workload(fenced, seed=run)
            totals[fenced][0] += s
            totals[fenced][1] += n
            totals[fenced][2] += d
    today, ours = (totals[f][0] / totals[f][1] * 1e6 for f in (False, True))
    print(f"kv_producer, async scheduling, {requests} requests x {runs} run(s), aborts 5%/step")
    print(f"schedule() + update_from_output() per step: today {today:.1f} us, fenced {ours:.1f} us, ratio {ours / today:.2f}x")
    print(f"steps that held deferred frees (fenced): {totals[True][2]} of {totals[True][1]}")
    if args.quick:
        print("(--quick: a smoke run; its timings and ratios are not judged)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
