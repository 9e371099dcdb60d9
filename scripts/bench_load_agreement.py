#!/usr/bin/env python3
"""What ``load_failures_agreement`` (issue 32) costs when nothing fails: the same engine step with a
pool load, with the library on and with only the agreement skipped, one run, as ratios.

    .matrix/v0251/bin/python scripts/bench_load_agreement.py [--tp 2 4 8] [--repeat 5] [--quick]

Scenario (the pool harness, TP ranks as processes with a real gloo TP group, 2 KV heads): A saves a
40-token prompt; B hits its 32 tokens for a prompt with 16 new tokens and decodes 2. B's first step
is the step with a pool load: the one in which every rank all-reduces one byte per request (and one
for an abandoned load) over the TP group's CPU group at the final layer's save. Per TP size it prints:

- ``step s``: the median host time of B's first engine step (schedule, every rank's forward, the
  output), on and off, and their ratio (goal <= 1.02 at TP 8);
- ``agree us``: the median time one agreement takes inside the ranks (``tp_agree``, measured in
  every rank process around the call; the slowest rank per step);
- ``publish``: the engine step after which every key B's first step saved is ready in the pool, on
  and off (the agreement publishes nothing later: the same step).

The times are this machine's (2 cores: at TP 8 the 8 rank processes and the engine share them, so
the ratio's noise is a few percent); the agreement's own time is the figure that carries over.
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
B_PROMPT = PROMPT[:32] + list(range(6000, 6016)) + [1, 2, 3]


def _time_agree(rank) -> None:
    """In a rank process: time every ``tp_agree`` call (the agreement's collective)."""
    from ascend_layerwise_patch.patches import _failed_load
    from ascend_layerwise_patch.patches.load_failures import agreement

    original = _failed_load.tp_agree
    times = rank.__dict__.setdefault("_bench_agree", [])

    def tp_agree(local, timeout_s):
        t0 = time.perf_counter()
        try:
            return original(local, timeout_s)
        finally:
            times.append(time.perf_counter() - t0)

    agreement._failed_load = type(sys)("_failed_load_timed")
    agreement._failed_load.__dict__.update(vars(_failed_load), tp_agree=tp_agree)


def _agree_times(rank) -> list[float]:
    return list(rank.__dict__.get("_bench_agree", []))


def one(tp: int) -> dict:
    from harness_pool import PoolInstance, engine_loop, make_pool

    pool = make_pool()
    a = PoolInstance(pool, name="A", tp=tp, kv_heads=2)
    try:
        a.add_request("a", PROMPT, max_tokens=1)
        engine_loop(a)
    finally:
        a.close()
    b = PoolInstance(pool, name="B", tp=tp, kv_heads=2)
    try:
        b.on_ranks(_time_agree)
        before = dict(pool.blobs)
        b.add_request("b", B_PROMPT, max_tokens=2)
        t0 = time.perf_counter()
        b.step()
        first = time.perf_counter() - t0
        saved = [k for k, blob in pool.blobs.items() if before.get(k) is not blob]
        publish, steps = None, 1
        while True:
            time.sleep(0.05)  # the sending threads finish the step's keys after the forward
            if saved and all(pool.blobs[k].state == "ready" for k in saved):
                publish = steps
                break
            if not b.has_work():
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and not all(pool.blobs[k].state == "ready" for k in saved):
                    time.sleep(0.05)
                publish = steps if all(pool.blobs[k].state == "ready" for k in saved) else None
                break
            b.step()
            steps += 1
        engine_loop(b)
        wrong = len(b.wrong_reads("b")) + len(b.wrong_reads("b", kind="attn"))
        agree = [max(ts) for ts in zip(*b.on_ranks(_agree_times))] if tp > 1 else []
    finally:
        b.close()
    assert wrong == 0, f"TP {tp}: {wrong} wrong reads"
    return {"step": first, "agree": agree[0] if agree else 0.0, "publish": publish, "keys": len(saved)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="TP 2, one run each: the script still runs (numbers not judged)")
    args = ap.parse_args(argv)
    if args.quick:
        args.tp, args.repeat = [2], 1
    from ascend_layerwise_patch import cpu_standins

    cpu_standins.install()  # the NPU runtime stood in, as the suites do
    import ascend_layerwise_patch  # noqa: F401  (as the suites: the library active)
    from ascend_layerwise_patch.patches import load_failures
    from harness_pool import groups_skipped, setup_runtime
    from support import activate_skipping

    setup_runtime()
    activate_skipping()
    one(2)  # warm-up: imports, the stand-in model's files
    print(f"{'TP':>3} {'mode':<14} {'step s':>8} {'agree us':>9} {'publish':>8} {'keys':>5}   (median of {args.repeat})")
    for tp in args.tp:
        runs: dict[str, list[dict]] = {"on": [], "agreement off": []}
        for _ in range(args.repeat):  # interleaved: the machine's drift hits both alike
            runs["on"].append(one(tp))
            with groups_skipped(load_failures.AGREEMENT_GROUP):
                runs["agreement off"].append(one(tp))
        med = {}
        for mode, rs in runs.items():
            med[mode] = statistics.median(r["step"] for r in rs)
            agree = statistics.median(r["agree"] for r in rs) * 1e6
            publish = sorted({r["publish"] for r in rs}, key=str)
            print(f"{tp:>3} {mode:<14} {med[mode]:8.3f} {agree:9.0f} {','.join(map(str, publish)):>8} {rs[0]['keys']:>5}")
        print(f"{tp:>3} {'ratio':<14} {med['on'] / med['agreement off']:7.3f}x   on / agreement off (B's step with the pool load)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
