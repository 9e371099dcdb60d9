"""A dry run of adding a release pair (the list in patches/__init__.py's docstring): a fictitious pair
that behaves as the newest one is added to a copy of the repository the way the list says, and the
files that changed are counted. They must be the documented list, and the copy's groups -- their
packages untouched -- must admit the new pair wherever they admit the one it behaves as."""

from __future__ import annotations

import ast
import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version
from support import ROOT

import ascend_layerwise_patch.patches as patches

#: name, vLLM, vllm-ascend, the pair it behaves as
NEW = ("v0310", "0.31.0", "0.31.0rc1", "v0300")
IGNORED = shutil.ignore_patterns(".git", ".matrix", "__pycache__", "*.egg-info", ".pytest_cache", "build", "dist")


def documented() -> list[str]:
    """The files patches/__init__.py says a new release pair touches."""
    lines = patches.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("A new release pair touches"))
    first = lines.index("", start) + 1  # the indented block after the sentence's paragraph
    return [line.split()[0] for line in lines[first : lines.index("", first)]]


def _admits(ranges: SpecifierSet | str, version: str) -> bool:
    return SpecifierSet(str(ranges)).contains(Version(Version(version).base_version), prereleases=True)


def _widened(spec: str, version: str) -> str:
    """``spec`` with its upper bound raised past ``version``'s minor release."""
    major, minor = Version(version).release[:2]
    return re.sub(r"<\d+\.\d+(\.\d+)?", f"<{major}.{minor + 1}", spec)


def _pairs(root: Path) -> dict[str, tuple[str, str]]:
    rows = [line.split() for line in (root / "scripts" / "pairs.txt").read_text().splitlines()]
    return {row[0]: (row[1], row[2]) for row in rows if row and not row[0].startswith("#")}


def add_pair(root: Path, name: str, vllm: str, ascend: str, like: str) -> None:
    """What the list in patches/__init__.py says, done on the copy at ``root`` for a pair that
    behaves as ``like``."""
    old_vllm, old_ascend = _pairs(root)[like]
    with open(root / "scripts" / "pairs.txt", "a") as fh:
        fh.write(f"{name:<12}{vllm:<9}{ascend:<14}fictitious: as {like}\n")
    # the named ranges: each one that admits `like` is widened to admit the new pair (the literal once)
    ranges_py = root / "ascend_layerwise_patch" / "patches" / "_ranges.py"
    text = ranges_py.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Ranges":
            for arg, (old, new) in zip(node.args, ((old_vllm, vllm), (old_ascend, ascend))):
                if isinstance(arg, ast.Constant) and _admits(arg.value, old) and not _admits(arg.value, new):
                    text = text.replace(repr(arg.value).replace("'", '"'), f'"{_widened(arg.value, new)}"')
    ranges_py.write_text(text)
    # the expected-states column: as `like`'s
    table = root / "scripts" / "expected_states.txt"
    out, column = [], None
    for line in table.read_text().splitlines():
        cells = line.split()
        if cells and cells[0] == "patch":
            column = cells.index(like)
            line = f"{line}  {name:<8}"
        elif cells and column is not None and not line.startswith("#"):
            line = f"{line}  {cells[column]:<8}"
        out.append(line.rstrip())
    table.write_text("\n".join(out) + "\n")
    # the README: a row in the version table; docs/patches.md: the expected-states table rendered again
    readme = root / "README.md"
    lines = readme.read_text().splitlines(keepends=True)
    head = next(i for i, line in enumerate(lines) if line.startswith("| vLLM | vllm-ascend |"))
    last = next(i for i in range(head, len(lines)) if not lines[i].startswith("|")) - 1
    lines.insert(last + 1, f"| {vllm} | {ascend} | as {old_vllm} + {old_ascend} (fictitious) |\n")
    readme.write_text("".join(lines))
    subprocess.run([sys.executable, str(root / "scripts" / "expected_states.py"), "--readme"], check=True)
    # the extra follows SUPPORTED's vLLM range
    supported = _load_ranges(root)["SUPPORTED"][0]
    cfg = root / "setup.cfg"
    cfg.write_text(re.sub(r"(?m)^vllm = vllm.*$", f"vllm = vllm{supported}", cfg.read_text()))


