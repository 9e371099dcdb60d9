"""Issue 36: every shell block of the README and of docs/*.md is copy-pasteable as it stands, and
tested here.

A block is a ```sh fence right after a marker comment:

  <!-- cpu-test: run -->            run as it stands (bash -euo pipefail) in a scratch folder, with
                                    this venv's python, pip and ascend-layerwise-patch first on PATH
                                    (this checkout on PYTHONPATH); must exit 0
  <!-- cpu-test: run exit=check --> the same, but it must exit with the code `ascend-layerwise-patch
                                    check` alone gives here (2 in the unit venv: no vLLM) -- a block
                                    that loses check's code, or crashes on its refusal, fails
  <!-- cpu-test: dry CMD ... -->    run the same way with each CMD stood in by a stub that records
                                    its arguments, which CHECKS below then judge: `bash SCRIPT` names
                                    a script that exists and passes `bash -n`; `pip ...` parses with
                                    pip's own option parser (a download also: once per supported
                                    interpreter and platform the block lists, with exactly this
                                    package's dependencies); `python -c CODE` compiles; `vllm` is
                                    `vllm serve` (tests/standins/test_readme_serve.py parses the line
                                    with vLLM's parser on every pair)

Every block passes `bash -n` first, and every ```sh block carries a marker. The last tests feed
broken blocks -- old ones of the README's among them -- to the same runner and see each fail.
"""

from __future__ import annotations

import configparser
import itertools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from support import ROOT, doc_files

#: README.md and docs/*.md by path from the root, and their text
TEXTS = {str(path.relative_to(ROOT)): path.read_text() for path in doc_files()}
FENCE = re.compile(r"^([ \t]*)<!-- cpu-test: (run|dry)((?: [\w=-]+)*) -->\n\1```sh\n(.*?)\n\1```$", re.M | re.S)
BIN = Path(sys.executable).parent


class Block(NamedTuple):
    kind: str  # run or dry
    args: tuple[str, ...]  # run: ("exit=check",) or (); dry: the stubbed commands
    code: str
    line: int
    file: str = "README.md"


def blocks(text: str, file: str = "README.md") -> list[Block]:
    out = []
    for m in FENCE.finditer(text):
        indent = m.group(1)
        code = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in m.group(4).splitlines())
        out.append(Block(m.group(2), tuple(m.group(3).split()), code, text[: m.start()].count("\n") + 1, file))
    return out


def all_blocks() -> list[Block]:
    """Every marked block of README.md and docs/*.md, file by file."""
    return [block for file, text in TEXTS.items() for block in blocks(text, file)]


def supported(code: str) -> dict[str, list[str]]:
    """``NAME=value  # supported: a b c`` lines: the values the block says it takes."""
    return {name: values.split() for name, values in re.findall(r"^(\w+)=\S+\s+# supported: (.+)$", code, re.M)}


def install_requires() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return [line.strip() for line in cfg["options"]["install_requires"].splitlines() if line.strip()]


def _same_requirements(got: list[str], want: list[str]) -> bool:
    from packaging.requirements import Requirement

    norm = lambda reqs: {Requirement(r).name: Requirement(r).specifier for r in reqs}  # noqa: E731
    return norm(got) == norm(want)  # SpecifierSet equality: ">=2" is ">=2.0"


def check_pip(argv: list[str]) -> str | None:
    from pip._internal.commands import commands_dict, create_command

    if len(argv) < 2 or argv[1] not in commands_dict:
        return f"not a pip command: {argv}"
    try:
        options, args = create_command(argv[1]).parse_args(argv[2:])
    except SystemExit:
        return f"pip's parser refuses {shlex.join(argv)}"
    if argv[1] == "download" and not _same_requirements(args, install_requires()):
        return f"pip download fetches {args}, but the package needs {install_requires()} (setup.cfg)"
    return None


def check_call(argv: list[str]) -> str | None:
    """What a dry run checks of one stubbed call."""
    if argv[0] == "bash":
        script = ROOT / argv[1] if len(argv) > 1 else None
        if script is None or not script.is_file():
            return f"bash runs {argv[1:]}, which is no script of this repository"
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        return f"bash -n {argv[1]}: {syntax.stderr.strip()}" if syntax.returncode else None
    if argv[0] == "pip":
        return check_pip(argv)
    if argv[0] == "python" and argv[1:2] == ["-c"]:
        try:
            compile(argv[2], "<python -c>", "exec")
        except SyntaxError as exc:
            return f"python -c does not compile: {exc}"
        return None
    if argv[0] == "vllm":
        return None if argv[1:2] == ["serve"] else f"vllm {argv[1:2]}: only `vllm serve` is expected"
    return None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND_LAYERWISE_PATCH", "VLLM_PLUGINS", "PIP_"))}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    return env


def check_exit_code() -> int:
    return subprocess.run(["ascend-layerwise-patch", "check"], capture_output=True, env=_env()).returncode


def execute(code: str, stubs: tuple[str, ...], cwd: Path) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    calls = cwd / ".calls"
    calls.write_text("")
    prelude = "".join(f'{cmd}() {{ printf "%q " {cmd} "$@" >> "{calls}"; echo >> "{calls}"; }}\n' for cmd in stubs)
    script = f"set -euo pipefail\n{prelude}{code}\nwait\n"
    proc = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, text=True, env=_env(), timeout=120)
    return proc, [shlex.split(line) for line in calls.read_text().splitlines() if line.strip()]


