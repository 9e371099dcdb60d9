"""The check command where vLLM is not installed (the base venv of the matrix)."""

import json
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
