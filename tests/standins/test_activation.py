"""Activation paths, each in its own interpreter, against the real vLLM / vllm-ascend of the pair.

The children load the NPU stand-ins by file path, so that importing them does not import (and
so activate) ascend_layerwise_patch before the test wants it.

Each scenario is one test, run on every release line it applies to (``RELEASES``: the pairs, and
the patches that show it there). On the base releases (vLLM 0.25 / 0.26) the probes are the
connector guards; on vllm-ascend 0.30.0rc2 (issue 25) those are fixed upstream, and what applies is
gdn_layerwise_310p (the 310P GDN layer never waits for its load) and mamba_local_hit (balance
scheduling takes the largest per-group hit): the probes there.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest

from support import PAIR, ROOT, on, run_python

STANDINS = f"""
import importlib.util, json, sys
_s = importlib.util.spec_from_file_location("_alp_standins", r"{ROOT / 'ascend_layerwise_patch' / 'cpu_standins.py'}")
_m = importlib.util.module_from_spec(_s); _s.loader.exec_module(_m); _m.install()
MARK = "__ascend_layerwise_patch__"
def ours(obj):
    return getattr(obj, MARK, None)
def report(**kw):
    print("RESULT " + json.dumps(kw))
"""

IN_RANGE = ("v0251", "v0250", "v0260")
#: in range, and vllm-ascend's ops.gdn imports (on vLLM 0.25.0 it does not): every group applies
FULL = ("v0251", "v0260")


class Release(NamedTuple):
    """A release line and its probes. ``probes`` defines ``probes()``: each probed target's patch
    (None: not ours), importing what it reads lazily unless the code imports it first; ``applied``
    is what it returns with the line's patches applied; ``fixed``, patches skipped there as fixed
    upstream (by their detectors)."""

    name: str
    pairs: tuple[str, ...]
    #: the pairs where vllm-ascend's GDN layer and worker patches import
    full: tuple[str, ...]
    probes: str
    applied: dict
    fixed: frozenset = frozenset()
    #: run after activation, before the probes are read (0.30: the 310P layer's module is imported
    #: by the probes before the library in one order; its patch is applied here in both)
    settle: str = ""
    #: what the wrap-once and revert scenario imports first, the probed target it follows, and a
    #: copy of that target another module made (its original comes back with it)
    imports: str = ""
    target: str = ""
    copy: str = ""
    #: what the spawned child (spawn_child.py) reads
    child_probe: str = ""


BASE = Release(
    "0.25-0.26",
    IN_RANGE,
    FULL,
    probes="""
def probes():
    import vllm_ascend.attention.utils as u
    return dict(wait=ours(u.wait_for_kv_layer_from_connector), save=ours(u.maybe_save_kv_layer_to_connector))
""",
    applied={"wait": "guard_wait", "save": "guard_save"},
    imports="import vllm_ascend.ops  # as the NPU platform does first: vllm-ascend has an import cycle otherwise\n"
    "import vllm_ascend.attention.utils as u, vllm_ascend.attention.mla_v1 as mla\n",
    target="u.wait_for_kv_layer_from_connector",
    copy="mla.wait_for_kv_layer_from_connector",
    child_probe="wait",
)
GDN310 = "vllm_ascend._310p.ops.fla.gdn_310"
COORD = "vllm_ascend.patch.platform.patch_kv_cache_coordinator"
#: vllm-ascend 0.30.0rc2 (issue 25): the connector guards are fixed upstream (vllm-ascend's own
#: helper stays); the 310P GDN layer's wait and the joint local hit apply
V030 = Release(
    "0.30",
    ("v0300", "v0290"),
    ("v0300",),  # vllm-ascend 0.30.0rc2's worker patches do not import on vLLM 0.29.0
    probes=f"""
import {GDN310} as g310, {COORD} as coord
def probes():
    import vllm_ascend.attention.utils as u
    return dict(g310=ours(vars(g310.AscendGatedDeltaNetAttention310)["_forward_core"]),
                coord=ours(vars(coord.AscendHybridKVCacheCoordinator)["find_longest_cache_hit_per_group"]),
                wait=ours(u.wait_for_kv_layer_from_connector))
