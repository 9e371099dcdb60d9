"""The index (patches/__init__.py's docstring) has one line per group, naming the package that
declares the group's patches, in the order SPECS applies them; each package stays on its own."""

from __future__ import annotations

import ast
import pathlib

from support import expected_states

import ascend_layerwise_patch.patches as patches

PATCHES = pathlib.Path(patches.__file__).parent
#: modules every package may import: the shared helpers, the neutral event counters, the host
SHARED = {"_checks", "_failed_load", "_ranges", "_targets"}
NEUTRAL = {"host", "pool_events", "kernels", "kernels.postprocess", "kernels.postprocess_launch"}


def _index() -> list[tuple[str, str, str]]:
    """(group, package, what it fixes) per line of the index (scripts/expected_states.py reads it
    from the source for docs/patches.md)."""
    rows = expected_states().groups()
    assert rows and patches.__doc__.count("\n") > len(rows)  # the module's docstring, not an empty parse
    return rows


def _package_of(spec) -> str:
    return spec.factory.__module__.split("ascend_layerwise_patch.patches.", 1)[1].split(".")[0]


def test_one_line_per_group_in_apply_order():
    groups = list(dict.fromkeys(spec.group for spec in patches.SPECS))
    assert [group for group, _package, _what in _index()] == groups


def test_each_line_names_the_package_of_its_patches_and_what_it_fixes():
    for group, package, what in _index():
        declared = {_package_of(spec) for spec in patches.SPECS if spec.group == group}
        assert declared == {package}, (group, package, declared)
        assert what, group


def test_every_package_has_its_text():
    packages = {package for _group, package, _what in _index()}
    assert packages == {p.name for p in PATCHES.iterdir() if (p / "__init__.py").is_file()}
    for package in packages:
        doc = ast.get_docstring(ast.parse((PATCHES / package / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) > 3, package


def _imports(path: pathlib.Path, package: str) -> set[str]:
    """What ``path`` (in ``patches/<package>/``) imports of this library, relative to the library root."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if (node.module or "").startswith("ascend_layerwise_patch"):
                    found.add(node.module.removeprefix("ascend_layerwise_patch").lstrip(".") or "<root>")
                continue
            base = ["patches", package][: 3 - node.level] if node.level <= 2 else []
            parts = [*base, *(node.module.split(".") if node.module else [])]
            names = [a.name for a in node.names] if not node.module else []
            for name in names or [""]:
                found.add(".".join(p for p in [*parts, name] if p))
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("ascend_layerwise_patch.") for a in node.names if a.name.startswith("ascend_layerwise_patch")}
    return found


def test_no_package_imports_another_package_or_the_registry():
    for init in sorted(PATCHES.glob("*/__init__.py")):
        package = init.parent.name
        for path in sorted(init.parent.rglob("*.py")):
            for imported in _imports(path, package):
                if imported.startswith("patches."):
                    head = imported.split(".")[1]
                    assert head in SHARED or head == package, (path.relative_to(PATCHES), imported)
                else:
                    assert imported in NEUTRAL or imported.split(".")[0] in NEUTRAL, (path.relative_to(PATCHES), imported)


def test_the_import_check_sees_a_forbidden_import(tmp_path):
    (tmp_path / "x.py").write_text("from ...registry import MARKER\nfrom ..gdn_tp_keys import make_key\nfrom . import own\n")
    assert _imports(tmp_path / "x.py", "pkg") == {"registry", "patches.gdn_tp_keys", "patches.pkg.own"}
