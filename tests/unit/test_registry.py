"""The registry on throwaway target modules written into a temporary package.

Every test uses fresh module names (wrapt's post-import hooks cannot be removed), so tests do
not see each other's hooks. Nothing here needs vLLM.
"""

from __future__ import annotations

import importlib
import itertools
import sys
import textwrap
import threading

import pytest

from ascend_layerwise_patch import registry as reg
from ascend_layerwise_patch import versions
from ascend_layerwise_patch.registry import Expect, PatchError, PatchSpec, Registry as _Registry
from ascend_layerwise_patch.host import HOST

_counter = itertools.count()


def Registry(specs, **kw):
    """The registry as the package builds it (versions and logging from the vLLM host)."""
    return _Registry(specs, **{"host": HOST, **kw})


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """Write modules of a fresh package; returns (name, write(module, source))."""
    name = f"alp_fake_{next(_counter)}"
    root = tmp_path / name
    root.mkdir()
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(module: str, source: str) -> str:
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        return f"{name}.{module}"

    yield name, write
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


@pytest.fixture(autouse=True)
def _no_versions(monkeypatch):
    """Throwaway specs depend on no package; pin detection so it never reads real metadata."""
    monkeypatch.setattr(
        versions, "detect", lambda: {"vllm": versions.Installed("vllm", "0.25.1"), "vllm_ascend": versions.Installed("vllm-ascend", "0.25.1rc1")}
    )


TARGET = """
calls = []
def helper(x):
    calls.append(x)
    return x * 2

class Base:
    def method(self):
        return "base"

class Child(Base):
    pass
"""

COPIER = """
from {target} import helper
"""


def wrap_plus_one(original):
    def replacement(x):
        return original(x) + 1

    return replacement


def spec(module: str, name="p", group="g", qual="helper", factory=wrap_plus_one, vllm=None, **kw) -> PatchSpec:
    requires = {"vllm": vllm, "vllm_ascend": None}
    return PatchSpec(name=name, group=group, target=f"{module}:{qual}", factory=factory, why="test", requires=requires, **kw)


def states(r: Registry) -> dict[str, tuple[str, str]]:
    return {st.name: (st.state, st.reason) for st in r.status()}


def test_activate_then_import_applies_on_import(pkg):
    _, write = pkg
    target = write("t", TARGET)
    r = Registry([spec(target)])
    r.activate({})
    assert states(r)["p"][0] == reg.PENDING
    mod = importlib.import_module(target)
    assert states(r)["p"][0] == reg.APPLIED
    assert mod.helper(3) == 7
    assert mod.calls == [3]


def test_import_then_activate_patches_copies_already_made(pkg):
    _, write = pkg
    target = write("t", TARGET)
    copier = write("c", COPIER.format(target=target))
    importlib.import_module(target)
    c = importlib.import_module(copier)
    r = Registry([spec(target, aliases=(f"{copier}:helper",))])
    r.activate({})
    assert states(r)["p"] == (reg.APPLIED, "applied late (after the target was imported)")
    assert c.helper(1) == 3
    assert r.status()[0].aliases == [f"{copier}:helper"]


def test_alias_imported_after_activation_gets_the_replacement(pkg):
    _, write = pkg
    target = write("t", TARGET)
    copier = write("c", COPIER.format(target=target))
    r = Registry([spec(target, aliases=(f"{copier}:helper",))])
    r.activate({})
    c = importlib.import_module(copier)  # imports the target first: hook patches before the copy
    assert c.helper(1) == 3


def test_late_activation_refuses_unknown_copies(pkg):
    _, write = pkg
    target = write("t", TARGET)
    stray = write("stray", COPIER.format(target=target))
    mod = importlib.import_module(target)
    importlib.import_module(stray)
    r = Registry([spec(target)])
    r.activate({})
    state, reason = states(r)["p"]
    assert state == reg.FAILED
    assert f"{stray}.helper" in reason and "activate earlier" in reason
    assert mod.helper(1) == 2  # untouched


def test_activate_twice_never_double_wraps(pkg):
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    r = Registry([spec(target)])
    r.activate({})
    first = mod.helper
    r.activate({})
    assert mod.helper is first
    assert mod.helper(1) == 3


def test_second_engine_adopts_instead_of_wrapping(pkg):
    """Plugin + import, or two copies of the engine: identity, not a flag, decides."""
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    a, b = Registry([spec(target)]), Registry([spec(target)])
    a.activate({})
    ours = mod.helper
    b.activate({})
    assert mod.helper is ours and mod.helper(1) == 3
    assert states(b)["p"] == (reg.APPLIED, "already applied in this process")


