"""The README tells the truth (issue 13, points 7, 8, 12): the switches it names are the ones the
code reads, it says where things were verified, and its install commands work offline. It stays
short (the rest is in docs/*.md, each page linked from it), and every link of the README and of
docs/*.md leads to a file, and a heading, that exists. No vLLM needed."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import venv

from support import ROOT, doc_files, doc_text

README = (ROOT / "README.md").read_text()
PREFIX = "ASCEND_LAYERWISE_PATCH"
#: the README is the operator's page; everything longer goes to docs/
MAX_README_LINES = 250


def variables_the_code_reads() -> set[str]:
    """Every string constant in the package that is exactly an ``ASCEND_LAYERWISE_PATCH*`` name
    (how a variable is read: ``os.environ.get(NAME)``); docstrings that mention one do not count."""
    names = set()
    for path in (ROOT / "ascend_layerwise_patch").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(PREFIX + r"[A-Z0-9_]*", node.value):
                names.add(node.value)
    return names


def test_every_variable_the_readme_names_is_read_by_the_code_and_back():
    in_readme = set(re.findall(PREFIX + r"[A-Z0-9_]*", README)) - {PREFIX + "_"}
    in_code = variables_the_code_reads()
    assert {PREFIX, PREFIX + "_SKIP", PREFIX + "_STRICT"} <= in_code
    assert in_readme == in_code
    in_docs = set(re.findall(PREFIX + r"[A-Z0-9_]*", doc_text())) - {PREFIX + "_"}
    assert in_docs <= in_code, "docs/ names a switch the code does not read"


def test_readme_says_what_ran_where():
    section = README.split("## Hardware status", 1)[1].split("\n## ", 1)[0]
    assert "Nothing has\nrun on Ascend NPU hardware yet" in section or "Nothing has run on Ascend NPU hardware yet" in section
    assert "NVIDIA H200" in section and "CPU" in section


def test_readme_install_commands_work_offline(tmp_path):
    """Point 12: the README's wheel build, then `pip install --no-index` into a bare venv, whose
    console script then runs (and, with no vLLM there, exits 2 with a JSON document)."""
    assert not re.search(r"^\s*pip install ascend-layerwise-patch\s*(#|$)", README, re.M), "that package is on no index"
    assert "\npip wheel --no-deps -w dist .  " in README and "\n   pip wheel --no-deps -w wheels .\n" in README
    assert "pip install --no-index --find-links wheels/ ascend-layerwise-patch" in README
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(ROOT)],
        check=True, capture_output=True,
    )
    wheels = [p.name for p in dist.iterdir()]
    assert wheels == ["ascend_layerwise_patch-0.1.0-py3-none-any.whl"]
    env_dir = tmp_path / "node"
    venv.create(env_dir, with_pip=True)
    bare = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # only what the node has
    subprocess.run(
        [env_dir / "bin" / "python", "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links", str(dist), "ascend-layerwise-patch"],
        check=True, capture_output=True, env=bare, cwd=tmp_path,
    )
    script = env_dir / "bin" / "ascend-layerwise-patch"
    proc = subprocess.run([script, "check", "--json"], capture_output=True, text=True, cwd=tmp_path, env=bare)
    assert proc.returncode == 2 and json.loads(proc.stdout)["error"] == "vLLM is not installed; nothing to check"


# ------------------------------------------------------------------ short, and linked to docs/
def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _no_code(text: str) -> str:
    """``text`` without its code blocks (a ``#`` there is no heading, a ``[i](j)`` no link)."""
    return re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.M | re.S)


def _anchors(text: str) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", _no_code(text), re.M)}


def links(text: str) -> list[str]:
    """The targets of the markdown links and images of ``text`` (not web addresses, nor code)."""
    prose = re.sub(r"`[^`\n]*`", "", _no_code(text))
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", prose) if not re.match(r"[a-z]+:", t)]


def test_the_readme_is_short_and_links_every_docs_page():
    lines = README.count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}: move the detail to docs/)"
    linked = {target.split("#")[0] for target in links(README)}
    pages = {str(path.relative_to(ROOT)) for path in doc_files()[1:]}
    assert pages and pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_every_link_of_the_docs_leads_somewhere():
    broken = []
    for path in doc_files():
        for target in links(path.read_text()):
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_the_link_check_reads_links_and_headings_as_github_does():
    assert links("[a](docs/x.md#y) ![p](docs/p.png) [w](https://x.org/a) `x[0](1)`") == ["docs/x.md#y", "docs/p.png"]
    assert _slug("Load failures: use `kv_load_failure_policy: recompute`") == "load-failures-use-kv_load_failure_policy-recompute"
    assert _anchors("## Serve\n```sh\n# not a heading\n```\n") == {"serve"}
