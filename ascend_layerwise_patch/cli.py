"""``ascend-layerwise-patch check [--cpu] [--json] [--verbose]``: import the targets, apply, report.

The terminal output fits 100 columns: one line per group (state, reason), then the counts and one
line on what to do; ``--verbose`` gives every patch and place, ``--json`` every record. Exit codes
and switches: :data:`HELP` (``check --help``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys
import textwrap

from . import registry as _registry
from .registry import summary
from .registry.spec import FIXED_UPSTREAM as FIXED
from .versions import detect

#: vllm-ascend imports its worker patches late, inside NPUWorker.__init__; check does the same
#: so that what a worker ends up with is what gets reported.
WORKER_PATCHES = "vllm_ascend.patch.worker"

#: vLLM's warnings that ``--cpu``'s stood-in ``triton.runtime`` causes (see cpu_standins)
STANDIN_TRITON_MESSAGES = ("triton.backends` could not be imported", "Failed to import Triton kernels")

WIDTH = 100  #: check's own lines fit this many columns (vLLM's log lines are vLLM's)
BAD_STATES = (_registry.FAILED, _registry.CONFLICT, _registry.PENDING)
#: the state column's word for a skipped patch, by what its reason says
SKIP_WORDS = (("version out of range", "out of range"), ("does not import", "does not import"), ("disabled by", "switched off"),
              ("skipped by", "switched off"))


def _wrap(text: str, indent: int = 0, first: str = "") -> str:
    """``first`` then ``text`` wrapped to WIDTH, continuation lines indented by ``indent``."""
    lines = textwrap.wrap(text, WIDTH - indent, break_long_words=False, break_on_hyphens=False) or [""]
    return "\n".join([first + lines[0], *(" " * indent + line for line in lines[1:])])


def _fixes() -> dict[str, str]:
    """Each group's one line of what it fixes, from the index (patches/__init__.py's docstring)."""
    from . import patches

    lines = (patches.__doc__ or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.split()[:3] == ["group", "package", "what"]), len(lines))
    rows = [line.split(None, 2) for line in lines[start + 1 :] if line.strip()]
    return {row[0]: row[2] for row in rows if len(row) == 3}


def _kind(row: dict) -> str:
    """How a patch counts, its copies included: a failed or pending copy makes the patch so."""
    places = [p["state"] for p in row["places"]]
    if _registry.FAILED in places or _registry.CONFLICT in places:
        return "failed"
    if _registry.PENDING in places:
        return _registry.PENDING
    return summary.kind(row["state"], row["reason"])


def _word(kind: str, reason: str) -> str:
    if kind == _registry.SKIPPED:
        return next((word for key, word in SKIP_WORDS if key in reason), kind)
    return kind


def _group_lines(rows: list[dict]) -> list[str]:
    """One line per group (wrapped): its name, its state, why (what it fixes when applied)."""
    fixes, groups = _fixes(), {}
    for row in rows:
        groups.setdefault(row["group"], []).append(row)
    lines = []
    for group, members in groups.items():
        kinds = [_kind(m) for m in members]
        words = [_word(k, m["reason"]) for k, m in zip(kinds, members)]
        lead = next((m for m, k in zip(members, kinds) if k != _registry.APPLIED and not m["reason"].startswith("group ")), members[0])
        if len(set(words)) == 1:
            state = words[0]
            reason = f"fixes: {fixes[group]}" if state == _registry.APPLIED and group in fixes else lead["reason"]
            reason = reason.removeprefix("version out of range: ").removeprefix(FIXED + ": ")  # the state column says so
        else:
            applied = kinds.count(_registry.APPLIED)
            state = f"applied {applied}/{len(members)}" if applied else "skipped"
            others = ", ".join(f"{m['name']} ({w})" for m, w in zip(members, words) if w != _registry.APPLIED)
            reason = f"not applied: {others}" + (f"; fixes: {fixes[group]}" if applied and group in fixes else "")
        lines.append((group, state, reason))
    width = max(len(g) for g in groups) + 2
    states = max(len(state) for _, state, _ in lines) + 2
    return [_wrap(reason, width + states, f"{group:<{width}}{state:<{states}}") for group, state, reason in lines]


def _place_lines(place: dict) -> list[str]:
    """``  copy    applied  module:qualname``, broken at the ``:`` (then before the module) past WIDTH."""
    head, (module, _, qual) = f"  {place['role']:<8}{place['state']:<9}", place["place"].partition(":")
    for lines in ([head + place["place"]], [head + module, " " * 19 + ":" + qual], [head.rstrip(), "    " + module, "    :" + qual]):
        if max(map(len, lines)) <= WIDTH:
            return lines
    return lines


def _verbose_lines(rows: list[dict]) -> list[str]:
    """Every patch: its versions, what it changes, each place (target, copies) with its state."""
    out = []
    for r in rows:
        ranges = "; ".join(f"{k}{v}" for k, v in r["ranges"].items() if v)
        out.append(f"{r['name']} ({r['group']}): {r['state']}")
        out.append(_wrap(ranges or "any", 10, "  ranges  "))
        if r.get("why"):
            out.append(_wrap(r["why"], 10, "  why     "))
        if r["reason"]:
            out.append(_wrap(r["reason"], 10, "  reason  "))
        for place in r["places"]:
            out += _place_lines(place)
            if place["role"] == "copy" and place["reason"]:
                out.append(_wrap(place["reason"], 19, " " * 19))
    return out


def _verdict(rows: list[dict], kinds: list[str], errors: list[str], notes: list[str], found: dict) -> str:
    """One line: what the operator should do now."""
    bad = list(dict.fromkeys(r["group"] for r, k in zip(rows, kinds) if k in ("failed", _registry.PENDING)))
    if bad:
        return f"not ready: {', '.join(bad)} failed or pending, left unpatched (the rest is in force); see above"
    if errors:
        return "not ready: fix the switches named in the error above"
    switched = sorted({r["group"] for r in rows if "skipped by" in r["reason"]})
    off = f"; switched off: {', '.join(switched)}" if switched else ""
    if _registry.APPLIED not in kinds:
        disabled = next((r["reason"] for r in rows if r["reason"].startswith("disabled by")), None)
        if disabled:
            return f"nothing is patched: {disabled}"
        pair = f"vLLM {found['vllm'].raw} + vllm-ascend {found['vllm_ascend'].raw}"
        if all("version out of range" in r["reason"] for r in rows):
            return f"nothing is patched on this pair: the library does not cover {pair}; see the version table in the README"
        return f"nothing is patched on this pair ({pair}): each group is fixed upstream, out of range or switched off (above)"
    if notes:
        return f"the patches this pair needs are in force{off}, but vllm-ascend's own import failed (note above)"
    return f"ok: every patch that this pair needs is in force; serve as usual{off}"


def _report(rows: list[dict], notes: list[str], errors: list[str], found: dict, verbose: bool) -> None:
    kinds = [_kind(r) for r in rows]
    print(_wrap(", ".join(f"{k} {v.raw}" for k, v in found.items()), 0, "ascend-layerwise-patch check: "))
    print("\n".join(_verbose_lines(rows) if verbose else _group_lines(rows)))
    for line in [*notes, *(f"error: {e}" for e in errors)]:
        print(_wrap(line, 2))
    n_groups = len({r["group"] for r in rows})
    print(_wrap(f"{len(rows)} patches in {n_groups} groups: {summary.counts(kinds)}", 2))
    print(_wrap(_verdict(rows, kinds, errors, notes, found), 2))


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


def check(cpu: bool, as_json: bool, verbose: bool = False) -> int:
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
        note = (
            "ascend-layerwise-patch: the Triton WARNING/ERROR above ('triton.backends could not be imported', "
            "'Failed to import Triton kernels') are expected under --cpu: the stood-in NPU runtime replaces "
            "triton.runtime; on an NPU node (no --cpu) the same lines would mean triton-ascend is broken"
        )
        print(note if as_json else _wrap(note, 2), file=sys.stderr if as_json else sys.stdout)
    whys = {spec.name: spec.why for spec in alp.REGISTRY.specs}  # what each patch changes (applied rows show it)
    rows = [{**st.as_dict(), "why": whys.get(st.name, "")} for st in alp.REGISTRY.status()]
    bad = [r for r in rows if any(p["state"] in BAD_STATES for p in r["places"])]
    errors = list(alp.REGISTRY.config_errors)
    if as_json:
        doc = {"versions": {k: v.raw for k, v in found.items()}, "patches": rows, "errors": errors, "notes": notes}
        print(json.dumps(doc, indent=2))
    else:
        _report(rows, notes, errors, found, verbose)
    return 1 if bad or errors else 0


HELP = f"""\
exit codes:
  0  every patch in range applied, or skipped for the reason shown (the last line says whether
     anything is patched at all: on a pair the library does not cover, nothing is, and it exits 0)
  1  a patch in range failed, conflicts or is still pending, or a switch names something unknown
  2  vLLM is not installed
  3  the NPU runtime (torch_npu) is not installed and --cpu was not given
  With --json stdout carries one JSON document whatever happened ("error" and "exit" on 2 and 3).