def test_concurrent_activation_wraps_once(pkg):
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    r = Registry([spec(target)])
    barrier = threading.Barrier(8)

    def go():
        barrier.wait()
        r.activate({})

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mod.helper(1) == 3
    assert mod.helper.__wrapped__.__name__ == "helper" and not hasattr(mod.helper.__wrapped__, "__wrapped__")


def test_revert_restores_exactly_and_deletes_inherited(pkg):
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    original = mod.helper
    r = Registry(
        [
            spec(target),
            spec(target, name="m", group="g2", qual="Child.method", factory=lambda f: (lambda self: "ours")),
        ]
    )
    r.activate({})
    assert "method" in vars(mod.Child) and mod.Child().method() == "ours"
    r.revert()
    assert mod.helper is original
    assert "method" not in vars(mod.Child), "an inherited attribute must be deleted, not shadowed"
    assert mod.Child().method() == "base"
    assert {s for s, _ in states(r).values()} == {reg.REVERTED}
    r.activate({})  # re-apply after revert
    assert mod.helper(1) == 3 and mod.Child().method() == "ours"


def test_two_groups_stack_on_one_target_and_revert_newest_first(pkg):
    """Patches of different groups on the same attribute: the later wraps the earlier, its checks see
    the target's own function (not our wrapper), and revert takes them off newest first."""
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    original = mod.helper
    seen = []

    def check(fn):
        seen.append(fn)
        return None if fn.__module__ == target else f"judged {fn.__module__}.{fn.__qualname__}, not the target"

    def times_ten(fn):
        def replacement(x):
            return fn(x) * 10

        return replacement

    r = Registry([spec(target, name="a", group="g1", precondition=check), spec(target, name="b", group="g2", factory=times_ten, precondition=check, after=("a",))])
    r.activate({})
    assert {s for s, _ in states(r).values()} == {reg.APPLIED}, states(r)
    assert seen == [original, original]
    assert mod.helper(1) == (1 * 2 + 1) * 10
    r.revert()
    assert mod.helper is original
    assert {s for s, _ in states(r).values()} == {reg.REVERTED}, states(r)


def test_revert_reports_conflict_and_leaves_foreign_replacement(pkg):
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    r = Registry([spec(target)])
    r.activate({})

    def foreign(x):
        return "foreign"

    mod.helper = foreign
    r.revert()
    state, reason = states(r)["p"]
    assert state == reg.CONFLICT and "foreign" in reason
    assert mod.helper is foreign


def test_group_is_atomic_on_precondition_failure(pkg):
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    original = mod.helper
    r = Registry(
        [
            spec(target, name="ok"),
            spec(target, name="bad", qual="Base.method", precondition=lambda f: "Base.method takes the wrong arguments"),
        ]
    )
    r.activate({})
    st = states(r)
    assert st["bad"] == (reg.FAILED, "target changed: Base.method takes the wrong arguments")
    assert st["ok"] == (reg.FAILED, "group g left unpatched: bad failed")
    assert mod.helper is original


def test_group_rolls_back_when_a_factory_raises(pkg):
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    original = mod.helper

    def boom(_original):
        raise RuntimeError("cannot build")

    r = Registry([spec(target, name="first"), spec(target, name="second", qual="Base.method", factory=boom)])
    r.activate({})
    assert states(r)["second"][0] == reg.FAILED and "cannot build" in states(r)["second"][1]
    assert mod.helper is original


def test_missing_target_module_fails_with_reason(pkg):
    name, write = pkg
    write("t", TARGET)
    r = Registry([spec(f"{name}.t", qual="nothing_here")])
    importlib.import_module(f"{name}.t")
    r.activate({})
    state, reason = states(r)["p"]
    assert state == reg.FAILED and reason.startswith("target not found")


def test_module_that_cannot_import_skips_group(pkg):
    _, write = pkg
    broken = write("broken", "import alp_no_such_dependency\ndef helper(x):\n    return x\n")
    r = Registry([spec(broken)])
    r.activate({})
    r.apply_pending()
    state, reason = states(r)["p"]
    assert state == reg.SKIPPED and "does not import" in reason


def test_fixed_upstream_skips_only_that_member(pkg):
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    r = Registry(
        [
            spec(target, name="a"),
            spec(target, name="b", qual="Base.method", factory=lambda f: f, fixed_upstream=lambda f: "has the fix"),
        ]
    )
    r.activate({})
    assert states(r)["a"][0] == reg.APPLIED and mod.helper(1) == 3
    assert states(r)["b"] == (reg.SKIPPED, "already fixed upstream: has the fix")


