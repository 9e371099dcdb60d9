"""Shared test helpers for the version matrix (import as ``from support import ...``).

Suites (each runs in its own pytest process, see scripts/matrix.sh):
  tests/unit      the registry on throwaway targets; no vLLM needed (runs once, in the base venv)
  tests/standins  the real vLLM + vllm-ascend of one pair, NPU runtime stood in for (cpu_standins)
  tests/interp    Triton kernels under TRITON_INTERPRET=1 with the real vLLM callers; no stand-ins

``@pytest.mark.pairs("v0251", ...)`` limits a test to the named pairs of scripts/pairs.txt; the
pair is derived from the installed vllm / vllm-ascend versions, never from a flag. A scenario that
runs on several release lines is one test, parametrized by line: :func:`on` makes each line's
parameter set, with its pairs mark.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def current_pair() -> str | None:
    """Name of the scripts/pairs.txt row matching what is installed, or None."""
    installed = (_version("vllm"), _version("vllm-ascend") or "-")
    for line in (ROOT / "scripts" / "pairs.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, vllm, ascend = line.split()[:3]
        if (vllm, ascend) == installed:
            return name
    return None


PAIR = current_pair()


#: ``ASCEND_LAYERWISE_PATCH`` values that turn the library off (registry/switches.py; not imported:
#: importing the package activates it)
OFF_VALUES = {"0", "false", "no", "off"}


def _child_env(env: dict[str, str] | None) -> dict[str, str]:
    """The child's environment: this one without the library's switches and ``VLLM_PLUGINS`` (each
    test sets its own), except the whole-library off switch: a suite run with
    ``ASCEND_LAYERWISE_PATCH=0`` (scripts/library_off.py) runs its children without the library too."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND_LAYERWISE_PATCH", "VLLM_PLUGINS"))}
    if os.environ.get("ASCEND_LAYERWISE_PATCH", "").strip().lower() in OFF_VALUES:
        child_env["ASCEND_LAYERWISE_PATCH"] = os.environ["ASCEND_LAYERWISE_PATCH"]
    child_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), child_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    child_env.update(env or {})
    return child_env


def run_python(code: str, *, env: dict[str, str] | None = None, check: bool = True, timeout: int = 300):
    """Run ``code`` in a fresh interpreter of this venv; returns the CompletedProcess.

    The child starts with this repository first on ``sys.path`` and with ``VLLM_PLUGINS`` unset
    unless ``env`` sets it. ``check`` asserts a zero exit code and shows the child's output if not.
    """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=_child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check:
        assert proc.returncode == 0, f"child exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def console_script() -> Path:
    """This venv's ``ascend-layerwise-patch`` -- the command the README gives (scripts/env.sh
    installs the package into every venv of the matrix)."""
    path = Path(sys.executable).parent / "ascend-layerwise-patch"
    assert path.exists(), f"{path} is missing: this package is not installed in {sys.prefix} (scripts/env.sh installs it)"
    return path


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: int = 300):
    """Run the console script with ``args`` (this repository first on the path); never checks."""
    return subprocess.run(
        [str(console_script()), *args], cwd=ROOT, env=_child_env(env), capture_output=True, text=True, timeout=timeout
    )


def doc_files() -> list[Path]:
    """README.md, then docs/*.md in name order: the operator's page and the pages it links, whose
    text the documentation tests read (a section, a block or a generated table may sit in any)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def doc_text(*names: str) -> str:
    """The text of the named files (paths from the repository root: ``README.md``,
    ``docs/metrics.md``), or, with no names, of every file of :func:`doc_files`, one after the other."""
    paths = [ROOT / name for name in names] if names else doc_files()
    return "\n\n".join(path.read_text() for path in paths)


def expected_states():
    """scripts/expected_states.py, loaded by path (the table's reader and the renderer of
    docs/patches.md's two generated tables)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("expected_states", ROOT / "scripts" / "expected_states.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ a group off, then back as configured
def activate_skipping(*groups: str):
    """Re-activates the library with ``groups`` skipped (none: as this process's environment says --
    every group on, or nothing under ``ASCEND_LAYERWISE_PATCH=0``); returns the registry.

    A defect test runs its scenario with its group skipped (the defect must show) and then as
    configured (it must not): under ``ASCEND_LAYERWISE_PATCH=0`` the second run fails on the defect
    itself. Whether the group applies is asserted by its own test (:func:`group_states`)."""
    import ascend_layerwise_patch

    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    skip = ",".join(filter(None, [os.environ.get("ASCEND_LAYERWISE_PATCH_SKIP"), *groups]))
    reg.activate(environ={**os.environ, "ASCEND_LAYERWISE_PATCH_SKIP": skip} if groups else None)
    return reg


@contextlib.contextmanager
def library_off():
    """The whole library off (``ASCEND_LAYERWISE_PATCH=0``, re-activated) for the block; afterwards the
    environment as it was and the library re-activated as it says (under a library-off run of the
    suite: still off)."""
    prev = os.environ.get("ASCEND_LAYERWISE_PATCH")
    os.environ["ASCEND_LAYERWISE_PATCH"] = "0"
    activate_skipping()
    try:
        yield
    finally:
        if prev is None:
            os.environ.pop("ASCEND_LAYERWISE_PATCH", None)
        else:
            os.environ["ASCEND_LAYERWISE_PATCH"] = prev
        activate_skipping()


def group_states(group: str) -> set[str]:
    import ascend_layerwise_patch

    return {st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.group == group}


# ------------------------------------------------------------------ one scenario, per release line
def on(release, *values, pairs=None, name: str = "", control: str = ""):
    """One parameter set of a scenario run on every release line it applies to: ``release`` (a
    release line: its ``name`` and ``pairs``) and ``values``, on ``pairs`` (default: the release's);
    ``control``: why it passes with the library off too (``@pytest.mark.control``). Its id is the
    release's name, then ``name``."""
    marks = [pytest.mark.pairs(*(pairs or release.pairs))] + ([pytest.mark.control(control)] if control else [])
    return pytest.param(release, *values, marks=marks, id="-".join(filter(None, (release.name, name))))