switches (environment variables, read by every process vLLM starts and by check):
  {_registry.ENV_ENABLE}=0                    nothing is patched
  {_registry.ENV_SKIP}=NAME,...        skip these patches or groups (names: --verbose)
  {_registry.ENV_STRICT}=1             a failure in range aborts vLLM's start-up
  ASCEND_LAYERWISE_PATCH_SEND_BACKLOG=0.25      send_shedding's block bound (off: none)
  ASCEND_LAYERWISE_PATCH_SEND_BACKLOG_STEPS=3   send_shedding's step bound (off: none)
  ASCEND_LAYERWISE_PATCH_MAMBA_HOLD_ATTENTION=0 mamba_lifetime holds mamba blocks only
  ASCEND_LAYERWISE_PATCH_POOL_MODEL_ID=NAME     pool_key_layout: the checkpoint's name in keys
  ASCEND_LAYERWISE_PATCH_GVA_CACHE_MAX=N        pool_key_layout: keys remembered as saved
  ASCEND_LAYERWISE_PATCH_LOAD_AGREE_S=S         load_failures_agreement: bound of the TP ranks' wait
  ASCEND_LAYERWISE_PATCH_LATE_COPY_S=S          the late-copy fence: how long it waits
  ASCEND_LAYERWISE_PATCH_ALLOC_LEASE_S=S        pool_alloc_lease: a save's longest MemCache lease
See the README's "Switches" table.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ascend-layerwise-patch",
        description="Import-time patches for vLLM + vllm-ascend's layerwise KV pool.",
        epilog="run `ascend-layerwise-patch check --help` for exit codes and switches",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_check = sub.add_parser(
        "check",
        help="import the targets, apply the patches, print what happened",
        description="Import vLLM's and vllm-ascend's targets, apply the patches and print one line per\n"
        "group (state, reason), the counts and what to do next.",
        epilog=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p_check.add_argument("--cpu", action="store_true", help="stand in for the NPU runtime first (CPU build box)")
    p_check.add_argument("--json", action="store_true", help="print every patch and place as one JSON document")
    p_check.add_argument("--verbose", "-v", action="store_true", help="every patch: versions, what it changes, each place")
    args = parser.parse_args(argv)
    return check(cpu=args.cpu, as_json=args.json, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