def test_version_out_of_range_skips_group(pkg, monkeypatch):
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    monkeypatch.setattr(versions, "detect", lambda: {"vllm": versions.Installed("vllm", "0.26.0rc1"), "vllm_ascend": versions.Installed("vllm-ascend", None)})
    r = Registry([spec(target, vllm=">=0.25.0,<0.26")])
    r.activate({})
    assert states(r)["p"] == (reg.SKIPPED, "version out of range: vllm 0.26.0rc1 (base 0.26.0) is outside >=0.25.0,<0.26")
    assert mod.helper(1) == 2


def test_out_of_range_where_its_port_applies_says_ported(pkg, monkeypatch):
    """``ported_to``: out of its range on versions where other code carries its fix, the reason names
    that code (``ported:``); out of range elsewhere it stays a plain "version out of range"."""
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    ported = (({"vllm": ">=0.30,<0.31", "vllm_ascend": None}, "group g_030"),)
    for version, want in (("0.30.0", "ported: on these versions group g_030 carries this fix (version out of range: "),
                          ("0.26.0", "version out of range: vllm 0.26.0 is outside")):
        monkeypatch.setattr(versions, "detect", lambda v=version: {"vllm": versions.Installed("vllm", v), "vllm_ascend": versions.Installed("vllm-ascend", None)})
        r = Registry([spec(target, vllm=">=0.25.0,<0.26", ported_to=ported)])
        r.activate({})
        state, reason = states(r)["p"]
        assert state == reg.SKIPPED and reason.startswith(want), reason
        assert mod.helper(1) == 2  # never applied
        r.revert()


def test_member_out_of_its_own_range_is_left_out_and_the_group_applies(pkg, monkeypatch):
    """A member declared for fewer versions than its group is not part of the group elsewhere."""
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    monkeypatch.setattr(versions, "detect", lambda: {"vllm": versions.Installed("vllm", "0.26.0"), "vllm_ascend": versions.Installed("vllm-ascend", None)})
    r = Registry(
        [
            spec(target, name="wide", vllm=">=0.25.0,<0.27"),
            spec(target, name="narrow", qual="Child.method", factory=lambda f: (lambda self: "ours"), vllm=">=0.25.0,<0.26"),
        ]
    )
    r.activate({})
    got = states(r)
    assert got["wide"][0] == reg.APPLIED and mod.helper(1) == 3
    assert got["narrow"][0] == reg.SKIPPED and "version out of range" in got["narrow"][1] and "rest of group g" in got["narrow"][1]
    assert mod.Child().method() == "base"
    r2 = Registry([spec(target, name="a", vllm=">=0.25.0,<0.26"), spec(target, name="b", qual="Child.method", vllm=">=0.25.0,<0.26")])
    r2.activate({})
    assert {s for s, _ in states(r2).values()} == {reg.SKIPPED}


def test_env_switches(pkg):
    _, write = pkg
    target = write("t", TARGET)
    mod = importlib.import_module(target)
    specs = [spec(target, name="a", group="g1"), spec(target, name="b", group="g2", qual="Base.method", factory=lambda f: f)]
    off = Registry(specs)
    off.activate({"ASCEND_LAYERWISE_PATCH": "0"})
    assert {s for s, _ in states(off).values()} == {reg.SKIPPED} and mod.helper(1) == 2
    skip = Registry(specs)
    skip.activate({"ASCEND_LAYERWISE_PATCH_SKIP": "g1"})
    assert states(skip)["a"] == (reg.SKIPPED, "skipped by ASCEND_LAYERWISE_PATCH_SKIP")
    assert states(skip)["b"][0] == reg.APPLIED and mod.helper(1) == 2


def test_skipping_one_member_skips_its_group(pkg):
    _, write = pkg
    target = write("t", TARGET)
    importlib.import_module(target)
    r = Registry([spec(target, name="a"), spec(target, name="b", qual="Base.method", factory=lambda f: f)])
    r.activate({"ASCEND_LAYERWISE_PATCH_SKIP": "b"})
    assert states(r)["a"] == (reg.SKIPPED, "group g: b skipped by ASCEND_LAYERWISE_PATCH_SKIP")


def test_strict_mode_raises_on_in_range_failure(pkg):
    _, write = pkg
    target = write("t", TARGET)
    importlib.import_module(target)
    r = Registry([spec(target, precondition=lambda f: "drifted")])
    with pytest.raises(PatchError, match="drifted"):
        r.activate({"ASCEND_LAYERWISE_PATCH_STRICT": "1"})


def test_strict_mode_raises_from_the_import_that_fails(pkg):
    _, write = pkg
    target = write("t", TARGET)
    r = Registry([spec(target, precondition=lambda f: "drifted")])
    r.activate({"ASCEND_LAYERWISE_PATCH_STRICT": "1"})
    with pytest.raises(PatchError, match="drifted"):
        importlib.import_module(target)