""",
    applied={"g310": "gdn_layerwise_310p", "coord": "mamba_local_hit", "wait": None},
    fixed=frozenset({"guard_wait", "guard_save", "gdn_layerwise", "mamba_precopy_rows", "postprocess_kernel"}),
    settle="alp.REGISTRY.apply_pending()\n",
    target='vars(g310.AscendGatedDeltaNetAttention310)["_forward_core"]',
    child_probe="g310",
)


LEFT_OUT = "the plugin left out of VLLM_PLUGINS: the child patches nothing, as without the library"


#: the probes, then the states: what both orders of activation report
READ = """
p = probes()
st = {s.name: s for s in alp.status()}
report(**p, fixed=sorted(n for n, s in st.items() if s.reason.startswith("already fixed upstream")),
       failed=sorted(n for n, s in st.items() if s.state == "failed"))
"""


def result(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no RESULT line\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.control("the import's own cost: importing the package loads nothing heavy, whether it then activates or not")
def test_import_is_cheap_and_imports_no_heavy_module():
    proc = run_python(
        """
        import sys, time
        t0 = time.perf_counter()
        import ascend_layerwise_patch
        dt = time.perf_counter() - t0
        heavy = sorted(m for m in ("torch", "vllm", "vllm_ascend", "triton", "numpy") if m in sys.modules)
        import json; print("RESULT " + json.dumps({"heavy": heavy, "ms": dt * 1e3}))
        """
    )
    out = result(proc)
    assert out["heavy"] == [], out


@pytest.mark.parametrize("release", [on(BASE), on(V030)])
def test_activate_then_import(release):
    out = result(run_python(STANDINS + "import ascend_layerwise_patch as alp\n" + release.probes + release.settle + READ))
    assert {k: out[k] for k in release.applied} == release.applied, out
    assert out["failed"] == [] and release.fixed <= set(out["fixed"]), out


#: per release: what is imported before the library, what is then read, and what must be found.
#: On the base releases the guards' copies (made by the modules that import the helpers) are patched
#: where they stand; on 0.30 the probed targets are patched in place
EXISTING = {
    BASE.name: (
        """
import vllm_ascend.ops.gdn as gdn, vllm_ascend.attention.mla_v1 as mla
keep = [gdn.maybe_save_kv_layer_to_connector]  # a list: a module-level name would be an unknown copy
""",
        """
