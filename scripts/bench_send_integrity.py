"""Cost of the send-integrity change, patched vs unpatched, side by side in one process.

    .matrix/v0251/bin/python scripts/bench_send_integrity.py [--quick]

CPU, NPU runtime stood in, real vLLM 0.25.1 + vllm-ascend 0.25.1rc1 objects (made as
tests/standins/harness_pool makes them). Scheduler side -- the only scheduler code this change
adds is ``AscendStoreConnector.has_pending_push_work``, which vLLM's ``Scheduler.has_requests()``
consults (after ``has_unfinished_requests()`` and ``has_finished_requests()``, so only when no
request is left) from ``EngineCoreProc.has_work()`` and ``EngineCore.step()``: timed with no open
send event and with open events (the idle steps it asks for). Worker side, for the record:
``save_kv_layer`` for a layer with nothing to save, ``build_connector_worker_meta``, and the save
copy of one layer (16 blocks, 16 new keys) with its slot bookkeeping against a no-op store.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "standins")]


def per_call_ns(stmt_fn, number: int) -> float:
    return min(timeit.Timer(stmt_fn).repeat(repeat=1, number=number)) / number * 1e9


def compare(name, base, ours, number, repeat, rows):
    a, b = [], []
    for _ in range(repeat):  # interleaved: drift hits both sides alike
        a.append(per_call_ns(base, number))
        b.append(per_call_ns(ours, number))
    x, y = min(a), min(b)
    rows.append((name, x, y))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke)")
    args = parser.parse_args()
    number, repeat = (2_000, 2) if args.quick else (200_000, 7)

    from ascend_layerwise_patch import cpu_standins

    cpu_standins.install()
    import ascend_layerwise_patch as alp
    import harness_pool as hp
    from ascend_layerwise_patch.patches.mamba_lifetime import send_integrity
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import ascend_store_connector, pool_worker

    alp.REGISTRY.apply_pending()
    rows: list[tuple[str, float, float]] = []

    # ---- scheduler side: has_pending_push_work on a real AscendStoreConnector / KVPoolScheduler
    conn_cls = ascend_store_connector.AscendStoreConnector
    ours = conn_cls.has_pending_push_work
    base = ours.__wrapped__
    inst = hp.PoolInstance(hp.make_pool())
    sched = inst.scheduler
    conn = sched.connector  # the instance's AscendStoreConnector, scheduler role
    cs = conn.connector_scheduler

    # ---- through vLLM's real Scheduler.has_requests() (what EngineCoreProc.has_work() and
    # EngineCore.step() call), no request left: the only scheduler path this change adds to

    for label, events in (("no open send event", {}), ("open events (idle steps)", {1: 0})):
        cs.sending_events.clear()
        cs.sending_events.update(events)
        a, b = [], []
        for _ in range(repeat):
            conn_cls.has_pending_push_work = base
            a.append(per_call_ns(sched.has_requests, number))
            conn_cls.has_pending_push_work = ours
            b.append(per_call_ns(sched.has_requests, number))
        rows.append((f"scheduler: Scheduler.has_requests(), {label}", min(a), min(b)))
    cs.sending_events.clear()

    # ---- the connector method itself (after the above: the open events it is given never complete)
    compare("scheduler: has_pending_push_work, no open send event", lambda: base(conn), lambda: ours(conn), number, repeat, rows)
    cs.sending_events.update({7: 0, 8: 0})
    compare("scheduler: has_pending_push_work, open events (idle steps)", lambda: base(conn), lambda: ours(conn), number, repeat, rows)
    cs.sending_events.clear()

    # ---- worker side
    w = inst.ranks[0].connector.connector_worker  # TP rank 0's KVPoolWorker, its sending thread started
    save, save0 = pool_worker.KVPoolWorker.save_kv_layer, pool_worker.KVPoolWorker.save_kv_layer.__wrapped__
    meta0 = pool_worker.KVPoolWorker.build_connector_worker_meta.__wrapped__
    meta = pool_worker.KVPoolWorker.build_connector_worker_meta
    send_integrity.bind(w)

    def layer(fn):
        def run():
            w.current_layer = 0  # layer 0 of 4, nothing to save: not the step's last layer
            fn(w, None)

        return run

    compare("worker: save_kv_layer, a layer with nothing to save", layer(save0), layer(save), number, repeat, rows)
    compare("worker: build_connector_worker_meta", lambda: meta0(w), lambda: meta(w), number, repeat, rows)

    # one layer's save copy, 16 blocks / 16 new keys, against a store that does nothing
    thread = w.kv_send_thread
    copy = type(thread)._batch_copy_with_limits
    copy0 = copy.__wrapped__
    thread.m_store = type("NoStore", (), {"store": type("S", (), {"batch_copy": staticmethod(lambda *a: 0)})()})()
    keys = [f"m@1@{i:032x}@0" for i in range(16)]
    gvas = np.arange(1, 17, dtype=np.int64) << 20
    w._allocated_gvas.update(zip(keys, gvas.tolist()))
    shared = type("Shared", (), {})()
    shared.save_keys, shared.block_gvas_arr = keys, gvas
    task = type("Task", (), {"shared_block_data": shared, "group_id": 1, "layer_idx_in_group": 0, "layer_id": 0})()
    ledger = thread.__dict__[send_integrity.LEDGER]
    ledger.begin([task], thread.final_layer_id)
    sizes = np.ones(16, dtype=np.int64)
    compare(
        "send thread: a layer copy of 16 blocks (not the group's first)",
        lambda: copy0(thread, gvas, gvas, sizes, 0, 0, 0),
        lambda: copy(thread, gvas, gvas, sizes, 0, 0, 0),
        number // 10,
        repeat,
        rows,
    )
    ledger.end()

    width = max(len(r[0]) for r in rows)
    print(f"{'case'.ljust(width)}  unpatched ns  patched ns  added ns")
    for name, x, y in rows:
        print(f"{name.ljust(width)}  {x:12.1f}  {y:10.1f}  {y - x:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
