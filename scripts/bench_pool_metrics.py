"""Cost of the pool_metrics group per engine step, against none, side by side in one process.

    .matrix/v0251/bin/python scripts/bench_pool_metrics.py [--quick]
    .matrix/v0300/bin/python scripts/bench_pool_metrics.py [--quick]

CPU, NPU runtime stood in, real vLLM + vllm-ascend objects of the installed pair (made as
tests/standins/harness_pool makes them). Per step vLLM calls ``get_kv_connector_stats`` once on
every worker (``KVConnectorModelRunnerMixin``) and once on the scheduler (``update_from_output``);
upstream's is the base class's ``return None`` on 0.25/0.26, and on vllm-ascend 0.30.0rc2 its own
(the scheduler's ``get_stats`` returns None, the worker's takes a lock and tests its own stats). Timed: a worker half and the scheduler half with
nothing to report (the steady state), the scheduler with open send events that did not change
since the last step, a step that has counts to report (a fault was counted: builds the stats), a
step while a stuck send is watched (its age read), and the load path's per-layer cost (the mamba
state bytes of a layer's load summed, then counted when its copy returned 0; only on layers with a
load). The bumps themselves sit on fault paths only. The issue's bound: at most 1 us per step.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "standins")]

BOUND_NS = 1000.0  #: the issue's budget per step for the stats collection


def per_call_ns(fn, number: int) -> float:
    return timeit.Timer(fn).timeit(number=number) / number * 1e9


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke)")
    args = parser.parse_args()
    number, repeat = (2_000, 2) if args.quick else (200_000, 7)

    from ascend_layerwise_patch import cpu_standins

    cpu_standins.install()
    import ascend_layerwise_patch as alp
    import harness_pool as hp
    from ascend_layerwise_patch import pool_events
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import ascend_store_connector

    alp.REGISTRY.apply_pending()
    conn_cls = ascend_store_connector.AscendStoreConnector
    ours = conn_cls.get_kv_connector_stats
    base = ours.__wrapped__
    marker = getattr(ours, alp.registry.MARKER, None)
    assert marker in ("pool_metrics_stats", "pool_metrics_stats_030"), "pool_metrics is not applied"
    v030 = marker.endswith("_030")  # vllm-ascend 0.30: upstream's own stats path, extended

    worker = object.__new__(conn_cls)  # __init__ needs a VllmConfig with a model and a store client
    worker.connector_scheduler = None
    if v030:  # the worker half's own stats (its get_stats: a lock and an emptiness test)
        import threading

        from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import pool_worker

        half = object.__new__(pool_worker.KVPoolWorker)
        half._kv_stats_lock = threading.Lock()
        half._kv_stats = ascend_store_connector.AscendStoreKVConnectorStats()
        worker.connector_worker = half
    sched = hp.PoolInstance(hp.make_pool()).scheduler.connector  # AscendStoreConnector, scheduler role (layerwise)

    def step_with_a_count():
        pool_events.bump("load_failed")
        ours(worker)

    cases = [
        ("worker, nothing to report", lambda: base(worker), lambda: ours(worker)),
        ("scheduler, no open send event", lambda: base(sched), lambda: ours(sched)),
    ]
    rows = []
    for name, a_fn, b_fn in cases:
        a, b = [], []
        for _ in range(repeat):  # interleaved: drift hits both sides alike
            a.append(per_call_ns(a_fn, number))
            b.append(per_call_ns(b_fn, number))
        rows.append((name, min(a), min(b)))
    if v030:  # 0.30 touches no block for a layerwise send (no send gauges); send_integrity is out of range
        a = [per_call_ns(lambda: base(worker), number // 10) for _ in range(repeat)]
        b = [per_call_ns(step_with_a_count, number // 10) for _ in range(repeat)]
        rows.append(("worker, a step with a count (bump + stats built)", min(a), min(b)))
        pool_events.drain()
        return report(rows, idle_only=True)
    cs = sched.connector_scheduler
    cs.sending_events.update({7: 0, 8: 0})
    cs.sending_blocks.update({7: list(range(1, 17)), 8: list(range(17, 33))})
    ours(sched)  # the gauges reported once; unchanged from here on
    a = [per_call_ns(lambda: base(sched), number) for _ in range(repeat)]
    b = [per_call_ns(lambda: ours(sched), number) for _ in range(repeat)]
    rows.append(("scheduler, 2 open send events (32 blocks), unchanged", min(a), min(b)))
    a = [per_call_ns(lambda: base(worker), number // 10) for _ in range(repeat)]
    b = [per_call_ns(step_with_a_count, number // 10) for _ in range(repeat)]
    rows.append(("worker, a step with a count (bump + stats built)", min(a), min(b)))

    # a stuck send is watched (send_integrity): every step reads its start and reports the age (fault path)
    class _Item:
        since = 1.0

    item = _Item()
    pool_events.watch_age("oldest_stuck_send_age_seconds", lambda: item.since)
    a = [per_call_ns(lambda: base(worker), number // 10) for _ in range(repeat)]
    b = [per_call_ns(lambda: ours(worker), number // 10) for _ in range(repeat)]
    rows.append(("worker, a stuck send watched (age read + stats built)", min(a), min(b)))
    item.since = 0.0
    ours(worker), ours(worker)  # dropped, its 0 reported: back to the steady state

    # the load path (per layer with a load, worker's receiving thread): mamba bytes summed before the
    # copy, counted after it; one GDN task + one attention task per layer, as a hybrid step has
    import types

    import numpy as np
    from ascend_layerwise_patch.patches.pool_metrics import loads

    thread = types.SimpleNamespace()
    thread.__dict__[loads._MAMBA] = frozenset({0})
    thread.__dict__[loads._BLOCK] = {(0, 0): 176}
    shared = types.SimpleNamespace(block_ids_arr=np.arange(1, 3))
    tasks = [types.SimpleNamespace(group_id=g, shared_block_data=shared, layer_idx_in_group=0) for g in (0, 1)]
    data = types.SimpleNamespace(transfer_tasks=tasks)
    copy = loads.make_batch_copy(lambda self, *a: 0)

    def handle_base(self, data):
        return None

    def handle_copy(self, data):
        return copy(self, None, None, None, 1, 0, 0)

    handle = loads.make_recv_handle(handle_copy)
    a = [per_call_ns(lambda: handle_base(thread, data), number // 10) for _ in range(repeat)]
    b = [per_call_ns(lambda: handle(thread, data), number // 10) for _ in range(repeat)]
    rows.append(("worker, one layer's load (mamba bytes summed + counted)", min(a), min(b)))
    pool_events.drain()
    return report(rows)


def report(rows, idle_only: bool = False) -> int:
    width = max(len(r[0]) for r in rows)
    print(f"{'case'.ljust(width)}  upstream ns  patched ns  added ns  ratio")
    for name, x, y in rows:
        print(f"{name.ljust(width)}  {x:11.1f}  {y:10.1f}  {y - x:8.1f}  {y / x:5.2f}x")
    # a step: every worker and the scheduler, in the steady state (nothing to report)
    worker_ns, idle_ns = (r[2] - r[1] for r in rows[:2])
    if idle_only:
        print(
            f"step, TP=1, nothing to report: {worker_ns + idle_ns:.0f} ns added "
            f"({(worker_ns + idle_ns) / BOUND_NS:.2f} of the 1 us budget); "
            f"each further TP worker {worker_ns:.0f} ns (in its own process: not on the scheduler's step)"
        )
        return 0
    open_ns = rows[2][2] - rows[2][1]
    print(
        f"step, TP=1, nothing to report: {worker_ns + idle_ns:.0f} ns added with no open send event, "
        f"{worker_ns + open_ns:.0f} ns with open ones ({(worker_ns + open_ns) / BOUND_NS:.2f} of the 1 us budget); "
        f"each further TP worker {worker_ns:.0f} ns (in its own process: not on the scheduler's step)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
