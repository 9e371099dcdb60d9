"""The check command where vLLM is not installed (the base venv of the matrix)."""

import json
import re
import subprocess
import sys

import pytest

from support import ROOT, _version, run_cli


@pytest.mark.skipif(_version("vllm") is not None, reason="needs an environment without vLLM (the base venv)")
def test_check_exits_2_without_vllm():
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_layerwise_patch", "check"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "vLLM is not installed" in proc.stderr


@pytest.mark.skipif(_version("vllm") is not None, reason="needs an environment without vLLM (the base venv)")
@pytest.mark.parametrize("args", [["check", "--json"], ["check", "--cpu", "--json"]])
def test_check_json_without_vllm_still_prints_a_json_document(args):
    """Issue 13, point 4: every JSON consumer parses stdout, whatever happened (console script)."""
    proc = run_cli(*args)
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)
    assert doc["error"] == "vLLM is not installed; nothing to check"
    assert doc["versions"] == {"vllm": None, "vllm_ascend": _version("vllm-ascend")}


def test_import_registers_no_hook_until_vllm_imports():
    """Without vLLM in the process, the import leaves one deferred activation entry and nothing else."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, ascend_layerwise_patch as a; "
            "print(sum(type(f).__name__ == '_ActivateBeforeVLLM' for f in sys.meta_path), a.REGISTRY.active, "
            "'wrapt' in sys.modules, 'packaging' in sys.modules)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout.split() == ["1", "False", "False", "False"]


# ------------------------------------------------------------------ issue 36: what a terminal shows


def _rows(state_of):
    """check's records for every patch of the library, each in the (state, reason) ``state_of`` gives."""
    from ascend_layerwise_patch.patches import SPECS

    rows = []
    for spec in SPECS:
        state, reason = state_of(spec)
        place = {"place": spec.target, "role": "target", "state": state, "reason": reason}
        copy = {"place": "vllm_ascend.some.module:copy", "role": "copy", "state": state, "reason": ""}
        rows.append({"name": spec.name, "group": spec.group, "target": spec.target, "state": state, "reason": reason,
                     "ranges": dict(spec.requires), "places": [place, copy], "why": spec.why})
    return rows


def _report(rows, verbose=False, capsys=None):
    from ascend_layerwise_patch import cli
    from ascend_layerwise_patch.versions import Installed

    found = {"vllm": Installed("vllm", "0.24.0"), "vllm_ascend": Installed("vllm-ascend", "0.24.0rc1")}
    cli._report(rows, [], [], found, verbose)
    lines = capsys.readouterr().out.splitlines()
    counts = next(i for i, line in enumerate(lines) if re.match(r"\d+ patches in \d+ groups: ", line))
    return lines, lines[counts], " ".join(line.strip() for line in lines[counts + 1 :])  # the verdict may wrap


OUT = "version out of range: vllm 0.24.0 is outside >=0.25.0,<0.27"


@pytest.mark.parametrize("verbose", [False, True])
def test_check_fits_100_columns_one_line_per_group_and_says_nothing_is_patched(capsys, verbose):
    from ascend_layerwise_patch.patches import SPECS

    lines, counts, verdict = _report(_rows(lambda spec: ("skipped", OUT)), verbose, capsys)
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    groups = list(dict.fromkeys(s.group for s in SPECS))
    if not verbose:
        starts = [line.split()[0] for line in lines[1:] if line and not line.startswith(" ")][: len(groups)]
        assert starts == groups  # one line per group, in order (continuations indented)
    assert counts == f"{len(SPECS)} patches in {len(groups)} groups: 0 applied, 0 fixed upstream, {len(SPECS)} skipped, 0 failed"
    assert verdict == "nothing is patched on this pair: the library does not cover vLLM 0.24.0 + vllm-ascend 0.24.0rc1; see the version table in the README"


def test_check_counts_each_kind_and_names_a_failed_group(capsys):
    def state_of(spec):
        if spec.group == "connector_guards":
            return "failed", "target changed: helper parameters are ['x']"
        if spec.name == "postprocess_kernel":
            return "skipped", "already fixed upstream: the kernel takes vLLM's parameters"
        return ("applied", "") if spec.group != "pool_metrics" else ("skipped", OUT)

    rows = _rows(state_of)
    lines, counts, verdict = _report(rows, False, capsys)
    text = " ".join(line.strip() for line in lines)
    assert max(len(line) for line in lines) <= 100
    n_metrics = sum(r["group"] == "pool_metrics" for r in rows)
    assert counts.endswith(f": {len(rows) - n_metrics - 3} applied, 1 fixed upstream, {n_metrics} skipped, 2 failed")
    assert verdict.startswith("not ready: connector_guards failed or pending, left unpatched")
    kernel = next(line for line in lines if line.startswith("postprocess_kernel "))
    assert kernel.split()[1:3] == ["applied", "1/2"] and "postprocess_kernel (fixed upstream)" in text
    assert [line.split()[1] for line in lines if line.startswith("connector_guards ")] == ["failed"]
    assert "target changed: helper parameters" in text


def test_help_lists_exit_codes_and_every_switch_the_code_reads():
    from test_readme import variables_the_code_reads

    proc = subprocess.run([sys.executable, "-m", "ascend_layerwise_patch", "check", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    codes = lines[lines.index("exit codes:") + 1 :]
    assert [line.split()[0] for line in codes if line[:3].strip().isdigit()] == ["0", "1", "2", "3"]
    listed = {line.split("=")[0].strip() for line in lines if line.strip().startswith("ASCEND_LAYERWISE_PATCH")}
    assert listed == variables_the_code_reads()
    assert max(len(line) for line in lines) <= 100


@pytest.mark.parametrize(
    "state_of, verdict_starts, group_state",
    [
        (lambda spec: ("skipped", "disabled by ASCEND_LAYERWISE_PATCH=0"), "nothing is patched: disabled by ASCEND_LAYERWISE_PATCH=0", "switched off"),
        (lambda spec: ("skipped", "already fixed upstream: x") if spec.group == "connector_guards" else ("skipped", OUT),
         "nothing is patched on this pair (vLLM 0.24.0 + vllm-ascend 0.24.0rc1): each group is fixed upstream", "fixed upstream"),
        (lambda spec: ("pending", "waiting for x to be imported") if spec.group == "connector_guards" else ("applied", ""),
         "not ready: connector_guards failed or pending", "pending"),
        (lambda spec: ("skipped", "skipped by ASCEND_LAYERWISE_PATCH_SKIP") if spec.group == "connector_guards" else ("applied", ""),
         "ok: every patch that this pair needs is in force; serve as usual; switched off: connector_guards", "switched off"),
    ],
)
def test_the_last_line_says_what_to_do(capsys, state_of, verdict_starts, group_state):
    lines, _counts, verdict = _report(_rows(state_of), False, capsys)
    assert verdict.startswith(verdict_starts), verdict
    assert [line.split()[1:3] for line in lines if line.startswith("connector_guards ")][0][: len(group_state.split())] == group_state.split()
