#!/usr/bin/env python3
"""The pool simulation's long run: seeded episodes on one pair, a progress bar, and a summary table.

    python scripts/simulate.py --pair v0251 --seeds 10000 [--start 0] [--jobs N] [--shrink]

Each job is a pytest process of the pair's venv (``.matrix/<pair>``) running
``tests/standins/test_simulation.py::test_long_run`` on its slice of seeds; every episode's outcome is
a JSON line. ``--shrink`` reduces each failing seed's episode and prints it as a pytest case (paste it
into ``REGRESSIONS`` of tests/standins/test_simulation.py once the library fixes it).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pytest(python: str, test: str, env: dict) -> subprocess.Popen:
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", f"tests/standins/test_simulation.py::{test}"]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _rows(paths) -> list[dict]:
    rows = []
    for p in paths:
        if p.exists():
            rows += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return rows


def _bar(done: int, total: int, failed: int, started: float) -> str:
    width = 40
    filled = int(width * done / max(total, 1))
    rate = done / max(time.monotonic() - started, 1e-9)
    eta = (total - done) / rate if rate else 0
    return f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} episodes, {failed} failing, {rate:.2f}/s, eta {eta:.0f} s "


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", required=True, help="a pair of scripts/pairs.txt with a built venv (.matrix/<pair>)")
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--shrink", action="store_true", help="shrink every failing seed's episode")
    args = ap.parse_args(argv)
    python = ROOT / ".matrix" / args.pair / "bin" / "python"
    if not python.exists():
        print(f"simulate: no venv for {args.pair} at {python} (bash scripts/env.sh {args.pair})", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="alp-sim-"))
    per_job = -(-args.seeds // args.jobs)
    jobs, outs = [], []
    for j in range(args.jobs):
        start = args.start + j * per_job
        count = min(per_job, args.start + args.seeds - start)
        if count <= 0:
            break
        out = tmp / f"job{j}.jsonl"
        outs.append(out)
        jobs.append(_pytest(str(python), "test_long_run", {"ALP_SIM_SEEDS": f"{start}:{count}", "ALP_SIM_OUT": str(out)}))
    started = time.monotonic()
    while any(p.poll() is None for p in jobs):
        rows = _rows(outs)
        sys.stderr.write(_bar(len(rows), args.seeds, sum(1 for r in rows if _failed(r)), started))
        sys.stderr.flush()
        time.sleep(1.0)
    rows = _rows(outs)
    sys.stderr.write(_bar(len(rows), args.seeds, sum(1 for r in rows if _failed(r)), started) + "\n")
    for p in jobs:
        if p.returncode != 0:
            print(f"simulate: a job ended with exit {p.returncode}:\n{p.stdout.read()[-3000:]}", file=sys.stderr)
    print(table(args.pair, rows, time.monotonic() - started))
    failing = [r["seed"] for r in rows if _failed(r)]
    if failing:
        print(f"failing seeds: {failing}")
    if args.shrink:
        for seed in failing:
            out = tmp / f"shrink{seed}.json"
            p = _pytest(str(python), "test_shrink", {"ALP_SIM_SHRINK": str(seed), "ALP_SIM_OUT": str(out)})
            p.wait()
            if out.exists():
                found = json.loads(out.read_text())
                print(f"\nseed {seed}: shrunk from size {found['size'][0]} to {found['size'][1]} "
                      f"(still fails: {found['still_fails']}; {found['what'][:300]})\n{found['case']}")
    return 1 if failing or len(rows) < args.seeds else 0


def _failed(row: dict) -> bool:
    return bool(row.get("error") or row.get("divergences") or row.get("wrong_reads") or row.get("leaks") or row.get("stops"))


def table(pair: str, rows: list[dict], seconds: float) -> str:
    faults = collections.Counter()
    for r in rows:
        faults.update({k: v for k, v in r.get("faults", {}).items()})
    slowest = max(rows, key=lambda r: r.get("seconds", 0), default=None)
    lines = [
        f"simulation on {pair}: {len(rows)} episodes in {seconds:.0f} s",
        "| figure | value |", "|---|---|",
        f"| episodes | {len(rows)} |",
        f"| requests | {sum(r.get('requests', 0) for r in rows)} |",
        f"| tokens compared | {sum(r.get('tokens', 0) for r in rows)} |",
        f"| faults that hit (copies; evict: keys) | {', '.join(f'{k} {v}' for k, v in sorted(faults.items())) or 'none'} |",
        f"| divergences | {sum(r.get('divergences', 0) for r in rows)} |",
        f"| wrong reads | {sum(r.get('wrong_reads', 0) for r in rows)} |",
        f"| hangs | {sum(r.get('hangs', 0) for r in rows)} |",
        f"| leaks | {sum(r.get('leaks', 0) for r in rows)} |",
        f"| engine stops | {sum(len(r.get('stops', [])) for r in rows)} |",
        f"| harness errors | {sum(1 for r in rows if r.get('error'))} |",
        f"| slowest episode | seed {slowest['seed']}, {slowest.get('seconds')} s |" if slowest else "| slowest episode | - |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
