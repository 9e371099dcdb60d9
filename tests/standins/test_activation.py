"""Activation paths, each in its own interpreter, against the real vLLM / vllm-ascend of the pair.

The children load the NPU stand-ins by file path, so that importing them does not import (and
so activate) ascend_layerwise_patch before the test wants it.
"""

from __future__ import annotations

import json

import pytest

from support import PAIR, ROOT, run_python

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


def result(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no RESULT line\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


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


@pytest.mark.pairs(*IN_RANGE)
def test_activate_then_import():
    out = result(
        run_python(
            STANDINS
            + """
import ascend_layerwise_patch
import vllm_ascend.attention.utils as u
report(wait=ours(u.wait_for_kv_layer_from_connector), save=ours(u.maybe_save_kv_layer_to_connector))
"""
        )
    )
    assert out == {"wait": "guard_wait", "save": "guard_save"}


@pytest.mark.pairs(*FULL)
def test_import_then_activate_patches_existing_copies():
    out = result(
        run_python(
            STANDINS
            + """
import vllm_ascend.ops.gdn as gdn, vllm_ascend.attention.mla_v1 as mla
keep = [gdn.maybe_save_kv_layer_to_connector]  # a list: a module-level name would be an unknown copy
import ascend_layerwise_patch
from vllm_ascend.attention import utils as u
st = {s.name: s for s in ascend_layerwise_patch.status()}
report(
    gdn_copy=ours(gdn.maybe_save_kv_layer_to_connector), mla_wait=ours(mla.wait_for_kv_layer_from_connector),
    same_object=gdn.maybe_save_kv_layer_to_connector is u.maybe_save_kv_layer_to_connector,
    wrapped_original=gdn.maybe_save_kv_layer_to_connector.__wrapped__ is keep[0],
    core=ours(gdn.AscendGatedDeltaNetAttention._forward_core), state=st["gdn_layerwise"].state,
)
"""
        )
    )
    assert out == {
        "gdn_copy": "guard_save",
        "mla_wait": "guard_wait",
        "same_object": True,
        "wrapped_original": True,
        "core": "gdn_layerwise",
        "state": "applied",
    }


@pytest.mark.pairs(*IN_RANGE)
def test_activate_twice_and_plugin_plus_import_wrap_once():
    out = result(
        run_python(
            STANDINS
            + """
import ascend_layerwise_patch
from ascend_layerwise_patch import plugin
import vllm_ascend.attention.utils as u
first = u.wait_for_kv_layer_from_connector
ascend_layerwise_patch.activate(); plugin.register()
from vllm.plugins import load_general_plugins
load_general_plugins()
f = u.wait_for_kv_layer_from_connector
report(same=f is first, inner_is_plain=ours(f.__wrapped__) is None)
"""
        )
    )
    assert out == {"same": True, "inner_is_plain": True}


@pytest.mark.pairs(*IN_RANGE)
def test_revert_then_reapply():
    out = result(
        run_python(
            STANDINS
            + """
import ascend_layerwise_patch as alp
import vllm_ascend.ops  # as the NPU platform does first: vllm-ascend has an import cycle otherwise
import vllm_ascend.attention.utils as u, vllm_ascend.attention.mla_v1 as mla
keep = [u.wait_for_kv_layer_from_connector.__wrapped__]  # not a module-level name: that is an unknown copy
alp.revert()
back = u.wait_for_kv_layer_from_connector is keep[0] and mla.wait_for_kv_layer_from_connector is keep[0]
alp.activate()
report(back=back, again=ours(u.wait_for_kv_layer_from_connector), alias=ours(mla.wait_for_kv_layer_from_connector),
       inner=u.wait_for_kv_layer_from_connector.__wrapped__ is keep[0])
"""
        )
    )
    assert out == {"back": True, "again": "guard_wait", "alias": "guard_wait", "inner": True}


@pytest.mark.pairs(*FULL)
@pytest.mark.parametrize("ours_first", [True, False], ids=["ours-first", "worker-patches-first"])
def test_vllm_ascend_worker_patches_keep_ours(ours_first):
    """NPUWorker imports vllm_ascend.patch.worker late; its copies must end up pointing at ours."""
    order = ["import ascend_layerwise_patch", "import vllm_ascend.patch.worker"]
    if not ours_first:
        order.reverse()
    out = result(
        run_python(
            STANDINS
            + "\n".join(order)
            + """
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention as Q
from vllm_ascend.ops.gdn import AscendGatedDeltaNetAttention as A
report(qwen=ours(vars(Q)["_forward_core"]), same=vars(Q)["_forward_core"] is vars(A)["_forward_core"])
"""
        )
    )
    assert out == {"qwen": "gdn_layerwise", "same": True}


SPAWN = """
import multiprocessing as mp, os, sys
sys.path.insert(0, r"{here}")
import spawn_child
if __name__ == "__main__":
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=spawn_child.main, args=(q,))
    p.start(); out = q.get(timeout=240); p.join(60)
    print("RESULT " + out)
"""


@pytest.mark.pairs(*IN_RANGE)
@pytest.mark.parametrize(
    "plugins,patched",
    [
        (None, True),
        ("ascend,ascend_layerwise_patch,ascend_kv_connector", True),
        ("ascend,ascend_kv_connector", False),
    ],
    ids=["all-plugins", "listed", "left-out"],
)
def test_spawned_child_gets_patches_through_vllm_plugins(plugins, patched):
    env = {} if plugins is None else {"VLLM_PLUGINS": plugins}
    out = result(run_python(SPAWN.format(here=ROOT / "tests" / "standins"), env=env))
    assert out["loaded_package"] is patched
    assert out["wait"] == ("guard_wait" if patched else None)


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
def test_one_summary_line_through_vllms_logger():
    worker = "import vllm_ascend.patch.worker, vllm_ascend.attention.utils\n" + (
        "import vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector\n"
    )  # what a worker imports: every group settles (the 310P one counts as settled: not imported)
    proc = run_python(STANDINS + "import ascend_layerwise_patch\n" + worker)
    lines = [line for line in proc.stdout.splitlines() if "ascend_layerwise_patch [vllm " in line]
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("INFO ") and "[summary.py:" in lines[0]  # vLLM's format, vLLM's handler
