#!/usr/bin/env python3
"""The pool simulation's long run: seeded episodes on one pair, a progress bar, and a summary table.

    python scripts/simulate.py --pair v0251 --seeds 10000 [--start 0] [--jobs N] [--shrink]
    python scripts/simulate.py --pair v0251 --seeds 60 --jobs 2 --groups-off all [--shrink]
    python scripts/simulate.py --pair v0300 --seeds 200 --jobs 2 --space fleet

Each job is a pytest process of the pair's venv (``.matrix/<pair>``) running
``tests/standins/test_simulation.py::test_long_run`` on its slice of seeds; every episode's outcome is
a JSON line. ``--shrink`` reduces each failing seed's episode and prints it as a pytest case (paste it
into ``REGRESSIONS`` of tests/standins/test_simulation.py once the library fixes it).

``--groups-off`` (comma-separated groups, ``all`` for every group that applies on the pair, ``library``
for ``ASCEND_LAYERWISE_PATCH=0``) runs, for each in turn, the seeds from ``--start`` with that group
skipped (``ASCEND_LAYERWISE_PATCH_SKIP``) until the first failing episode, at most ``--seeds``; it
ends with a table: group, first failing seed (or none in N), what failed and, with ``--shrink``, the
size of the shrunk episode. A group the simulation never catches is a hole in the generator.
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


def _jobs(python: str, seeds: tuple[int, int], jobs: int, tmp: Path, env: dict, interleave: bool = False):
    """Start ``jobs`` pytest processes over ``seeds`` (start, count): contiguous slices, or with
    ``interleave`` every ``jobs``-th seed each (the seeds then finish roughly in order)."""
    start, total = seeds
    procs, outs = [], []
    per_job = -(-total // jobs)
    for j in range(jobs):
        if interleave:
            count = len(range(start + j, start + total, jobs))
            spec = f"{start + j}:{count}:{jobs}"
        else:
            first = start + j * per_job
            count = min(per_job, start + total - first)
            spec = f"{first}:{count}"
        if count <= 0:
            break
        out = tmp / f"job{j}.jsonl"
        outs.append(out)
        procs.append(_pytest(python, "test_long_run", {**env, "ALP_SIM_SEEDS": spec, "ALP_SIM_OUT": str(out)}))
    return procs, outs


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
    ap.add_argument("--space", choices=("mixed", "fleet"), default="mixed",
                    help="the episodes: mixed shapes, mostly TP 1 (CI_SEEDS), or one TP 2-8 deployment with one-rank faults")
    ap.add_argument("--groups-off", default="", help="GROUP[,GROUP] | all | library: for each, the first failing seed with it off")
    args = ap.parse_args(argv)
    os.environ["ALP_SIM_SPACE"] = args.space  # read by test_simulation in every job
    python = ROOT / ".matrix" / args.pair / "bin" / "python"
    if not python.exists():
        print(f"simulate: no venv for {args.pair} at {python} (bash scripts/env.sh {args.pair})", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="alp-sim-"))
    if args.groups_off:
        return groups_off(args, str(python), tmp)
    jobs, outs = _jobs(str(python), (args.start, args.seeds), args.jobs, tmp, {})
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
            found = _shrink(str(python), seed, tmp, {})
            if found:
                print(f"\nseed {seed}: shrunk from size {found['size'][0]} to {found['size'][1]} "
                      f"(still fails: {found['still_fails']}; {found['what'][:300]})\n{found['case']}")
    return 1 if failing or len(rows) < args.seeds else 0


def _shrink(python: str, seed: int, tmp: Path, env: dict) -> dict | None:
    out = tmp / f"shrink{seed}.json"
    out.unlink(missing_ok=True)
    p = _pytest(python, "test_shrink", {**env, "ALP_SIM_SHRINK": str(seed), "ALP_SIM_OUT": str(out)})
    p.wait()
    return json.loads(out.read_text()) if out.exists() else None


def _applying_groups(python: str) -> list[str]:
    """The groups with a patch applied on this pair (``check --cpu --json`` in the pair's own venv)."""
    cli = Path(python).parent / "ascend-layerwise-patch"
    out = subprocess.run([str(cli), "check", "--cpu", "--json"], cwd=ROOT, capture_output=True, text=True).stdout
    return sorted({p["group"] for p in json.loads(out)["patches"] if p["state"] == "applied"})


def _what(row: dict) -> str:
    if row.get("error"):
        return " ".join(("harness error: " + row["error"][:80]).split())
    parts = []
    if row.get("stops"):
        parts.append("stop: " + row["stops"][0][:90])
    if row.get("divergences"):
        parts.append(f"{row['divergences']} diverging request(s)")
    if row.get("wrong_reads"):
        parts.append(f"{row['wrong_reads']} wrong read(s)")
    if row.get("leaks"):
        parts.append(f"{row['leaks']} leak(s)")
    return " ".join("; ".join(parts).split())  # one table row: no newlines


def groups_off(args, python: str, tmp: Path) -> int:
    """For each group of ``--groups-off``: seeds from ``--start`` with it skipped until one fails."""
    names = []
    for name in args.groups_off.split(","):
        names += _applying_groups(python) if name == "all" else [name]
    table_rows = []
    for name in names:
        env = {"ASCEND_LAYERWISE_PATCH": "0", "ALP_SIM_POLICY": "fail"} if name == "library" else {"ASCEND_LAYERWISE_PATCH_SKIP": name}
        if name.startswith(("load_failures", "pool_load_recovery")) and not name.endswith("_policy"):
            env["ALP_SIM_POLICY"] = "fail"  # `recompute` needs the policy group, which needs these (the policy's own row: the refusal)
        run = tmp / name
        run.mkdir(exist_ok=True)
        jobs, outs = _jobs(python, (args.start, args.seeds), args.jobs, run, env, interleave=True)
        started, first = time.monotonic(), None
        while True:
            done = all(p.poll() is not None for p in jobs)  # before the read: a finished job's rows are all in
            rows = {r["seed"]: r for r in _rows(outs)}
            bad = sorted(s for s, r in rows.items() if _failed(r))
            # the first failing seed once every seed below it has run
            if bad and (done or all(s in rows for s in range(args.start, bad[0]))):
                first = rows[bad[0]]
                break
            if done:
                break
            sys.stderr.write(f"\r{name}: {len(rows)}/{args.seeds} episodes, {time.monotonic() - started:.0f} s ")
            sys.stderr.flush()
            time.sleep(0.5)
        for p in jobs:
            if p.poll() is None:
                p.terminate()  # its rank processes end with it (rank_procs sets PR_SET_PDEATHSIG)
            p.wait()
        ran = len({r["seed"] for r in _rows(outs)})
        size = ""
        if first is not None and args.shrink:
            found = _shrink(python, first["seed"], run, env)
            size = f"{found['size'][0]} -> {found['size'][1]}" if found else "shrink failed"
        row = (name, str(first["seed"]) if first else f"none in {ran}", _what(first) if first else "-", size)
        table_rows.append(row)
        sys.stderr.write(f"\r{name}: first failing seed {row[1]} ({time.monotonic() - started:.0f} s)\n")
    print(f"groups off on {args.pair} (seeds from {args.start}, at most {args.seeds} each)")
    print("| group off | first failing seed | what failed | shrunk size |")
    print("|---|---|---|---|")
    for row in table_rows:
        print("| " + " | ".join(row) + " |")
    return 0


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
