#!/usr/bin/env python3
"""Which tests pass with the whole library off? Exactly the declared controls, or this fails.

    python scripts/library_off.py v0300 [v0251 ...]   runs tests/standins of each pair's venv twice,
                                                     as configured and with ASCEND_LAYERWISE_PATCH=0
    python scripts/library_off.py v0251 --on ON.xml [--off OFF.xml]
                                                     one pair, reusing junit files of earlier runs (the
                                                     as-configured run; a partial library-off run: the
                                                     tests it lacks are run)

A defect test must fail without the library (on its defect assertion: wrong reads, wrong tokens, a
stop); a test that passes in both modes must say why, with ``@pytest.mark.control("why")``: a
control scenario (the defect's absence where it never was), or a test whose subject is not this
process's activation (a child interpreter with its own switches, a detector run on the original
code, the byte store itself). Prints, per pair, the tests that pass in both modes, those that fail
without the library, and any mismatch with the declared controls; exits 1 on a mismatch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cases(junit: Path):
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        yield f"{path}.py::{case.get('name')}", case


def _outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed | failed | skipped, from a junit xml file."""
    out = {}
    for test_id, case in _cases(junit):
        kinds = {child.tag for child in case}
        out[test_id] = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
    return out


def _evidence(junit: Path) -> dict[str, list[str]]:
    """test id -> what its failure says: the assertion's first line and the counts it printed of
    differing tokens / wrong reads (the tests print them before asserting)."""
    out = {}
    for test_id, case in _cases(junit):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is None:
            continue
        lines = [(failure.get("message") or "").splitlines()[0][:200]] if failure.get("message") else []
        printed = "\n".join(child.text or "" for child in case if child.tag == "system-out")
        lines += [line.strip()[:240] for line in printed.splitlines() if "differ" in line or "wrong" in line][:4]
        out[test_id] = lines
    return out


def _workers() -> list[str]:
    """pytest-xdist's arguments, as scripts/matrix.sh runs the standins suites (ALP_PYTEST_WORKERS)."""
    n = min(int(os.environ.get("ALP_PYTEST_WORKERS") or os.cpu_count() or 1), 4)
    return ["-n", str(n), "--dist", "loadfile"] if n > 1 else []


def _run(python: str, env: dict[str, str], junit: Path, targets=("tests/standins",)) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", *_workers(), f"--junitxml={junit}",
         "-o", "junit_logging=system-out", *targets],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


def _controls(python: str, env: dict[str, str]) -> set[str]:
    proc = subprocess.run(
        [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only", "-m", "control", "tests/standins"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


def check_pair(pair: str, root: Path, reuse_on: Path | None = None, reuse_off: Path | None = None) -> bool:
    python = str(root / pair / "bin" / "python")
    base = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_LAYERWISE_PATCH")}
    off_env = {**base, "ASCEND_LAYERWISE_PATCH": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        on_xml, off_xml = reuse_on or Path(tmp) / "on.xml", Path(tmp) / "off.xml"
        if reuse_on is None:
            _run(python, base, on_xml)
        on = _outcomes(on_xml)
        off, evidence = {}, {}
        if reuse_off is not None:
            off, evidence = _outcomes(reuse_off), _evidence(reuse_off)
        rest = sorted(t for t in on if t not in off)
        if rest:
            _run(python, off_env, off_xml, rest if off else ("tests/standins",))
            off, evidence = {**off, **_outcomes(off_xml)}, {**evidence, **_evidence(off_xml)}
    controls = _controls(python, base)
    both = {t for t, o in on.items() if o == "passed" and off.get(t) == "passed"}
    fail_off = sorted(t for t, o in on.items() if o == "passed" and off.get(t) == "failed")
    failing_on = sorted(t for t, o in on.items() if o == "failed")
    undeclared = sorted(both - controls)
    broken_controls = sorted(t for t in controls if on.get(t) == "passed" and off.get(t) != "passed")
    print(f"== {pair}: {len(on)} tests; as configured {sum(o == 'passed' for o in on.values())} passed, "
          f"{len(failing_on)} failed; library off: {len(fail_off)} of them fail, {len(both)} pass (controls: {len(controls)})")
    for t in fail_off:
        print(f"  fails without the library: {t}")
        for line in evidence.get(t, []):
            print(f"      {line}")
    for t in sorted(both):
        print(f"  passes in both modes{' (declared control)' if t in controls else ''}: {t}")
    for t in failing_on:
        print(f"  MISMATCH: fails as configured: {t}")
    for t in undeclared:
        print(f"  MISMATCH: passes without the library, not a declared control: {t}")
    for t in broken_controls:
        print(f"  MISMATCH: a declared control that fails without the library: {t}")
    return not (undeclared or broken_controls or failing_on)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    root = Path(os.environ.get("ALP_MATRIX_DIR", ROOT / ".matrix"))
    if "--on" in argv:
        i = argv.index("--on")
        reuse_on = Path(argv[i + 1])
        reuse_off = Path(argv[argv.index("--off") + 1]) if "--off" in argv else None
        pairs = [a for a in argv if not a.startswith("--") and not a.endswith(".xml")]
        if len(pairs) != 1:
            print("library_off: --on / --off take one pair")
            return 2
        return 0 if check_pair(pairs[0], root, reuse_on, reuse_off) else 1
    ok = [check_pair(pair, root) for pair in argv]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