def test_copier_module_reruns_alias_sync(pkg):
    """A late patch module that copies the original onto a class after we patched the target."""
    _, write = pkg
    target = write("t", TARGET)
    holder = write("h", "class Holder:\n    pass\n")
    copier = write("late", f"import {target} as t\nimport {holder} as h\nh.Holder.helper = staticmethod(t.helper)\nORIG = None\n")
    mod = importlib.import_module(target)
    original = mod.helper
    h = importlib.import_module(holder)
    h.Holder.helper = original  # copied before activation, like a worker patch that ran first
    r = Registry([spec(target, aliases=(f"{holder}:Holder.helper",), copied_by=(copier,))])
    r.activate({})
    assert vars(h.Holder)["helper"] is mod.helper
    importlib.import_module(copier)  # copies our replacement (wrapped in a staticmethod): left alone
    assert h.Holder.helper(1) == 3
    r.revert()
    assert mod.helper is original


@pytest.mark.parametrize(
    "raw,inside",
    [
        ("0.25.0", True),
        ("0.25.1", True),
        ("0.25.1rc1", True),
        ("0.25.1.dev12+g54503ec", True),
        ("0.25.1+cpu", True),
        ("0.25.0rc1", True),  # pre-releases count as the release they lead to (see versions.py)
        ("0.24.0", False),
        ("0.26.0", False),
        ("0.26.0rc1", False),
        ("0.26.0.dev3+gabc", False),
    ],
)
def test_versions_compare_on_base_release(raw, inside):
    ok, why = versions.in_range(versions.Installed("vllm", raw), ">=0.25.0,<0.26")
    assert ok is inside, why


def test_versions_absent_and_invalid():
    assert versions.in_range(versions.Installed("vllm", None), ">=0.25")[1] == "vllm is not installed"
    assert "not a PEP 440 version" in versions.in_range(versions.Installed("vllm", "banana"), ">=0.25")[1]


def test_a_context_factory_reads_another_groups_live_state(pkg):
    """``PatchSpec.context``: the factory gets a read-only view of group states (no registry import)."""
    _, write = pkg
    first, second = write("t1", TARGET), write("t2", TARGET)

    def gated(original, context):
        def replacement(x):
            return original(x) + (100 if context.group_states("other") <= {reg.APPLIED, reg.PENDING} else 0)

        return replacement

    r = Registry([spec(first, name="p", group="g", factory=gated, context=True), spec(second, name="q", group="other")])
    r.activate({})
    mod = importlib.import_module(first)
    assert states(r)["q"][0] == reg.PENDING and mod.helper(1) == 102  # "other" is waiting for its module
    importlib.import_module(second)
    assert mod.helper(1) == 102  # applied
    r.revert()
    r.activate({"ASCEND_LAYERWISE_PATCH_SKIP": "other"})
    assert states(r)["q"][0] == reg.SKIPPED and mod.helper(1) == 2  # skipped: the view says so at once
    assert r.context.group_states("nothing") == frozenset()


def test_patches_stacked_on_one_target_must_name_the_earlier_ones():
    mod = "alp_fake_order"  # the order is checked when the registry is built, before any import
    with pytest.raises(ValueError, match=r"'b' on .*after=\(\), but the earlier patches of that target are \['a'\]"):
        Registry([spec(mod, name="a", group="g1"), spec(mod, name="b", group="g2")])
    with pytest.raises(ValueError, match=r"after=\('c',\)"):
        Registry([spec(mod, name="a", group="g1"), spec(mod, name="b", group="g2", after=("c",))])
    Registry([spec(mod, name="a", group="g1"), spec(mod, name="b", group="g2", after=("a",))])


def test_expects_is_data_checked_before_the_precondition_and_the_risk_is_appended(pkg):
    mod = pkg[1]("t", TARGET)
    importlib.import_module(mod)
    calls = []
    r = Registry(
        [
            spec(
                mod,
                name="e",
                expects=Expect(params=("x", "y")),
                precondition=lambda o: calls.append(o) or None,
                risk="what stays unfixed",
            )
        ]
    )
    r.activate({})
    try:
        state, reason = states(r)["e"]
    finally:
        r.revert()
    assert state == reg.FAILED and calls == []
    assert reason == "target changed: helper parameters are ['x'], expected ['x', 'y']; what stays unfixed"
    assert Expect(params=("x",), uses=("return",))(sys.modules[mod].helper) is None
    assert Expect(uses=("no_such_name",))(sys.modules[mod].helper) == "helper no longer uses no_such_name"
    assert Expect(module_globals=("absent",))(sys.modules[mod].helper) == f"{mod} no longer defines/imports absent"
