"""``ascend-layerwise-patch check [--cpu] [--json]``: import the targets, apply, report.

Exit codes: 0 every in-range patch applied (or was skipped for a stated reason), 1 something in
range failed or conflicts, 2 vLLM is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from . import registry as _registry
from .versions import detect

#: vllm-ascend imports its worker patches late, inside NPUWorker.__init__; check does the same
#: so that what a worker ends up with is what gets reported.
WORKER_PATCHES = "vllm_ascend.patch.worker"


def _table(rows: list[dict]) -> str:
    cols = ["patch", "group", "target", "versions", "state", "reason"]
    data = [
        [
            r["name"],
            r["group"],
            r["target"] + (f" (+{len(r['aliases'])} aliases)" if r["aliases"] else ""),
            "vllm" + (r["ranges"]["vllm"] or "") + (f"; ascend{r['ranges']['vllm_ascend']}" if r["ranges"]["vllm_ascend"] else ""),
            r["state"],
            r["reason"],
        ]
        for r in rows
    ]
    widths = [max(len(c), *(len(d[i]) for d in data)) if data else len(c) for i, c in enumerate(cols)]
    widths[-1] = len(cols[-1])
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(d, widths)).rstrip() for d in data]
    return "\n".join(lines)


def check(cpu: bool, as_json: bool) -> int:
    found = detect()
    if found["vllm"].raw is None:
        print("ascend-layerwise-patch: vLLM is not installed; nothing to check", file=sys.stderr)
        return 2
    if as_json:  # keep stdout for the JSON document: vLLM logs to stdout by default
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    notes = []
    with contextlib.redirect_stdout(sys.stderr if as_json else sys.stdout):
        if cpu:
            from . import cpu_standins

            cpu_standins.install()
        import ascend_layerwise_patch as alp  # activates (hooks only) if not already

        alp.REGISTRY.activate()
        alp.REGISTRY.apply_pending()
        if found["vllm_ascend"].raw is not None:
            try:
                __import__(WORKER_PATCHES)
            except Exception as exc:  # noqa: BLE001 - reported, not fatal: our patches are checked below
                notes.append(f"note: importing {WORKER_PATCHES} (as an NPU worker does) failed here: {exc!r}")
    rows = [st.as_dict() for st in alp.REGISTRY.status()]
    bad = [r for r in rows if r["state"] in (_registry.FAILED, _registry.CONFLICT, _registry.PENDING)]
    if as_json:
        print(json.dumps({"versions": {k: v.raw for k, v in found.items()}, "patches": rows, "notes": notes}, indent=2))
    else:
        print("ascend-layerwise-patch check: " + ", ".join(f"{k} {v}" for k, v in found.items()))
        print(_table(rows))
        for note in notes:
            print(note)
        print(f"{len(rows) - len(bad)} of {len(rows)} patches applied or skipped for a stated reason; {len(bad)} failed")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ascend-layerwise-patch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser("check", help="import the targets, apply the patches, print what happened")
    p_check.add_argument("--cpu", action="store_true", help="stand in for the NPU runtime first (CPU build box)")
    p_check.add_argument("--json", action="store_true", help="print the records as JSON")
    args = parser.parse_args(argv)
    return check(cpu=args.cpu, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
