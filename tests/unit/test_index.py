"""The index (patches/__init__.py's docstring) has one line per group, naming the modules that
declare the group's patches, in the order SPECS applies them."""

from __future__ import annotations

import ascend_layerwise_patch.patches as patches


def _index() -> list[tuple[str, list[str], str]]:
    lines = patches.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["group", "modules", "what"])
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        group, rest = line.split(None, 1)
        modules, _, what = rest.partition("   ")
        rows.append((group, [m.strip() for m in modules.split(",")], what.strip()))
    return rows


def test_one_line_per_group_in_apply_order():
    groups = list(dict.fromkeys(spec.group for spec in patches.SPECS))
    assert [group for group, _modules, _what in _index()] == groups


def test_each_line_names_the_modules_of_its_patches_and_what_it_fixes():
    for group, modules, what in _index():
        declared = {spec.factory.__module__.rpartition(".")[2] for spec in patches.SPECS if spec.group == group}
        assert set(modules) == declared, (group, modules, declared)
        assert what, group
