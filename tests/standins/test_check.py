"""``ascend-layerwise-patch check`` as a CI gate and an operator run it (issue 13): through the
console script the README gives, against the real vLLM / vllm-ascend of the pair.

``check --cpu`` imports everything (~10-20 s on the CI box), so one run is asserted on for the
text output and one for ``--json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import PAIR, ROOT, _child_env, expected_states, run_cli, run_python

ALL_PAIRS = ("v0251", "v0250", "v0240", "v0260", "v0300", "v0290")

#: the copies of the connector helpers issue 13 lists for vllm-ascend 0.25.1rc1
SAVE_COPIES = (
    "vllm_ascend.ops.gdn",
    "vllm_ascend.attention.mla_v1",
    "vllm_ascend.attention.sfa_v1",
    "vllm_ascend.attention.dsa_v1",
    "vllm_ascend.attention.context_parallel.dsa_cp",
    "vllm_ascend._310p.ops.fla.gdn_310",
)
SUMMARY = "ascend_layerwise_patch [vllm "


@pytest.mark.pairs(*ALL_PAIRS)
@pytest.mark.control("check's refusal before any patch is tried: no NPU runtime")
def test_check_without_the_npu_runtime_fails_in_one_line():
    """Point 1: no torch_npu and no --cpu is no check at all; a CI gate must not pass on it."""
    proc = run_cli("check")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "NPU runtime is missing" in lines[0] and "--cpu" in lines[0], proc.stderr
    assert proc.stdout == ""
    doc = json.loads(run_cli("check", "--json").stdout)
    assert "NPU runtime is missing" in doc["error"] and doc["versions"]["vllm"]


@pytest.mark.pairs(*ALL_PAIRS)
@pytest.mark.control("check's refusal of a bad switch, before any patch is tried")
def test_check_names_an_unknown_skip_entry_and_the_valid_names():
    """Point 3: a typo in ASCEND_LAYERWISE_PATCH_SKIP must not leave the patch it meant silently on."""
    proc = run_cli("check", "--cpu", env={"ASCEND_LAYERWISE_PATCH_SKIP": "guard_wiat,gdn_layerwise"})
    assert proc.returncode == 1
    assert "names no patch or group: guard_wiat " in proc.stderr
    assert "valid patches: guard_wait, guard_save, " in proc.stderr and "valid groups: connector_guards, " in proc.stderr
    doc = json.loads(run_cli("check", "--cpu", "--json", env={"ASCEND_LAYERWISE_PATCH_SKIP": "guard_wiat"}).stdout)
    assert "guard_wiat" in doc["error"]


@pytest.mark.pairs("v0251", "v0250")
def test_a_serving_process_logs_an_unknown_skip_entry_as_an_error():
    standins = f"import runpy; runpy.run_path(r'{ROOT / 'ascend_layerwise_patch' / 'cpu_standins.py'}')['install']()\n"
    code = standins + "import ascend_layerwise_patch\nfrom vllm.plugins import load_general_plugins\nload_general_plugins()\n"
    proc = run_python(code, env={"ASCEND_LAYERWISE_PATCH_SKIP": "guard_wiat"})
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR ") and "guard_wiat" in line]
    assert len(errors) == 1 and "valid patches: guard_wait" in errors[0], proc.stdout[-3000:]
    strict = run_python(code, env={"ASCEND_LAYERWISE_PATCH_SKIP": "guard_wiat", "ASCEND_LAYERWISE_PATCH_STRICT": "1"}, check=False)
    assert strict.returncode != 0 and "PatchError" in strict.stderr and "guard_wiat" in strict.stderr


@pytest.mark.pairs("v0251")
def test_check_sh_says_what_it_does_shows_every_copy_explains_triton_and_settles():
    """The README's first command, end to end (its environments already built by the matrix)."""
    env = {"ALP_MATRIX_DIR": str(Path(sys.prefix).parent)}
    proc = subprocess.run(["bash", "scripts/check.sh", "--verbose"], cwd=ROOT, env=_child_env(env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    # Point 9: one line per step, before the long silent parts.
    steps = [line for line in lines if line.startswith(("check.sh: ", "env: "))]
    assert [s.split(":")[0] for s in steps] == ["check.sh", "env", "env", "check.sh"], steps
    # Point 2: every copy of the save helper has its own row and state (--verbose).
    rows = {tuple(line.split()[:3]) for line in lines if line.startswith("  copy ")}
    for module in SAVE_COPIES:
        assert ("copy", "applied", f"{module}:maybe_save_kv_layer_to_connector") in rows, module
    # Issue 36: check's own lines fit 100 columns (vLLM's log lines are vLLM's), the INFO summary 200.
    own = lines[lines.index(next(line for line in lines if line.startswith("ascend-layerwise-patch check: "))) :]
    assert max(len(line) for line in own) <= 100, max(own, key=len)
    assert own[-1] == "ok: every patch that this pair needs is in force; serve as usual", own[-3:]
    # Point 9: the stand-in's Triton lines are followed by one line saying they are expected.
    note = [i for i, line in enumerate(lines) if "expected under --cpu" in line]
    triton = [i for i, line in enumerate(lines) if line.startswith(("WARNING", "ERROR")) and "riton" in line]
    assert triton and len(note) == 1 and note[0] > max(triton), proc.stdout[-4000:]
    # Point 6: one summary line, logged once nothing is pending.
    summaries = [line for line in lines if SUMMARY in line]
    assert len(summaries) == 1 and "pending" not in summaries[0] and summaries[0].endswith(", 0 failed"), summaries
    assert len(summaries[0]) < 200, summaries


@pytest.mark.pairs(*ALL_PAIRS)
def test_check_json_records_every_place_with_its_state():
    proc = run_cli("check", "--cpu", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    patches = {p["name"]: p for p in doc["patches"]}
    states = {name: p["state"] for name, p in patches.items()}
    # issue 24: every patch's state is the one scripts/expected_states.txt gives for this pair
    es = expected_states()
    got = {p["name"]: es.code_of(p["state"], p["reason"]) for p in doc["patches"]}
    want = {name: codes[PAIR] for name, codes in es.load()[1].items()}
    assert got == want, {name: (got.get(name), want.get(name)) for name in {*got, *want} if got.get(name) != want.get(name)}
    for p in doc["patches"]:
        assert p["places"][0] == {"place": p["target"], "role": "target", "state": p["state"], "reason": p["reason"]}
    if PAIR == "v0251":
        assert {states[n] for n in ("guard_wait", "guard_save", "gdn_layerwise")} == {"applied"}
        assert {states[n] for n in ("pool_layout_scheduler", "pool_layout_worker", "pool_gva_cache")} == {"applied"}
        # issue 22: check says that PP > 1 is refused with the layerwise pool (JSON and table)
        assert "PP > 1 refused at start-up" in patches["pool_layout_worker"]["why"]
        table = run_cli("check", "--cpu", "--verbose").stdout.split("\npool_layout_worker (pool_key_layout): applied\n", 1)[1]
        block = " ".join(line.strip() for line in table.split("\npool_gva_cache (", 1)[0].splitlines())
        assert "PP > 1 refused at start-up" in block, block
        places = {q["place"]: q["state"] for q in patches["guard_save"]["places"]}
        assert {f"{m}:maybe_save_kv_layer_to_connector" for m in SAVE_COPIES} <= set(places)
        assert {places[f"{m}:maybe_save_kv_layer_to_connector"] for m in SAVE_COPIES} == {"applied"}
        assert not [q for p in doc["patches"] for q in p["places"] if q["state"] in ("pending", "failed")]
        assert states["async_free_fence"] == "applied"  # issue 23: vLLM defers frees for kv_consumer only
    elif PAIR == "v0250":
        assert states["async_free_fence"] == "applied"  # issue 23: vLLM 0.25.0 has the same consumer-only fence
        assert states["guard_wait"] == "applied" and states["gdn_layerwise"] == "skipped"
        gdn_copy = {q["place"]: q for q in patches["guard_save"]["places"]}["vllm_ascend.ops.gdn:maybe_save_kv_layer_to_connector"]
        assert gdn_copy["state"] == "skipped" and "does not import" in gdn_copy["reason"]
    elif PAIR == "v0260":  # vllm-ascend 0.26.0rc1's kernel already has the 23 parameters: left in place
        kernel = patches["postprocess_kernel"]
        assert kernel["state"] == "skipped" and "fixed upstream" in kernel["reason"], kernel
        swapped = [
            p["name"]
            for p in doc["patches"]
            if p["state"] == "applied"
            and any(t.endswith(":postprocess_mamba_fused_kernel") for t in [p["target"], *p["aliases"]])
        ]
        assert swapped == []
        from ascend_layerwise_patch.patches import connector_guards, gdn_layerwise, mamba_lifetime

        widened = [s.name for m in (connector_guards, gdn_layerwise, mamba_lifetime) for s in m.SPECS if not s.name.endswith("_030")]
        assert {states[n] for n in [*widened, "postprocess_v2_out_buffer"]} == {"applied"}, states
        # issue 15: the pool-correctness groups where their defects persist on 0.26
        from ascend_layerwise_patch.patches import (
            gdn_tp_keys,
            load_failures,
            mamba_local_hit,
            mamba_pool_hit,
            mamba_precopy,
            pool_key_layout,
        )

        fixed = {"send_integrity_copy", "gdn_tp_finish"}
        groups = (mamba_precopy, mamba_pool_hit, gdn_tp_keys, mamba_local_hit, pool_key_layout)  # issue 22: pool_key_layout
        pool = [s.name for m in groups for s in m.SPECS if s.name not in fixed and not s.name.endswith("_030")]  # vouched: 0.30
        assert {states[n] for n in [*pool, "send_integrity_own_arrays", "send_integrity_idle_steps"]} == {"applied"}, states
        # issue 23: the send backlog bound is declared for 0.25 only (test_send_shedding.py says why)
        assert patches["send_shedding"]["state"] == "skipped" and "out of range" in patches["send_shedding"]["reason"]
        for name in fixed:
            assert patches[name]["state"] == "skipped" and patches[name]["reason"].startswith("already fixed upstream"), patches[name]
        assert states["async_free_fence"] == "applied"  # issue 23: vLLM 0.26.0's fence is consumer-only too
        for spec in load_failures.SPECS:
            assert patches[spec.name]["state"] == "skipped" and "version out of range" in patches[spec.name]["reason"]
    elif PAIR in ("v0300", "v0290"):
        # issue 25: vllm-ascend 0.30.0rc2 (on vLLM 0.30.0 and 0.29.0) fixed most of it: what it fixed, what
        # applies, and that every other patch (declared for 0.25 / 0.26 only: 0.30 reworked those targets,
        # or for vLLM 0.30 only) is out of range, is this pair's column of scripts/expected_states.txt
        column = {name: codes[PAIR] for name, codes in es.load()[1].items()}
        expected = {n: "applied" if code == "applied" else "skipped" for n, code in column.items()}
        assert states == expected, {n: (s, patches[n]["reason"]) for n, s in states.items() if expected.get(n) != s}
        fixed = [n for n, code in column.items() if code == "fixed"]
        assert fixed, column
        for name in fixed:
            assert patches[name]["reason"].startswith("already fixed upstream"), patches[name]
        for name, state in states.items():
            if state == "skipped" and name not in fixed:  # "ported: ... (version out of range: ...)" too
                assert "version out of range" in patches[name]["reason"], patches[name]
    else:
        assert set(states.values()) == {"skipped"}


@pytest.mark.pairs("v0251", "v0250")
def test_a_copy_that_cannot_be_patched_fails_its_group():
    """Point 2: a copy holding someone else's function is not silence: the group comes off and fails."""
    standins = f"import runpy; runpy.run_path(r'{ROOT / 'ascend_layerwise_patch' / 'cpu_standins.py'}')['install']()\n"
    proc = run_python(
        standins
        + """
import json
import vllm_ascend.ops
import vllm_ascend.attention.utils as u, vllm_ascend.attention.mla_v1 as mla
def not_the_helper(layer_name):  # another library's wrapper, left in one copy
    return None
mla.wait_for_kv_layer_from_connector = not_the_helper
import ascend_layerwise_patch as alp
st = {s.name: s for s in alp.status()}
print("RESULT " + json.dumps({
    "wait": st["guard_wait"].state, "reason": st["guard_wait"].reason, "save": st["guard_save"].reason,
    "patched": hasattr(u.wait_for_kv_layer_from_connector, "__ascend_layerwise_patch__"),
    "mla": {p["place"]: p["state"] for p in st["guard_wait"].places}["vllm_ascend.attention.mla_v1:wait_for_kv_layer_from_connector"],
}))
"""
    )
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT ") :])
    assert out["wait"] == "failed" and "mla_v1:wait_for_kv_layer_from_connector holds __main__.not_the_helper" in out["reason"]
    assert out["save"] == "group connector_guards left unpatched: guard_wait failed"
    assert out["patched"] is False and out["mla"] == "failed"


@pytest.mark.pairs("v0251")
def test_a_worker_logs_the_summary_once_its_targets_are_in_not_before():
    """Point 6 in a serving process: a worker of a non-310P NPU imports vllm-ascend's worker patches,
    the attention helpers and the AscendStore pool, never the 310P GDN module. One summary line,
    logged once that is done (not at activation, not only at exit), the 310P group pending."""
    standins = f"import runpy; runpy.run_path(r'{ROOT / 'ascend_layerwise_patch' / 'cpu_standins.py'}')['install']()\n"
    proc = run_python(
        standins
        + """
import ascend_layerwise_patch
print("IMPORTED", flush=True)
import vllm_ascend.patch.worker, vllm_ascend.attention.utils
import vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector
import vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.memcache_backend  # the backend it is configured with
print("END", flush=True)
"""
    )
    lines = proc.stdout.splitlines()
    summaries = [i for i, line in enumerate(lines) if SUMMARY in line]
    assert len(summaries) == 1, proc.stdout[-3000:]
    assert lines.index("IMPORTED") < summaries[0] < lines.index("END"), proc.stdout[-3000:]
    table = expected_states().load()[1].values()
    applied = sum(codes[PAIR] == "applied" for codes in table) - 1  # all but the 310P one
    fixed = sum(codes[PAIR] == "fixed" for codes in table)
    assert f"]: {applied} applied, {fixed} fixed upstream, " in lines[summaries[0]], lines[summaries[0]]
    assert lines[summaries[0]].endswith(" 0 failed, 1 pending; pending: gdn_layerwise_310p")
    assert len(lines[summaries[0]]) < 200, lines[summaries[0]]  # vLLM's prefix included, lines[summaries[0]]
