"""Issue 13 on throwaway targets: copies found in the source and each with its own state, a copy
that cannot be patched failing its group, unknown SKIP names, and when the summary line is logged.
No vLLM needed (the fixtures come from test_registry)."""

from __future__ import annotations

import importlib
import logging
import re

import pytest

from ascend_layerwise_patch import registry as reg
from ascend_layerwise_patch import versions
from ascend_layerwise_patch.patches._checks import copies_in_source
from ascend_layerwise_patch.registry import PatchError, Registry as _Registry
from ascend_layerwise_patch.host import HOST, LOGGER_NAME

from test_registry import COPIER, TARGET, pkg, spec, states  # noqa: F401  (pkg is a fixture)


def Registry(specs, **kw):
    """The registry as the package builds it (versions and logging from the vLLM host)."""
    return _Registry(specs, **{"host": HOST, **kw})


@pytest.fixture(autouse=True)
def _no_vllm(monkeypatch):
    """No vLLM: the registry logs through the standard logger at once (nothing to wait for)."""
    monkeypatch.setattr(
        versions, "detect", lambda: {"vllm": versions.Installed("vllm", None), "vllm_ascend": versions.Installed("vllm-ascend", None)}
    )


def test_copies_are_found_in_the_installed_source(pkg):
    name, write = pkg
    target = write("utils", TARGET)
    write("a", f"from {target} import helper\n")
    write("b", f"import os\nfrom {target} import (\n    Base,  # a comment\n    helper as renamed,\n)\n")
    write("c", f"try:\n    from {target} import helper\nexcept ImportError:\n    pass\n")
    write("d", f"def f():\n    from {target} import helper\n    return helper\n")  # a local: no copy
    write("e", f"class K:\n    if True:\n        from {target} import helper\n")  # a class attribute, not the module's
    write("f", f"from {target} import Child\n")
    found = copies_in_source(name, target, ["helper", "Child", "missing"])
    assert found == {
        "helper": (f"{name}.a:helper", f"{name}.b:renamed", f"{name}.c:helper"),
        "Child": (f"{name}.f:Child",),
        "missing": (),
    }


def test_found_copies_get_patched_and_each_place_has_its_state(pkg):
    name, write = pkg
    target = write("utils", TARGET)
    write("a", f"from {target} import helper\n")
    write("later", f"from {target} import helper as h\n")
    finder = lambda: copies_in_source(name, target, ["helper"])["helper"]  # noqa: E731
    r = Registry([spec(target, find_aliases=finder)])
    r.activate({})
    a = importlib.import_module(f"{name}.a")
    assert a.helper(1) == 3
    places = {p["place"]: (p["role"], p["state"]) for p in r.status()[0].places}
    assert places == {
        f"{target}:helper": ("target", reg.APPLIED),
        f"{name}.a:helper": ("copy", reg.APPLIED),
        f"{name}.later:h": ("copy", reg.PENDING),
    }
    assert importlib.import_module(f"{name}.later").h(1) == 3
    assert {p["state"] for p in r.status()[0].places} == {reg.APPLIED}


def test_a_copy_holding_something_else_fails_the_whole_group(pkg):
    _, write = pkg
    target = write("t", TARGET)
    other = write("o", TARGET.replace("def helper", "def other"))
    copier = write("c", "def helper(x):\n    return -x\n")  # not a copy of the target
    mod = importlib.import_module(target)
    r = Registry([spec(target, aliases=(f"{copier}:helper",)), spec(other, name="q", qual="other")])
    r.activate({})
    assert states(r)["p"][0] == states(r)["q"][0] == reg.APPLIED
    importlib.import_module(copier)
    assert states(r)["p"] == (reg.FAILED, f"copy {copier}:helper holds {copier}.helper, neither the original nor this patch")
    assert states(r)["q"] == (reg.FAILED, "group g left unpatched: p failed")
    assert mod.helper(1) == 2 and importlib.import_module(other).other(1) == 2  # both taken back off
    assert {p["place"]: p["state"] for p in r.status()[0].places}[f"{copier}:helper"] == reg.FAILED


def test_unknown_skip_name_is_an_error_with_the_valid_names(pkg, caplog):
    _, write = pkg
    target = write("t", TARGET)
    r = Registry([spec(target), spec(target, name="other", group="h", qual="Base.method")])
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    r.activate({reg.ENV_SKIP: "p,pp"})
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
    assert errors == [f"ascend_layerwise_patch: {reg.ENV_SKIP} names no patch or group: pp (valid patches: p, other; valid groups: g, h)"]
    assert r.config_errors and states(r)["p"][0] == reg.SKIPPED
    with pytest.raises(PatchError, match=r"names no patch or group: pp \(valid patches: p; valid groups: g\)"):
        Registry([spec(target)]).activate({reg.ENV_SKIP: "pp", reg.ENV_STRICT: "1"})


def test_summary_once_settled_and_again_only_on_a_change(pkg, caplog):
    _, write = pkg
    target = write("t", TARGET)
    copier = write("c", "def helper(x):\n    return -x\n")
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    r = Registry([spec(target, aliases=(f"{copier}:helper",))])

    def summaries():
        return [rec.getMessage() for rec in caplog.records if rec.levelno == logging.INFO and rec.getMessage().startswith("ascend_layerwise_patch [")]

    r.activate({})
    assert summaries() == []  # pending: nothing to say yet
    importlib.import_module(target)
    assert len(summaries()) == 1 and summaries()[0].endswith("]: 1 applied, 0 fixed upstream, 0 skipped, 0 failed")
    r.activate({})
    importlib.import_module(write("unrelated", "x = 1\n"))
    assert len(summaries()) == 1  # nothing changed
    importlib.import_module(copier)  # a late failure
    assert len(summaries()) == 2 and summaries()[1].endswith("]: 0 applied, 0 fixed upstream, 0 skipped, 1 failed; failed: g")
    details = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.DEBUG and " every patch: " in rec.getMessage()]
    assert "p=failed(copy " in details[-1]  # every patch's state and reason at DEBUG


def test_the_summary_line_stays_short_however_many_groups_fail(pkg, caplog):
    """Issue 36: the INFO line stays under 200 characters with vLLM's prefix (message <= 160); the
    failed groups it cannot name are left to ``check`` and DEBUG."""
    _, write = pkg
    target = write("t", TARGET)
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    importlib.import_module(target)

    def summary(n):
        caplog.clear()
        Registry([spec(target, name=f"patch_number_{i}", group=f"grp_{i}", qual=f"gone_{i}") for i in range(n)]).activate({})
        lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("ascend_layerwise_patch [")]
        assert len(lines) == 1 and len(lines[0]) <= 160, lines
        return lines[0]

    assert summary(2).endswith("]: 0 applied, 0 fixed upstream, 0 skipped, 2 failed; failed: grp_0, grp_1")
    assert re.search(r"\]: 0 applied, 0 fixed upstream, 0 skipped, 12 failed; failed: grp_0, grp_1(, grp_\d+)* and \d+ more$", summary(12))
