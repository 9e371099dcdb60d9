#!/usr/bin/env python3
"""What the pool harness's rank processes cost: the same scenario with the TP ranks as processes
(one forked process per rank, a real gloo TP group, the byte store served over a socket) and with
every rank in the test's process, one run, as ratios.

    .matrix/v0251/bin/python scripts/bench_harness.py [--tp 2 4 8] [--repeat 3]

The scenario is test_rank_processes.py's layout test: A (TP ranks, 2 KV heads) saves a 40-token
prompt, B (same layout, empty cache) hits 32 tokens and decodes 2. Per layout it prints the build
time of the instances (B's: its rank processes start, join the TP group and build their worker
halves), the time of A's and B's engine loops, and the ratios processes / in-process. The times
are this machine's (2 cores here: at TP 8 the 8 rank processes share them); the matrix cost is
the sum over the suites' tests, printed per suite by scripts/matrix.sh.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "standins"), str(ROOT / "tests"), str(ROOT)]

PROMPT = list(range(1000, 1040))


def one(tp: int, processes: bool) -> dict[str, float]:
    from harness_pool import PoolInstance, engine_loop, make_pool

    pool = make_pool()
    t0 = time.perf_counter()
    a = PoolInstance(pool, name="A", tp=tp, kv_heads=2, processes=processes)
    t1 = time.perf_counter()
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    t2 = time.perf_counter()
    a.close()
    b = PoolInstance(pool, name="B", tp=tp, kv_heads=2, processes=processes)
    t3 = time.perf_counter()
    b.add_request("b", PROMPT[:32] + [7, 8, 9, 10, 11], max_tokens=2)
    engine_loop(b)
    t4 = time.perf_counter()
    wrong = len(b.wrong_reads("b")) + len(b.wrong_reads("b", kind="attn"))
    b.close()
    assert wrong == 0, f"TP {tp}: {wrong} wrong reads"
    return {"build": (t1 - t0) + (t3 - t2), "steps": (t2 - t1) + (t4 - t3)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    from ascend_layerwise_patch import cpu_standins

    cpu_standins.install()  # the NPU runtime stood in, as the suites do
    import ascend_layerwise_patch  # noqa: F401  (as the suites: the library active)

    one(2, False)  # warm-up: imports, the stand-in model's files
    print(f"{'TP':>3} {'mode':<11} {'build s':>8} {'steps s':>8}   (median of {args.repeat})")
    for tp in args.tp:
        med = {}
        for processes in (False, True):
            runs = [one(tp, processes) for _ in range(args.repeat)]
            med[processes] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            mode = "processes" if processes else "in-process"
            print(f"{tp:>3} {mode:<11} {med[processes]['build']:8.2f} {med[processes]['steps']:8.2f}")
        ratio = {k: med[True][k] / med[False][k] for k in med[True]}
        print(f"{tp:>3} {'ratio':<11} {ratio['build']:8.2f}x {ratio['steps']:7.2f}x   processes / in-process")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
