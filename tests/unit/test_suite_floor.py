"""Issue 36: the matrix fails a suite that ran fewer tests than the pair should run
(scripts/suite_floor.py, called by scripts/suite_run.sh's ``run``, which scripts/matrix.sh sources).
The floors come from the real scripts/expected_states.txt; the pytest runs are fake summaries."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

from support import ROOT

spec = importlib.util.spec_from_file_location("suite_floor", ROOT / "scripts" / "suite_floor.py")
suite_floor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_floor)


@pytest.mark.parametrize(
    "suite, pair, log, ok, says",
    [
        ("interp", "v0300", "sss\n23 skipped in 3.10s\n", True, "ran 0 tests (23 skipped); at least 0: postprocess_kernel is fixed upstream"),
        ("interp", "v0251", "sss\n23 skipped in 3.10s\n", False, "FAILED: ran 0 tests (23 skipped), at least 1 expected: postprocess_kernel is applied on v0251"),
        ("interp", "v0251", "===== 20 passed, 3 skipped, 1 warning in 30.2s =====\n", True, "ran 20 tests"),
        ("standins", "v0240", "\nno tests ran in 0.01s\n", False, "FAILED: ran 0 tests (nothing), at least 1 expected"),
        ("standins", "v0300", "5 deselected in 0.2s\n", False, "FAILED: ran 0 tests (5 deselected)"),
        ("unit", "-", "1 failed, 88 passed in 15.7s\n", True, "ran 89 tests"),
        ("unit", "-", "Traceback (most recent call last):\nImportError: no module\n", False, "no pytest summary line"),
    ],
)
def test_a_suite_must_run_its_floor_of_tests(suite, pair, log, ok, says):
    got_ok, line = suite_floor.verdict(suite, pair, log)
    assert (got_ok, says in line) == (ok, True), line


def test_the_interp_floor_follows_the_table():
    """1 where the table marks the kernel applied, 0 elsewhere; a changed column changes the floor."""
    pairs, table = suite_floor.expected_states.load()
    floors = {pair: suite_floor.floor("interp", pair)[0] for pair in pairs}
    assert floors == {pair: int(table["postprocess_kernel"][pair] == "applied") for pair in pairs}
    assert floors["v0251"] == 1 and floors["v0300"] == 0
    changed = {**table, "postprocess_kernel": {**table["postprocess_kernel"], "v0300": "applied"}}
    assert suite_floor.floor("interp", "v0300", changed)[0] == 1


def test_matrix_runs_fail_a_suite_that_ran_nothing(tmp_path):
    """scripts/suite_run.sh's ``run`` as matrix.sh uses it, with a stand-in for the pair's python
    that prints pytest's summary of a run where every test skipped, and exits 0."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '.ss'\necho '23 skipped in 3.01s'\nexit 0\n")
    fake.chmod(0o755)
    script = (
        f'logs={tmp_path}; failed=(); failed_tests=(); . scripts/suite_run.sh; '
        f'run "v0300 interp" interp v0300 {fake} tests/interp; run "v0251 interp" interp v0251 {fake} tests/interp; '
        'printf "FAILED: %s\\n" "${failed[@]}"'
    )
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHON": "python3"})
    lines = proc.stdout.splitlines()
    assert "=== v0251 interp: FAILED: ran 0 tests (23 skipped), at least 1 expected: postprocess_kernel is applied on v0251 (scripts/expected_states.txt): its kernel must be tested" in lines, proc.stdout + proc.stderr
    assert [line for line in lines if line.startswith("FAILED: ")] == ["FAILED: v0251 interp (ran fewer tests than its floor)"]
    assert [line for line in lines if line.startswith("=== v0300 interp: exit 0 in ")], lines


def test_matrix_runs_name_each_failing_test(tmp_path):
    """A failing pytest run: ``run`` keeps each FAILED / ERROR line of pytest's short summary (node id
    and reason), which matrix.sh prints last, above its FAILED suites; vLLM's ERROR log lines are not tests."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\necho 'ERROR 12-07 12:56:05 [kv_transfer.py:678] [KVPOOL] batch_copy load(G2L) FAILED res=-3102'\necho '.F.E'\necho 'FAILED tests/standins/test_x.py::test_a[tp2] - AssertionError: 3 tokens differ'\n"
        "echo 'ERROR tests/standins/test_y.py::test_b - RuntimeError: agent gone'\necho '1 failed, 2 passed, 1 error in 3.01s'\nexit 1\n"
    )
    fake.chmod(0o755)
    script = (
        f'logs={tmp_path}; failed=(); failed_tests=(); . scripts/suite_run.sh; '
        f'run "v0251 standins" standins v0251 {fake} tests/standins; printf "T: %s\\n" "${{failed_tests[@]}}"'
    )
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHON": "python3"})
    assert [line for line in proc.stdout.splitlines() if line.startswith("T: ")] == [
        "T: v0251 standins: FAILED tests/standins/test_x.py::test_a[tp2] - AssertionError: 3 tokens differ",
        "T: v0251 standins: ERROR tests/standins/test_y.py::test_b - RuntimeError: agent gone",
    ], proc.stdout + proc.stderr
    matrix = (ROOT / "scripts" / "matrix.sh").read_text()
    assert "printf 'matrix: failing test: %s\\n' \"${failed_tests[@]}\"" in matrix
