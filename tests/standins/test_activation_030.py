"""Activation on vllm-ascend 0.30.0rc2 (issue 25), each path in its own interpreter.

There the connector guards are fixed upstream (test_activation.py probes guard_wait, so its tests
are for 0.25 / 0.26); what applies is gdn_layerwise_310p (the 310P GDN layer never waits for its
load) and mamba_local_hit (balance scheduling takes the largest per-group hit). These two are the
probes here, in every order: activate then import, import then activate, vllm-ascend's worker
patches before and after, the vLLM plugin in a spawned child, twice, revert and re-apply.
"""

from __future__ import annotations

import pytest

from support import ROOT, run_python
from test_activation import STANDINS, result

NEW = ("v0300", "v0290")
GDN310 = "vllm_ascend._310p.ops.fla.gdn_310"
COORD = "vllm_ascend.patch.platform.patch_kv_cache_coordinator"
PROBE = f"""
import {GDN310} as g310, {COORD} as coord
def probes():
    return dict(g310=ours(vars(g310.AscendGatedDeltaNetAttention310)["_forward_core"]),
                coord=ours(vars(coord.AscendHybridKVCacheCoordinator)["find_longest_cache_hit_per_group"]))
"""
APPLIED = {"g310": "gdn_layerwise_310p", "coord": "mamba_local_hit"}


@pytest.mark.pairs(*NEW)
@pytest.mark.parametrize("ours_first", [True, False], ids=["activate-then-import", "import-then-activate"])
def test_both_orders_patch_the_two_groups_that_apply(ours_first):
    body = ("import ascend_layerwise_patch as alp\n" + PROBE) if ours_first else (PROBE + "import ascend_layerwise_patch as alp\n")
    out = result(
        run_python(
            STANDINS
            + body
            + """
alp.REGISTRY.apply_pending()
import vllm_ascend.attention.utils as u
st = {s.name: s for s in alp.status()}
report(**probes(), wait=ours(u.wait_for_kv_layer_from_connector),
       fixed=sorted(n for n, s in st.items() if s.reason.startswith("already fixed upstream")),
       failed=sorted(n for n, s in st.items() if s.state == "failed"))
"""
        )
    )
    assert {k: out[k] for k in APPLIED} == APPLIED, out
    assert out["wait"] is None and out["failed"] == [], out  # fixed upstream: vllm-ascend's own helper stays
    assert {"guard_wait", "guard_save", "gdn_layerwise", "mamba_precopy_rows", "postprocess_kernel"} <= set(out["fixed"])


@pytest.mark.pairs("v0300")  # vllm-ascend 0.30.0rc2's worker patches do not import on vLLM 0.29.0
@pytest.mark.parametrize("ours_first", [True, False], ids=["ours-first", "worker-patches-first"])
def test_worker_patches_leave_upstreams_waiting_gdn_in_place(ours_first):
    order = ["import ascend_layerwise_patch", "import vllm_ascend.patch.worker"]
    if not ours_first:
        order.reverse()
    out = result(
        run_python(
            STANDINS
            + "\n".join(order)
            + PROBE
            + """
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention as Q
from vllm_ascend.ops.gdn import AscendGatedDeltaNetAttention as A
report(**probes(), qwen=ours(vars(Q)["_forward_core"]), same=vars(Q)["_forward_core"] is vars(A)["_forward_core"])
"""
        )
    )
    assert out == {**APPLIED, "qwen": None, "same": True}


@pytest.mark.pairs(*NEW)
def test_plugin_twice_revert_and_reapply_wrap_once():
    out = result(
        run_python(
            STANDINS
            + "import ascend_layerwise_patch as alp\nfrom ascend_layerwise_patch import plugin\n"
            + PROBE
            + """
first = vars(g310.AscendGatedDeltaNetAttention310)["_forward_core"]
alp.activate(); plugin.register()
from vllm.plugins import load_general_plugins
load_general_plugins()
same = vars(g310.AscendGatedDeltaNetAttention310)["_forward_core"] is first
keep = [first.__wrapped__]
alp.revert()
back = vars(g310.AscendGatedDeltaNetAttention310)["_forward_core"] is keep[0]
reverted = probes()
alp.activate()
again = vars(g310.AscendGatedDeltaNetAttention310)["_forward_core"]
report(same=same, back=back, reverted=reverted, again=probes(), inner=again.__wrapped__ is keep[0])
"""
        )
    )
    assert out == {"same": True, "back": True, "reverted": {"g310": None, "coord": None}, "again": APPLIED, "inner": True}


SPAWN = """
import multiprocessing as mp, sys, json
sys.path.insert(0, r"{here}")
import spawn_child_030
if __name__ == "__main__":
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=spawn_child_030.main, args=(q,))
    p.start(); out = q.get(timeout=240); p.join(60)
    print("RESULT " + out)
"""


@pytest.mark.pairs(*NEW)
@pytest.mark.parametrize("plugins,patched", [(None, True), ("ascend,ascend_kv_connector", False)], ids=["all-plugins", "left-out"])
def test_spawned_child_gets_the_310p_wait_through_vllms_plugins(plugins, patched):
    env = {} if plugins is None else {"VLLM_PLUGINS": plugins}
    out = result(run_python(SPAWN.format(here=ROOT / "tests" / "standins"), env=env))
    assert out["loaded_package"] is patched
    assert out["g310"] == ("gdn_layerwise_310p" if patched else None)