def _load_ranges(root: Path) -> dict[str, list[str]]:
    code = "import json; from ascend_layerwise_patch.patches import _ranges; print(json.dumps(_ranges.ALL))"
    return json.loads(_python(root, code))


def _python(root: Path, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True, capture_output=True, text=True).stdout


def behind(root: Path, vllm: str, ascend: str, like: str) -> list[str]:
    """The patches of the copy at ``root`` (imported from it) that admit ``like`` but not the new pair:
    their groups' packages would have to change too."""
    old_vllm, old_ascend = _pairs(root)[like]
    code = (
        "import json; from ascend_layerwise_patch.patches import SPECS; "
        "print(json.dumps([[s.name, s.factory.__module__, s.requires['vllm'], s.requires['vllm_ascend']] for s in SPECS]))"
    )
    return [
        module
        for name, module, v, a in json.loads(_python(root, code))
        if _admits(v, old_vllm) and _admits(a, old_ascend) and not (_admits(v, vllm) and _admits(a, ascend))
    ]


def changed(before: Path, after: Path) -> list[str]:
    """The files that differ between the two trees (added ones included)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(after):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for filename in filenames:
            path = Path(dirpath, filename).relative_to(after)
            if not (before / path).is_file() or not filecmp.cmp(before / path, after / path, shallow=False):
                found.append(str(path))
    return sorted(found)


def test_adding_a_pair_touches_the_documented_files(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=IGNORED)
    shutil.copytree(ROOT, tmp_path / "before", ignore=IGNORED)
    add_pair(copy, *NEW)
    assert changed(tmp_path / "before", copy) == sorted(documented())
    assert behind(copy, *NEW[1:]) == []  # no group package has to change for a pair that behaves as v0300
    assert NEW[0] in (copy / "scripts" / "expected_states.txt").read_text()
    assert _admits(_load_ranges(copy)["SUPPORTED"][0], NEW[1]) and _admits(_load_ranges(copy)["V030"][1], NEW[2])
    # and the copy's own checks of the pairs, the ranges, the extra, the table and the docs pass
    # (the README's offline-install check builds a wheel: nothing a pair changes, left out for time)
    suite = [f"tests/unit/test_{name}.py" for name in ("extras", "expected_states", "readme", "ranges", "index")]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not install_commands", *suite],
        cwd=copy, env={**os.environ, "PYTHONPATH": str(copy)}, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:]


def test_the_list_is_the_six_files():
    assert documented() == [
        "scripts/pairs.txt",
        "ascend_layerwise_patch/patches/_ranges.py",
        "scripts/expected_states.txt",
        "README.md",
        "docs/patches.md",
        "setup.cfg",
    ]


def test_a_group_that_types_its_range_is_found_behind(tmp_path):
    # the dry run can fail: a group whose range is typed in its package (as before issue 35) does
    # not follow the named ranges, so its package would be one more file to change
    copy = tmp_path / "repo"
    shutil.copytree(ROOT, copy, ignore=IGNORED)
    package = copy / "ascend_layerwise_patch" / "patches" / "pool_key_tp" / "__init__.py"
    text = package.read_text()
    assert 'Group("pool_key_tp", V029_030)' in text
    package.write_text(text.replace('Group("pool_key_tp", V029_030)', 'Group("pool_key_tp", Ranges(">=0.29,<0.31", ">=0.30,<0.31"))')
                       .replace("from .._ranges import V029_030", "from .._ranges import Ranges, V029_030"))
    add_pair(copy, *NEW)
    assert behind(copy, *NEW[1:]) == ["ascend_layerwise_patch.patches.pool_key_tp"]
