"""Hot-path overhead of the patches, patched vs unpatched, measured side by side in one process.

    .matrix/v0251/bin/python scripts/bench_hotpath.py [--quick] [--json FILE]

Runs on a CPU with the NPU runtime stood in (real vLLM 0.25.1 + vllm-ascend 0.25.1rc1). For each
per-layer entry point it times the unpatched original and the installed replacement, interleaved,
and reports ns per call, the ns added and the ratio:
- wait_for_kv_layer_from_connector / maybe_save_kv_layer_to_connector: no connector (the common
  case), connector with metadata bound (the hot case), connector without metadata (dummy runs:
  here the patch *removes* the connector call, which is the point);
- the GDN ``_forward_core`` entry: the replacement's own work (wait + fence + call) around an empty
  core, against calling that empty core directly -- the real core runs NPU kernels -- and against
  the same required calls written inline (the wrapper's own overhead).
Also: ``import ascend_layerwise_patch`` time (fresh interpreters) and the time to apply every patch
once the targets are imported.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "standins")]


def per_call_ns(fn, args, number, repeat):
    # a statement, not a lambda: the timed loop makes exactly one call of ``fn`` per iteration
    names = {f"a{i}": a for i, a in enumerate(args)}
    timer = timeit.Timer(f"fn({', '.join(names)})", globals={"fn": fn, **names})
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e9


def compare(name, original, patched, args, number, repeat, rows):
    # interleave so drift hits both sides alike; keep the best of each
    a, b = [], []
    for _ in range(repeat):
        a.append(per_call_ns(original, args, number, 1))
        b.append(per_call_ns(patched, args, number, 1))
    base, ours = min(a), min(b)
    rows.append({"case": name, "unpatched_ns": round(base, 1), "patched_ns": round(ours, 1),
                 "added_ns": round(ours - base, 1), "ratio": round(ours / base, 3)})


def import_cost(runs: int) -> dict:
    """Median import time in fresh interpreters, with bytecode cached as in an installed package
    (a PYTHONDONTWRITEBYTECODE=1 environment would otherwise recompile every module each run; the
    first, compiling run is not counted)."""
    code = "import time; t=time.perf_counter(); import ascend_layerwise_patch; print((time.perf_counter()-t)*1e3)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    times = []
    for i in range(runs + 1):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True)
        if i:
            times.append(float(out.stdout.strip().splitlines()[-1]))
    return {"import_ms_median": round(statistics.median(times), 2), "import_ms_min": round(min(times), 2)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    number, repeat = (2_000, 3) if args.quick else (200_000, 7)

    from ascend_layerwise_patch import cpu_standins

    cpu_standins.install()
    import ascend_layerwise_patch as alp

    importlib.import_module("vllm_ascend.ops")
    utils = importlib.import_module("vllm_ascend.attention.utils")
    importlib.import_module("vllm_ascend.ops.gdn")
    for spec in alp.REGISTRY.specs:  # every target imported first: time the patching alone
        try:
            importlib.import_module(spec.module)
        except ImportError:
            pass
    for place in [p["place"] for st in alp.status() for p in st.places]:  # and every module holding a copy
        try:
            importlib.import_module(place.partition(":")[0])
        except ImportError:
            pass
    t0 = time.perf_counter()
    alp.revert()
    alp.activate(environ={})
    alp.REGISTRY.apply_pending()
    apply_ms = (time.perf_counter() - t0) * 1e3
    from ascend_layerwise_patch.patches.gdn_layerwise import join_layerwise
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.forward_context import set_forward_context

    import counting_connector

    wait, save = utils.wait_for_kv_layer_from_connector, utils.maybe_save_kv_layer_to_connector
    wait0, save0 = wait.__wrapped__, save.__wrapped__

    def empty_core(self, mixed_qkv, b, a, core_attn_out):
        return None

    entry = join_layerwise(empty_core)
    layer = type("Layer", (), {"prefix": "model.layers.0.linear_attn"})()
    fence = importlib.import_module("vllm_ascend.memcache_comm_fence")

    state = importlib.import_module("vllm.distributed.kv_transfer.kv_transfer_state")

    def mandated(self, mixed_qkv, b, a, core_attn_out):
        # the calls the fix requires, made inline: what the entry costs at the very least
        if state._KV_CONNECTOR_AGENT is not None:
            utils.wait_for_kv_layer_from_connector(self.prefix)
            fence.record_attention_compute_start()
        return empty_core(self, mixed_qkv, b, a, core_attn_out)

    rows: list[dict] = []

    compare("wait, no connector", wait0, wait, ("l0",), number, repeat, rows)
    compare("save, no connector", save0, save, ("l0", []), number, repeat, rows)
    compare("gdn entry, no connector", empty_core, entry, (layer, None, None, None, None), number, repeat, rows)
    compare("gdn entry vs its two calls inline, no connector", mandated, entry, (layer, None, None, None, None), number, repeat, rows)

    connector, config, restore = counting_connector.install()
    connector.wait_for_layer_load = lambda name: None  # the cheapest possible connector: overhead only
    connector.save_kv_layer = lambda *a, **k: None
    try:
        with set_forward_context({"l0": object()}, config, slot_mapping={}):
            connector.bind_connector_metadata(KVConnectorMetadata())
            compare("wait, metadata bound", wait0, wait, ("l0",), number, repeat, rows)
            compare("save, metadata bound", save0, save, ("l0", []), number, repeat, rows)
            compare("gdn entry, metadata bound", empty_core, entry, (layer, None, None, None, None), number, repeat, rows)
            compare("gdn entry vs its two calls inline, metadata bound", mandated, entry, (layer, None, None, None, None), number, repeat, rows)
            connector.clear_connector_metadata()
            compare("wait, no metadata (dummy run)", wait0, wait, ("l0",), number, repeat, rows)
    finally:
        restore()

    result = {"calls": rows, "apply_all_ms": round(apply_ms, 2), **import_cost(3 if args.quick else 15)}
    width = max(len(r["case"]) for r in rows)
    print(f"{'case'.ljust(width)}  unpatched ns  patched ns  added ns  ratio")
    for r in rows:
        print(f"{r['case'].ljust(width)}  {r['unpatched_ns']:12.1f}  {r['patched_ns']:10.1f}  {r['added_ns']:8.1f}  {r['ratio']:5.2f}x")
    print(f"import ascend_layerwise_patch: median {result['import_ms_median']} ms (min {result['import_ms_min']} ms)")
    print(f"apply every patch with targets imported: {result['apply_all_ms']} ms")
    if args.quick:
        print("quick run (CI smoke, few iterations, CPU): the times and ratios above are not judged -- only "
              "that every case runs; docs/measured.md's figures come from a full run")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