from vllm_ascend.attention import utils as u
st = {s.name: s for s in alp.status()}
report(
    gdn_copy=ours(gdn.maybe_save_kv_layer_to_connector), mla_wait=ours(mla.wait_for_kv_layer_from_connector),
    same_object=gdn.maybe_save_kv_layer_to_connector is u.maybe_save_kv_layer_to_connector,
    wrapped_original=gdn.maybe_save_kv_layer_to_connector.__wrapped__ is keep[0],
    core=ours(gdn.AscendGatedDeltaNetAttention._forward_core), state=st["gdn_layerwise"].state,
)
""",
        {
            "gdn_copy": "guard_save",
            "mla_wait": "guard_wait",
            "same_object": True,
            "wrapped_original": True,
            "core": "gdn_layerwise",
            "state": "applied",
        },
    ),
    V030.name: (V030.probes, READ, {**V030.applied, "failed": []}),
}


@pytest.mark.parametrize("release", [on(BASE, pairs=FULL), on(V030)])
def test_import_then_activate_patches_existing_copies(release):
    before, read, want = EXISTING[release.name]
    out = result(run_python(STANDINS + before + "import ascend_layerwise_patch as alp\n" + release.settle + read))
    assert {k: out[k] for k in want} == want, out
    assert release.fixed <= set(out.get("fixed", ())), out


#: the GDN layer class vLLM's model uses (vllm-ascend's worker patches point the Qwen class's
#: method at vllm-ascend's): ours on the base releases; upstream's on 0.30, which waits itself
QWEN_CORE = {BASE.name: "gdn_layerwise", V030.name: None}


@pytest.mark.parametrize(
    "release,ours_first",
    [
        on(release, first, pairs=release.full, name=name)
        for release in (BASE, V030)
        for first, name in ((True, "ours-first"), (False, "worker-patches-first"))
    ],
)
def test_vllm_ascend_worker_patches_keep_ours(release, ours_first):
    """NPUWorker imports vllm_ascend.patch.worker late; its copies must end up pointing at ours."""
    order = ["import ascend_layerwise_patch", "import vllm_ascend.patch.worker"]
    if not ours_first:
        order.reverse()
    out = result(
        run_python(
            STANDINS
            + "\n".join(order)
            + release.probes
            + """
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention as Q
from vllm_ascend.ops.gdn import AscendGatedDeltaNetAttention as A
report(**probes(), qwen=ours(vars(Q)["_forward_core"]), same=vars(Q)["_forward_core"] is vars(A)["_forward_core"])
"""
        )
    )
    assert out == {**release.applied, "qwen": QWEN_CORE[release.name], "same": True}


@pytest.mark.parametrize("release", [on(BASE), on(V030)])
def test_plugin_twice_revert_and_reapply_wrap_once(release):
    """Activation again, the plugin and vLLM's plugin loading wrap each target once; revert puts the
    originals back (a copy's too) and activation again wraps them afresh."""
    target, copy = release.target, release.copy or release.target
    out = result(
        run_python(
            STANDINS
            + "import ascend_layerwise_patch as alp\nfrom ascend_layerwise_patch import plugin\n"
            + release.imports
            + release.probes
            + f"""
first = {target}
alp.activate(); plugin.register()
from vllm.plugins import load_general_plugins
load_general_plugins()
same = {target} is first
plain = ours(first.__wrapped__) is None
keep = [first.__wrapped__]  # not a module-level name: that is an unknown copy
alp.revert()
back = {target} is keep[0] and {copy} is keep[0]
reverted = probes()
alp.activate()
again = {target}
report(same=same, plain=plain, back=back, reverted=reverted, again=probes(), copy=ours({copy}) == ours(again),
       inner=again.__wrapped__ is keep[0])
"""
        )
    )
    assert out == {
        "same": True,
        "plain": True,
        "back": True,
        "reverted": dict.fromkeys(release.applied),
        "again": release.applied,
        "copy": True,
        "inner": True,
    }


SPAWN = """
import multiprocessing as mp, os, sys
sys.path.insert(0, r"{here}")
import spawn_child
if __name__ == "__main__":
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=spawn_child.main, args=(q, "{probe}"))
    p.start(); out = q.get(timeout=240); p.join(60)
    print("RESULT " + out)
"""


@pytest.mark.parametrize(
    "release,plugins,patched",
    [
        on(BASE, None, True, name="all-plugins"),
        on(BASE, "ascend,ascend_layerwise_patch,ascend_kv_connector", True, name="listed"),
        on(BASE, "ascend,ascend_kv_connector", False, name="left-out", control=LEFT_OUT),
        on(V030, None, True, name="all-plugins"),
        on(V030, "ascend,ascend_kv_connector", False, name="left-out", control=LEFT_OUT),
    ],
)
def test_spawned_child_gets_patches_through_vllm_plugins(release, plugins, patched):
    env = {} if plugins is None else {"VLLM_PLUGINS": plugins}
    out = result(run_python(SPAWN.format(here=ROOT / "tests" / "standins", probe=release.child_probe), env=env))
    assert out["loaded_package"] is patched
    assert out[release.child_probe] == (release.applied[release.child_probe] if patched else None)


@pytest.mark.pairs("v0240")
def test_out_of_range_pairs_patch_nothing():
    out = result(
        run_python(
            STANDINS
            + """
import ascend_layerwise_patch as alp
import vllm_ascend.attention.utils as u
alp.REGISTRY.apply_pending()
report(wait=ours(u.wait_for_kv_layer_from_connector), states=sorted({s.state for s in alp.status()}),
       reasons=sorted({s.reason for s in alp.status()}))
"""
        )
    )
    assert out["wait"] is None
    assert out["states"] == ["skipped"]
    # the groups covering 0.26 say <0.27; those declared for 0.25.x only, <0.26; those that also
    # cover vllm-ascend 0.30.0rc2 (issue 25), <0.31 without 0.27 / 0.28; those for 0.30's defects only
    # (pool_hit_boundary, pool_key_tp), >=0.29,<0.31; for vLLM 0.30 only (pool_load_recovery*), >=0.30,<0.31
    ranges = (">=0.25.0,<0.27", ">=0.25.0,<0.26", ">=0.25.0,<0.31,!=0.27.*,!=0.28.*", ">=0.29,<0.31", ">=0.30,<0.31")
    assert all(
        r.startswith("version out of range: vllm 0.2") and any(r.endswith(f"outside {want}") for want in ranges)
        for r in out["reasons"]
    ), out["reasons"]


DRIFT = """
import vllm_ascend.attention.utils as u
def maybe_save_kv_layer_to_connector(layer_name, kv_cache_layer, extra):  # a 'new upstream signature'
    return None
u.maybe_save_kv_layer_to_connector = maybe_save_kv_layer_to_connector
"""


@pytest.mark.pairs(*IN_RANGE)
def test_drift_inside_a_group_leaves_the_whole_group_off():
    out = result(
        run_python(
            STANDINS
            + DRIFT
            + """
import ascend_layerwise_patch as alp
st = {s.name: (s.state, s.reason) for s in alp.status()}
report(wait=ours(u.wait_for_kv_layer_from_connector), guard_wait=st["guard_wait"], guard_save=st["guard_save"])
"""
        )
    )
    assert out["wait"] is None
    assert out["guard_save"][0] == "failed" and "kv_cache_layer', 'extra'" in out["guard_save"][1]
    assert out["guard_wait"] == ["failed", "group connector_guards left unpatched: guard_save failed"]


@pytest.mark.pairs(*IN_RANGE)
@pytest.mark.parametrize("how", ["plugin", "activate"])
def test_strict_mode_raises_through_the_plugin_and_activate(how):
    call = "from vllm.plugins import load_general_plugins\nload_general_plugins()\n" if how == "plugin" else (
        "import ascend_layerwise_patch\nascend_layerwise_patch.activate()\n"
    )
    proc = run_python(STANDINS + DRIFT + call, env={"ASCEND_LAYERWISE_PATCH_STRICT": "1"}, check=False)
    assert proc.returncode != 0
    assert "PatchError" in proc.stderr and "guard_save" in proc.stderr


@pytest.mark.pairs(*IN_RANGE)
def test_without_strict_mode_the_plugin_logs_and_vllm_goes_on():
    proc = run_python(STANDINS + DRIFT + "from vllm.plugins import load_general_plugins\nload_general_plugins()\n")
    assert "group connector_guards left unpatched: guard_save" in proc.stdout


@pytest.mark.pairs(*IN_RANGE)
@pytest.mark.control("the switch itself: its child sets ASCEND_LAYERWISE_PATCH=0 and asserts nothing is patched")
def test_disabled_by_environment():
    out = result(
        run_python(
            STANDINS + "import ascend_layerwise_patch as alp\nimport vllm_ascend.attention.utils as u\n"
            "report(wait=ours(u.wait_for_kv_layer_from_connector), reasons=sorted({s.reason for s in alp.status()}))\n",
            env={"ASCEND_LAYERWISE_PATCH": "0"},
        )
    )
    assert out == {"wait": None, "reasons": ["disabled by ASCEND_LAYERWISE_PATCH=0"]}


@pytest.mark.pairs("v0251")  # on v0250 vllm-ascend's worker patches do not import: no worker there settles
@pytest.mark.control("the summary line's count and format through vLLM's logger: one line whether the library applies or is switched off")
def test_one_summary_line_through_vllms_logger():
    worker = "import vllm_ascend.patch.worker, vllm_ascend.attention.utils\n" + (
        "import vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector\n"
        "import vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.memcache_backend\n"
    )  # what a worker with the MemCache pool imports: every group settles (the 310P one counts as settled: not imported)
    proc = run_python(STANDINS + "import ascend_layerwise_patch\n" + worker)
    lines = [line for line in proc.stdout.splitlines() if "ascend_layerwise_patch [vllm " in line]
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("INFO ") and "[summary.py:" in lines[0]  # vLLM's format, vLLM's handler


@pytest.mark.pairs("v0251", "v0260", "v0300")
def test_revert_after_the_harness_setup_leaves_no_patch():
    """``revert()`` undoes everything it installed, also where vllm-ascend re-bound a patched class under
    its name since (0.25.1rc1's balance scheduler subclasses vLLM's ``Scheduler``; ``load_fail_scheduler``
    patches the base class through a ``Scheduler.__base__`` alias: the alias restored the target's own
    place, and revert reported the target as replaced by someone else -- a conflict, left in place)."""
    import importlib

    from harness_pool import setup_runtime

    import ascend_layerwise_patch
    from ascend_layerwise_patch.registry.install import split_path

    setup_runtime()
    reg = ascend_layerwise_patch.REGISTRY
    try:
        states = reg.revert()
        left = []
        for spec in reg.specs:
            module_name, attr_path = split_path(spec.target)
            try:
                obj = importlib.import_module(module_name)
                for part in attr_path.split("."):
                    obj = getattr(obj, part)
            except Exception:  # noqa: BLE001 - not importable on this pair
                continue
            if type(obj).__module__.startswith("wrapt"):
                left.append(spec.name)
        print(f"\nrevert on {PAIR}: {len(states)} states, {len(left)} patches left")
        assert [st.name for st in states if st.state == "conflict"] == []
        assert left == []
    finally:
        reg.activate()
