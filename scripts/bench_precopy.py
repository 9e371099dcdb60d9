"""Per-step host cost of the deferred align pre-copy (mamba_precopy) against upstream's bulk pre-copy.

    .matrix/v0251/bin/python scripts/bench_precopy.py [--quick] [--json FILE]

One process, the same rows on both sides: R requests of a GDN hybrid with L GDN layers (2 states
each) in align mode, every request with a pool load this step (every row deferred: the worst case).
A step is what the runner does for the pre-copy: ``collect_mamba_copy_meta`` once per request
(vLLM's function; with the patch, its recording wrapper), ``do_mamba_copy_block`` (upstream: one
upload and one batch copy; patched: the split, one upload, then one slice copy per GDN layer from
that layer's entry, ``copy_for_layer``). The batch-copy kernel launch (``mamba_utils.batch_memcpy``,
a Triton launcher on NPU) is a no-op here: host cost only. Also: the patched path on a step without
loads (rows recorded, bulk copy); and both patched paths with vs without the upload's event
(issue 23; ``torch.npu.Event`` stood in by its host-side calls: the wait's device time -- the
gap between the input-prep event and the upload in stream order -- is not modelled). Real vLLM 0.25.1 structures (MambaCopyBuffers, KVCacheConfig,
the GDN copy-spec functions), the NPU runtime stood in.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "standins")]


def setup(num_reqs: int, num_layers: int):
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker import mamba_utils

    bs, nb = 16, 4 * num_reqs + 4
    attn = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=bs, shapes=((8, 3), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32),
                      page_size_padded=attn.page_size_bytes, mamba_type="gdn_attention", mamba_cache_mode="align")
    names = [f"model.layers.{i}.linear_attn" for i in range(num_layers)]
    config = KVCacheConfig(num_blocks=nb, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.x.self_attn.attn"], attn), KVCacheGroupSpec(names, mamba)])
    layers = {n: SimpleNamespace(kv_cache=[torch.zeros(nb, 8, 3, dtype=torch.bfloat16), torch.zeros(nb, 2, 4, 4)]) for n in names}
    funcs = MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
    make = lambda n, dtype: CpuGpuBuffer(n, dtype=dtype, device=torch.device("cpu"), pin_memory=False)  # noqa: E731
    bufs = mamba_utils.MambaCopyBuffers.create(num_reqs, config, funcs, make)
    reqs = [SimpleNamespace(req_id=f"r{i}", block_ids=([], [0, 4 * i + 1, 4 * i + 2, 4 * i + 3])) for i in range(num_reqs)]

    import counting_connector  # a real KVConnectorBase_V1 made by vLLM's factory (tests/standins)

    connector, _config, _restore = counting_connector.install()
    connector.use_layerwise = True  # what the deferral asks of the transfer group (AscendStoreConnector has it)
    spec = SimpleNamespace(can_load=True, vllm_cached_tokens=0, kvpool_cached_tokens=32)
    loaded = SimpleNamespace(requests=[SimpleNamespace(req_id=r.req_id, load_spec=spec) for r in reqs])
    return SimpleNamespace(bufs=bufs, config=config, layers=layers, funcs=funcs, reqs=reqs, names=names,
                           connector=connector, loaded=loaded, empty=SimpleNamespace(requests=[]))


def step(s, collect, do_copy, per_layer):
    s.bufs.offset = 0
    for r in s.reqs:  # prev state block 1 (after 32 tokens) -> current block 2
        collect(s.bufs, s.config, s.funcs, [1], 1, 2, 0, r, s.layers)
    do_copy(s.bufs)
    if per_layer is not None:
        for name in s.names:
            per_layer(name)


def time_step(fn, n, repeat):
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()

    from ascend_layerwise_patch import cpu_standins

    cpu_standins.install()
    import ascend_layerwise_patch as alp  # noqa: F401
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.worker import mamba_utils

    from ascend_layerwise_patch.patches.gdn_layerwise import mamba_precopy

    import torch

    class HostEvent:  # torch.npu.Event's host-side calls (the device's time is not modelled here)
        def __init__(self, *a, **k):
            pass

        def record(self, *a):
            pass

        def synchronize(self):
            pass

    torch.npu.Event = HostEvent  # the upload's event (issue 23), as on NPU: one per runner, recorded each step
    launches = []
    mamba_utils.batch_memcpy = lambda src, dst, sizes: launches.append(len(src))  # the kernel launch: not timed
    orig_collect = getattr(mamba_utils.collect_mamba_copy_meta, "__wrapped__", mamba_utils.collect_mamba_copy_meta)
    orig_copy = getattr(mamba_utils.do_mamba_copy_block, "__wrapped__", mamba_utils.do_mamba_copy_block)
    ours_collect, ours_copy = mamba_precopy.record_rows(orig_collect), mamba_precopy.defer_loaded_rows(orig_copy)

    rows = []
    cases = [(1, 36), (8, 36), (64, 36)] if not args.quick else [(4, 8)]
    for num_reqs, num_layers in cases:
        n, repeat = (max(5, 3000 // (num_reqs * num_layers)), 5) if not args.quick else (20, 2)
        s = setup(num_reqs, num_layers)
        kv_transfer_state._KV_CONNECTOR_AGENT = s.connector
        try:
            s.connector.bind_connector_metadata(s.loaded)
            launches.clear()
            step(s, ours_collect, ours_copy, mamba_precopy.copy_for_layer)
            assert launches == [2 * num_reqs] * num_layers, launches  # every row deferred, one launch per layer
            upstream = time_step(lambda: step(s, orig_collect, orig_copy, None), n, repeat)
            deferred = time_step(lambda: step(s, ours_collect, ours_copy, mamba_precopy.copy_for_layer), n, repeat)
            s.connector.bind_connector_metadata(s.empty)
            no_load = time_step(lambda: step(s, ours_collect, ours_copy, mamba_precopy.copy_for_layer), n, repeat)
            assert getattr(s.bufs, mamba_precopy.UPLOAD_PENDING), "no upload event recorded"
            # the same patched step without the upload's event (as before issue 23): no NPU Event API
            del torch.npu.Event
            setattr(s.bufs, mamba_precopy.UPLOAD_EVENT, None)
            setattr(s.bufs, mamba_precopy.UPLOAD_PENDING, False)
            no_event = time_step(lambda: step(s, ours_collect, ours_copy, mamba_precopy.copy_for_layer), n, repeat)
            s.connector.bind_connector_metadata(s.loaded)
            deferred_no_event = time_step(lambda: step(s, ours_collect, ours_copy, mamba_precopy.copy_for_layer), n, repeat)
            assert not getattr(s.bufs, mamba_precopy.UPLOAD_PENDING)
            torch.npu.Event = HostEvent
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        rows.append({"requests": num_reqs, "gdn_layers": num_layers, "rows": 2 * num_reqs * num_layers,
                     "upstream_bulk_us": round(upstream, 2), "deferred_us": round(deferred, 2),
                     "ratio": round(deferred / upstream, 2), "patched_no_load_us": round(no_load, 2),
                     "no_load_ratio": round(no_load / upstream, 2),
                     "no_load_no_event_us": round(no_event, 2), "event_ratio_no_load": round(no_load / no_event, 2),
                     "deferred_no_event_us": round(deferred_no_event, 2),
                     "event_ratio_deferred": round(deferred / deferred_no_event, 2)})
    print("per-step host cost of the align pre-copy (collect + copy + per-layer slices), same rows, one run")
    print(f"{'reqs':>5} {'layers':>6} {'rows':>6} {'upstream us':>12} {'deferred us':>12} {'ratio':>6} {'no-load us':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r['requests']:>5} {r['gdn_layers']:>6} {r['rows']:>6} {r['upstream_bulk_us']:>12} {r['deferred_us']:>12} "
              f"{r['ratio']:>6} {r['patched_no_load_us']:>11} {r['no_load_ratio']:>6}")
    print("the upload's event (issue 23: record after the upload, synchronize before the next step's rows), host cost")
    print(f"{'reqs':>5} {'layers':>6} {'no-load us':>11} {'no event':>9} {'ratio':>6} {'deferred us':>12} {'no event':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['requests']:>5} {r['gdn_layers']:>6} {r['patched_no_load_us']:>11} {r['no_load_no_event_us']:>9} "
              f"{r['event_ratio_no_load']:>6} {r['deferred_us']:>12} {r['deferred_no_event_us']:>9} {r['event_ratio_deferred']:>6}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
