"""Cost of the send backlog bound (send_shedding) against today's code, side by side in one process.

    .matrix/v0251/bin/python scripts/bench_shedding.py [--quick]

CPU, NPU runtime stood in, real vLLM 0.25.1 + vllm-ascend 0.25.1rc1 objects (tests/standins/harness_pool).
The bound adds scheduler code only: a wrapper on ``KVPoolScheduler.build_connector_meta`` (sums the
block references of the open send events once per step) and one check per saving request in the
lifetime patch's ``touch_sending_mamba_blocks``. "Today's code" is the same process with
``build_connector_meta`` put back to vllm-ascend's own (the touch hook then finds no budget and
admits at once, one dict lookup). Measured:

1. ``build_connector_meta`` alone, with no request and 0 / 32 open send events (ns per call);
2. the scheduler step: ``Scheduler.schedule()`` (which calls ``build_connector_meta``) summed over
   a whole workload on a PoolInstance (40 requests of 20-300 tokens, 16 running, a fast store: the
   bound never binds, so both runs do the same work), today's code and the bound alternated per run.
"""

from __future__ import annotations

import argparse
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "standins")]


def per_call_ns(fn, number: int) -> float:
    return timeit.Timer(fn).timeit(number) / number * 1e9


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer iterations, a smaller workload (CI smoke)")
    args = parser.parse_args()
    number, repeat, requests, runs = (500, 2, 8, 1) if args.quick else (20_000, 7, 40, 3)

    from ascend_layerwise_patch import cpu_standins

    cpu_standins.install()
    import ascend_layerwise_patch as alp
    import harness_pool as hp
    from ascend_layerwise_patch.patches.mamba_lifetime import send_shedding
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_scheduler import KVPoolScheduler

    alp.REGISTRY.apply_pending()
    top = ours = KVPoolScheduler.build_connector_meta
    while ours is not None and getattr(ours, "__ascend_layerwise_patch__", None) != "send_shedding":
        ours = getattr(ours, "__wrapped__", None)  # other groups may wrap it too (load_fail_resume_meta)
    assert ours is not None, "send_shedding is not applied"
    today = ours.__wrapped__  # both measured without the layers above send_shedding (none runs for a fast store)
    rows: list[tuple[str, float, float]] = []

    # 1. build_connector_meta alone, no request
    inst = hp.PoolInstance(hp.make_pool())
    cs = inst.scheduler.connector.connector_scheduler
    empty = SchedulerOutput.make_empty()
    empty.preempted_req_ids = set()  # as Scheduler.schedule() fills it
    for events in (0, 32):
        cs.sending_blocks.clear()
        cs.sending_blocks.update({i: list(range(1, 9)) for i in range(events)})
        a = min(per_call_ns(lambda: today(cs, empty), number) for _ in range(repeat))
        b = min(per_call_ns(lambda: ours(cs, empty), number) for _ in range(repeat))
        rows.append((f"build_connector_meta, no request, {events} open send events (ns/call)", a, b))
    cs.sending_blocks.clear()

    # 2. Scheduler.schedule() over a whole workload, fast store (nothing shed)
    def workload(patched: bool, seed: int) -> tuple[float, int]:
        KVPoolScheduler.build_connector_meta = ours if patched else today
        try:
            inst = hp.PoolInstance(hp.make_pool(), num_blocks=240, max_num_seqs=16, max_model_len=512)
            inst.scale_save_wait()
            sched = inst.scheduler
            spent = [0.0, 0]
            schedule = sched.schedule

            def timed():
                t = time.perf_counter()
                so = schedule()
                spent[0] += time.perf_counter() - t
                spent[1] += 1
                return so

            sched.schedule = timed
            shed0 = send_shedding.counters()["shed_saves"]
            hp.soak(inst, seed=seed, requests=requests, deadline_s=120.0)
            assert send_shedding.counters()["shed_saves"] == shed0, "the bound bound: not the same work"
            return spent[0], spent[1]
        finally:
            KVPoolScheduler.build_connector_meta = top

    a_s = b_s = 0.0
    a_n = b_n = 0
    for run in range(runs):
        for patched in ((False, True) if run % 2 == 0 else (True, False)):
            s, n = workload(patched, seed=run)
            if patched:
                b_s, b_n = b_s + s, b_n + n
            else:
                a_s, a_n = a_s + s, a_n + n
    rows.append((f"Scheduler.schedule() per step, {requests} requests x {runs} run(s) (us/step)", a_s / a_n * 1e6, b_s / b_n * 1e6))

    width = max(len(r[0]) for r in rows)
    print(f"{'case'.ljust(width)}       today    bound   ratio")
    for name, x, y in rows:
        print(f"{name.ljust(width)}  {x:10.1f} {y:8.1f}  {y / x:5.2f}x")
    if args.quick:
        print("(--quick: a smoke run; its timings and ratios are not judged)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