def problems(block: Block, cwd: Path) -> list[str]:
    """Everything wrong with one block (empty: it works as its page says)."""
    syntax = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
    if syntax.returncode:
        return [f"bash -n: {syntax.stderr.strip()}"]
    if block.kind == "run":
        want = check_exit_code() if "exit=check" in block.args else 0
        proc, _ = execute(block.code, (), cwd)
        found = [] if proc.returncode == want else [f"exit {proc.returncode}, expected {want}"]
        return found + [f"it crashed: {proc.stderr.strip()[-300:]}"] * ("Traceback" in proc.stderr)
    found = []
    variants = supported(block.code)
    runs = [dict(zip(variants, values)) for values in itertools.product(*variants.values())]
    downloads = 0
    for values in runs:
        code = block.code
        for name, value in values.items():
            code = re.sub(rf"^{name}=\S+", f"{name}={value}", code, flags=re.M)
        proc, calls = execute(code, block.args, cwd)
        if proc.returncode:
            found.append(f"exit {proc.returncode} with {values}: {proc.stderr.strip()[-300:]}")
        if not calls:
            found.append(f"none of {block.args} was called")
        found += [p for p in map(check_call, calls) if p]
        for argv in calls:
            if argv[:2] == ["pip", "download"]:
                downloads += 1
                wanted = [("--platform", values.get("PLATFORM")), ("--python-version", values.get("PY"))]
                found += [f"{shlex.join(argv)}: {opt} is not ${name}" for (opt, v), name in zip(wanted, ("PLATFORM", "PY"))
                          if v is None or f"{opt} {v}" not in shlex.join(argv)]
    if downloads and downloads != len(runs):
        found.append(f"{downloads} downloads for {len(runs)} supported interpreter / platform pairs")
    return found


def test_every_shell_block_is_marked():
    for file, text in TEXTS.items():
        fences = re.findall(r"^[ \t]*```sh$", text, re.M)
        assert len(fences) == len(blocks(text, file)), f"{file}: a ```sh block without its <!-- cpu-test: ... --> marker"
    assert len(all_blocks()) >= 8


@pytest.mark.parametrize("block", all_blocks(), ids=lambda b: f"{b.file}:line{b.line}-{b.kind}")
def test_readme_block(block, tmp_path):
    assert problems(block, tmp_path) == []


def test_the_offline_download_takes_each_supported_interpreter_and_platform():
    (recipe,) = [b for b in all_blocks() if "pip download" in b.code]
    assert supported(recipe.code) == {"PY": ["3.10", "3.11", "3.12"], "PLATFORM": ["manylinux2014_aarch64", "manylinux2014_x86_64"]}


# ------------------------------------------------------------------ the runner fails a broken block

OLD_ONE_LINER = """ascend-layerwise-patch check --json | python -c 'import json,sys; d=json.load(sys.stdin); print({p["name"]: p["state"] for p in d["patches"]})'"""
OLD_RECIPE = """pip wheel --no-deps -w wheels .
pip download -d wheels --only-binary=:all: --platform manylinux2014_aarch64 --python-version 3.11 'wrapt>=2,<3' 'packaging>=22'"""


@pytest.mark.parametrize(
    "block, says",
    [
        (Block("run", ("exit=check",), OLD_ONE_LINER, 0), "KeyError: 'patches'"),  # the README's old step 3 (docs/install.md's now)
        (Block("run", ("exit=check",), "set +o pipefail; " + OLD_ONE_LINER.replace("print({", 'print(d.get("error") or {'), 0), "exit 0, expected 2"),  # no pipefail: check's code lost
        (Block("run", (), "ascend-layerwise-patch chek", 0), "exit 2, expected 0"),
        (Block("dry", ("bash",), "bash scripts/chek.sh", 0), "no script of this repository"),
        (Block("dry", ("pip",), "pip install --no-indx --find-links wheels/ ascend-layerwise-patch", 0), "pip's parser refuses"),
        (Block("dry", ("pip",), OLD_RECIPE, 0), "--platform is not $PLATFORM"),  # the README's old recipe: hard-coded
        (Block("dry", ("pip",), "PY=3.11  # supported: 3.10 3.11\npip download --python-version 3.11 'wrapt>=2,<3' 'packaging>=22'", 0), "--python-version is not $PY"),
        (Block("dry", ("pip",), "PY=3.11  # supported: 3.11\nPLATFORM=x  # supported: x\npip download --platform \"$PLATFORM\" --python-version \"$PY\" 'wrapt>=2,<3'", 0), "but the package needs"),
        (Block("dry", ("python",), "python -c 'import json,sys; print(d[)'", 0), "does not compile"),
        (Block("dry", ("vllm",), "vllm serve /m --kv-transfer-config '{\"kv_role\": \"kv_both\"}", 0), "bash -n"),
    ],
)
def test_the_runner_fails_a_broken_block(block, says, tmp_path):
    found = problems(block, tmp_path)
    assert found and any(says in p for p in found), found
