"""Liveness soak (issue 23): a slow store and a whole workload on one PoolInstance, measured every step."""

from __future__ import annotations

import threading
import time

import byte_store
from byte_store import PoolService

from . import timing
from .instance import PoolInstance


def slow_store(pool: PoolService, *, seed: int, factor=(1.5, 6.0), hang_p: float = 0.03, hang_s: float = 0.5, match=None):
    """Every matching save copy takes ``factor`` x save_kv_layer's (scaled) wait; ``hang_p`` of them
    hang ``hang_s`` instead (several forward steps). Returns the fault (``.gate.set()`` ends every
    delay at once)."""
    import random

    rng, lock, wait_s = random.Random(seed), threading.Lock(), 10.0 * timing.TIME_SCALE

    def delay() -> float:
        with lock:
            return hang_s if rng.random() < hang_p else rng.uniform(*factor) * wait_s

    return pool.add_fault("delay", direction=byte_store.L2G, match=match, delay=delay)


#: The soak scenarios of issue 23, at the issue's sizes: name -> (PoolInstance kwargs, soak kwargs,
#: slow_store kwargs). tests/standins/test_send_shedding.py runs them smaller, scripts/soak_shedding.py
#: at these sizes over several seeds.
SOAK_SCENARIOS = {
    # 60 requests of 20-300 prompt tokens, 16 running, a 240-block pool
    "slow": (dict(num_blocks=240, max_num_seqs=16), dict(requests=60, prompt=(20, 300), output=(1, 4)), {}),
    # preemption and aborts: 110 blocks, 40-260-token prompts, 16-80 output tokens, 12 running
    "preempt": (
        dict(num_blocks=110, max_num_seqs=12),
        dict(requests=60, prompt=(40, 260), output=(16, 80), abort_p=0.05),
        {},
    ),
    # TP=2, only rank 1's store slow (keys end @<rank> at TP = KV heads), rank 0's fast
    "tp2": (
        dict(num_blocks=240, max_num_seqs=16, tp=2, kv_heads=2),
        dict(requests=60, prompt=(20, 300), output=(1, 4)),
        dict(match=lambda key: key.endswith("@1")),
    ),
}


def soak(
    inst: PoolInstance,
    *,
    seed: int,
    requests: int = 60,
    prompt=(20, 300),
    output=(1, 4),
    shared_prefix: float = 0.25,
    abort_p: float = 0.0,
    deadline_s: float = 60.0,
    on_finished=None,
) -> dict:
    """Serve ``requests`` random prompts (a ``shared_prefix`` share of them reuse an earlier prompt's
    first 64 tokens: prefix hits, loads) on ``inst`` with EngineCoreProc's loop (steps while
    ``has_work()``), aborting a running request with ``abort_p`` per step, until the loop stops by
    itself or ``deadline_s`` passed. ``on_finished(inst)`` runs once, at the step after which no
    request is left (e.g. to let a slow store catch up). Every step: block references and blocks
    held by open send events, blocks in use, unfinished requests, and no held block free (a send
    reading a freed block). Returns the figures."""
    import random

    from vllm.v1.request import RequestStatus

    rng = random.Random(seed)
    sched = inst.scheduler
    cs = sched.connector.connector_scheduler if sched.connector is not None else None
    bp = sched.kv_cache_manager.block_pool
    prompts: list[list[int]] = []
    for i in range(requests):
        n = rng.randint(*prompt)
        toks = [rng.randrange(1000, 60000) for _ in range(n)]
        if prompts and rng.random() < shared_prefix:
            head = rng.choice(prompts)[:64]
            toks = head + toks[len(head) :] if n > len(head) else toks
        prompts.append(toks)
        inst.add_request(f"s{seed}-{i}", toks, max_tokens=rng.randint(*output))
    f = dict(steps=0, held_refs_max=0, held_blocks_max=0, used_max=0, preempted=0, aborted=0, freed_while_held=0)
    trace: list[tuple[float, int, int, int]] = []  # (t, held block refs, blocks in use, unfinished)
    start = f["_start"] = time.monotonic()
    while inst.has_work() and time.monotonic() - start < deadline_s:
        if abort_p and sched.running and rng.random() < abort_p:
            sched.finish_requests(rng.choice(sched.running).request_id, RequestStatus.FINISHED_ABORTED)
            f["aborted"] += 1
        so = inst.step()
        f["steps"] += 1
        if so is not None and so.preempted_req_ids:
            f["preempted"] += len(so.preempted_req_ids)
        refs = blocks = 0
        if cs is not None:
            held = [b for ids in cs.sending_blocks.values() for b in ids]
            refs, blocks = len(held), len(set(held))
            f["freed_while_held"] += sum(1 for b in held if bp.blocks[b].ref_cnt <= 0)
        used = bp.num_gpu_blocks - 1 - bp.get_num_free_blocks()
        unfinished = sched.get_num_unfinished_requests()
        trace.append((time.monotonic() - start, refs, used, unfinished))
        f["held_refs_max"] = max(f["held_refs_max"], refs)
        f["held_blocks_max"] = max(f["held_blocks_max"], blocks)
        f["used_max"] = max(f["used_max"], used)
        if not unfinished and "finished_s" not in f:
            f["finished_s"] = time.monotonic() - start
            if on_finished is not None:
                on_finished(inst)
        if so is not None and not so.total_num_scheduled_tokens and inst.has_work():
            time.sleep(0.001)  # EngineCoreProc: no model run, still has work
    f["stopped_s"] = time.monotonic() - start
    f["stopped"] = not inst.has_work()
    f["unfinished"] = sched.get_num_unfinished_requests()
    f["held_refs"] = sum(len(ids) for ids in cs.sending_blocks.values()) if cs is not None else 0
    f["open_events"] = len(cs.sending_events) if cs is not None else 0
    f["used"] = bp.num_gpu_blocks - 1 - bp.get_num_free_blocks()
    f["num_blocks"] = bp.num_gpu_blocks - 1
    if inst.pool is not None:
        with inst.pool.lock:
            writes = [t for blob in inst.pool.blobs.values() for _o, _n, t, ok in blob.writes if ok]
        f["last_write_s"] = max(writes) - start if writes else None
    f["trace"] = trace
    return f
