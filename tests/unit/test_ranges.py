"""The version ranges of the groups that cover vLLM 0.25 / 0.26 (a version check never decides alone:
each group also checks its target's shape, see tests/standins)."""

from __future__ import annotations

import pytest

from ascend_layerwise_patch import versions
from ascend_layerwise_patch.patches import connector_guards, gdn_layerwise, mamba_lifetime, postprocess_kernel

SPECS = (
    *connector_guards.SPECS,
    *gdn_layerwise.SPECS,
    *(s for s in mamba_lifetime.SPECS if not s.name.endswith("_030")),  # its 0.30 members: below
    *postprocess_kernel.SPECS,
)


@pytest.mark.parametrize(
    "vllm,ascend,admitted",
    [
        ("0.25.0", "0.25.1rc1", True),
        ("0.25.1", "0.25.1rc1", True),
        ("0.26.0", "0.26.0rc1", True),
        ("0.26.0.dev7+g1234abc", "0.26.0rc1", True),
        ("0.24.0", "0.24.0rc1", False),
        ("0.25.1", "0.24.0rc1", False),
        ("0.27.0", "0.26.0rc1", False),
        ("0.27.1", "0.27.1rc1", False),
        ("0.27.0.dev3+gabc", "0.27.0rc1", False),
    ],
)
def test_ranges(vllm, ascend, admitted):
    for spec in SPECS:
        ok_vllm, _ = versions.in_range(versions.Installed("vllm", vllm), spec.requires["vllm"])
        ok_ascend, _ = versions.in_range(versions.Installed("vllm-ascend", ascend), spec.requires["vllm_ascend"])
        assert (ok_vllm and ok_ascend) is admitted, (spec.name, spec.requires)


# issue 25: vllm-ascend 0.30.0rc2 (on vLLM 0.30.0 / 0.29.0) is admitted by the groups that still have work
# or a detector there; the release candidates in between are refused by every group, never installed
from ascend_layerwise_patch.patches import SPECS as ALL_SPECS  # noqa: E402
from ascend_layerwise_patch.patches import mamba_local_hit
from ascend_layerwise_patch.patches import pool_hit_boundary, pool_key_tp, pool_load_recovery, pool_save_failures  # noqa: E402
from ascend_layerwise_patch.patches.gdn_layerwise import mamba_precopy  # noqa: E402
from ascend_layerwise_patch.patches.pool_metrics import v030 as pool_metrics_030  # noqa: E402

ON_030 = {
    s.name
    for m in (connector_guards, gdn_layerwise, mamba_precopy, postprocess_kernel, mamba_local_hit, pool_hit_boundary, pool_key_tp,
              pool_load_recovery, pool_metrics_030)
    for s in m.SPECS
} | {"gdn_tp_keys_030", "mamba_pool_hit_030"}  # vouched members: they read 0.30's own fix of their group's defect
ON_030 |= {"pool_layout_keys_030", "pool_gva_cache_030", "send_stuck_030", "async_free_fence_030"}  # 0.30 members of a 0.25 / 0.26 group (its fix, ported)
ON_030 |= {"mamba_lifetime_030", "mamba_pool_resume_load_030", "mtp_layer_030", "gdn_tp_step_end_030"}  # vouched, as above
ON_030 |= {"pool_hit_written", "pool_hit_written_exists"}  # MemCache 1.2.x hits on keys being written (every pair)
ON_030 |= {s.name for s in pool_save_failures.SPECS}  # 0.26 and 0.30: a failed save stops the engine
ON_030 |= {"pool_alloc_lease"}  # 0.30 only: its saves ask a 5-minute allocation lease
ON_030 |= {"mtp_decode_saves_030"}  # 0.30 member of a 0.25 / 0.26 group (its fix, ported)
ON_030 |= {"mtp_step_end_030", "mtp_load_before_draft_030", "mtp_load_waited_030"}  # 0.30 members of a 0.25 / 0.26 group
#: vLLM 0.30 only: vLLM 0.29's scheduler cannot take a hybrid load-failure report (one group unpacked)
ONLY_VLLM_030 = {s.name for s in pool_load_recovery.SPECS}


