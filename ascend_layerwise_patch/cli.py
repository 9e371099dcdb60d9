"""``ascend-layerwise-patch check [--cpu] [--json]``: import the targets, apply, report.

Exit codes: 0 every in-range patch applied (or was skipped for a stated reason), 1 something in
range failed, conflicts or is still pending, or the switches name something unknown, 2 vLLM is not
installed, 3 the NPU runtime (torch_npu) is not installed and ``--cpu`` was not given. With
``--json`` stdout always carries one JSON document, whatever happened.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys

from . import registry as _registry
from .versions import detect

#: vllm-ascend imports its worker patches late, inside NPUWorker.__init__; check does the same
#: so that what a worker ends up with is what gets reported.
WORKER_PATCHES = "vllm_ascend.patch.worker"

#: vLLM's warnings that ``--cpu``'s stood-in ``triton.runtime`` causes (see cpu_standins)
STANDIN_TRITON_MESSAGES = ("triton.backends` could not be imported", "Failed to import Triton kernels")


def _table(rows: list[dict]) -> str:
    """One row per patch (its target), then one row per copy of the target, each with its state."""
    cols = ["patch", "group", "place", "versions", "state", "reason"]
    data = []
    for r in rows:
        versions = "vllm" + (r["ranges"]["vllm"] or "") + (f"; ascend{r['ranges']['vllm_ascend']}" if r["ranges"]["vllm_ascend"] else "")
        for place in r["places"]:
            first = place["role"] == "target"
            data.append([
                r["name"] if first else "  copy",
                r["group"] if first else "",
                place["place"],
                versions if first else "",
                place["state"],
                place["reason"] or (r.get("why", "") if first and place["state"] == _registry.APPLIED else ""),
            ])
    widths = [max(len(c), *(len(d[i]) for d in data)) if data else len(c) for i, c in enumerate(cols)]
    widths[-1] = len(cols[-1])
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(d, widths)).rstrip() for d in data]
    return "\n".join(lines)


def _refuse(as_json: bool, found: dict, code: int, error: str) -> int:
    """One line on stderr; with --json also a JSON document on stdout."""
    print(f"ascend-layerwise-patch: {error}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": error, "exit": code, "versions": {k: v.raw for k, v in found.items()}}, indent=2))
    return code


class _Seen:
    """Counts the log records carrying one of the stood-in runtime's Triton warnings. A record
    factory, since vLLM's logging config replaces its loggers' handlers and stops propagation."""

    def __init__(self):
        self.hits = 0
        self._factory = logging.getLogRecordFactory()

    def __call__(self, *args, **kwargs):
        record = self._factory(*args, **kwargs)
        if record.levelno >= logging.WARNING and any(t in str(record.msg) for t in STANDIN_TRITON_MESSAGES):
            self.hits += 1
        return record

    def __enter__(self):
        logging.setLogRecordFactory(self)
        return self

    def __exit__(self, *exc):
        logging.setLogRecordFactory(self._factory)


def check(cpu: bool, as_json: bool) -> int:
    found = detect()
    if found["vllm"].raw is None:
        return _refuse(as_json, found, 2, "vLLM is not installed; nothing to check")
    from . import REGISTRY  # hooks nothing yet: activation waits for vLLM's import

    errors = REGISTRY.switch_errors()
    if errors:
        return _refuse(as_json, found, 1, "; ".join(errors))
    if not cpu and importlib.util.find_spec("torch_npu") is None:
        return _refuse(
            as_json,
            found,
            3,
            "the NPU runtime is missing (torch_npu is not installed), so nothing was checked; "
            "`check --cpu` checks the patch plan with the NPU runtime stood in",
        )
    if as_json:  # keep stdout for the JSON document: vLLM logs to stdout by default
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    notes = []
    with contextlib.redirect_stdout(sys.stderr if as_json else sys.stdout), _Seen() as seen:
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
    if cpu and seen.hits:
        print(
            "ascend-layerwise-patch: the Triton WARNING/ERROR above ('triton.backends could not be imported', "
            "'Failed to import Triton kernels') are expected under --cpu: the stood-in NPU runtime replaces "
            "triton.runtime; on an NPU node (no --cpu) the same lines would mean triton-ascend is broken",
            file=sys.stderr if as_json else sys.stdout,
        )
    whys = {spec.name: spec.why for spec in alp.REGISTRY.specs}  # what each patch changes (applied rows show it)
    rows = [{**st.as_dict(), "why": whys.get(st.name, "")} for st in alp.REGISTRY.status()]
    bad_states = (_registry.FAILED, _registry.CONFLICT, _registry.PENDING)
    bad = [r for r in rows if any(p["state"] in bad_states for p in r["places"])]
    errors = list(alp.REGISTRY.config_errors)
    if as_json:
        doc = {"versions": {k: v.raw for k, v in found.items()}, "patches": rows, "errors": errors, "notes": notes}
        print(json.dumps(doc, indent=2))
    else:
        print("ascend-layerwise-patch check: " + ", ".join(f"{k} {v}" for k, v in found.items()))
        print(_table(rows))
        for note in notes:
            print(note)
        for error in errors:
            print(f"error: {error}")
        print(f"{len(rows) - len(bad)} of {len(rows)} patches applied or skipped for a stated reason; {len(bad)} failed or pending")
    return 1 if bad or errors else 0


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