def _admitted(spec, vllm, ascend):
    ok_vllm, why_vllm = versions.in_range(versions.Installed("vllm", vllm), spec.requires["vllm"])
    ok_ascend, why_ascend = versions.in_range(versions.Installed("vllm-ascend", ascend), spec.requires["vllm_ascend"])
    return ok_vllm and ok_ascend, why_vllm or why_ascend


def _past_newest() -> list[tuple[str, str]]:
    """The releases just past the newest pair of scripts/pairs.txt (vLLM's next minor with the newest
    vllm-ascend, and the reverse): unknown, refused until a pair is declared for them."""
    from packaging.version import Version
    from support import expected_states

    vllm, ascend = (max(column, key=Version) for column in zip(*expected_states().pair_versions().values()))
    after = [Version(v).release[:2] for v in (vllm, ascend)]
    return [(f"{after[0][0]}.{after[0][1] + 1}.0", ascend), (vllm, f"{after[1][0]}.{after[1][1] + 1}.0rc1")]


@pytest.mark.parametrize(
    "vllm,ascend",
    [("0.27.1", "0.27.1rc1"), ("0.28.0", "0.28.0rc1"), ("0.29.0", "0.29.0rc1"), ("0.28.0", "0.27.1rc1"),
     ("0.30.0", "0.29.0rc1"), ("0.27.0", "0.30.0rc2"), ("0.28.0", "0.30.0rc2"), *_past_newest()],
)
def test_vllm_ascend_027_to_029_and_unknown_pairs_are_refused_with_a_reason(vllm, ascend):
    for spec in ALL_SPECS:
        ok, why = _admitted(spec, vllm, ascend)
        assert not ok, (spec.name, vllm, ascend)
        assert why.startswith(("vllm ", "vllm-ascend ")) and "is outside" in why, why


@pytest.mark.parametrize("vllm", ["0.30.0", "0.29.0", "0.30.1.dev3+gabc"])
def test_vllm_ascend_030_is_admitted_by_the_groups_declared_for_it(vllm):
    admitted = {s.name for s in ALL_SPECS if _admitted(s, vllm, "0.30.0rc2")[0]}
    expected = ON_030 - ONLY_VLLM_030 if vllm.startswith("0.29") else ON_030
    assert admitted == expected, admitted ^ expected


# issue 35: every group is declared once (_checks.Group) with a range named once (_ranges)
from ascend_layerwise_patch.patches import _ranges  # noqa: E402
from ascend_layerwise_patch.patches._checks import Group, expects  # noqa: E402


def test_every_spec_requires_a_named_range():
    named = set(_ranges.ALL.values())
    for spec in ALL_SPECS:
        assert _ranges.Ranges(spec.requires["vllm"], spec.requires["vllm_ascend"]) in named, spec.name


def test_a_group_declares_its_specs():
    group = Group("g", _ranges.V025, risk="r", why="w")
    a = group.spec("a", "m:f", print, precondition=expects(["x"]))
    b = group.spec("b", "m:f", print, ranges=_ranges.V030, why="own", precondition=len)
    assert group == "g" and type(a.group) is str and a.group == "g"
    assert a.requires == {"vllm": _ranges.V025.vllm, "vllm_ascend": _ranges.V025.vllm_ascend} and (a.risk, a.why) == ("r", "w")
    assert a.expects == expects(["x"]) and a.precondition is None
    assert b.requires == dict(zip(("vllm", "vllm_ascend"), _ranges.V030)) and b.why == "own" and b.precondition is len


def _range_literals(text: str) -> list[str]:
    """String constants of ``text`` that are version ranges (docstrings and comments are text)."""
    import ast
    import re

    return [
        node.value
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"\s*(==|!=|>=|<=|<|>|~=)\s*\d[\w.*]*(\s*,.*)?", node.value)
    ]


def test_ranges_are_typed_only_in_ranges():
    import pathlib

    root = pathlib.Path(_ranges.__file__).parent
    typed = {str(p.relative_to(root)): _range_literals(p.read_text()) for p in root.rglob("*.py") if p.name != "_ranges.py"}
    assert {path: found for path, found in typed.items() if found} == {}
    assert _range_literals('VLLM = ">=0.25.0,<0.27"\nX = "0.25"\n') == [">=0.25.0,<0.27"]  # the scan sees one
