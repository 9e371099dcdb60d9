"""Driving an instance: :func:`engine_loop` (EngineCoreProc's loop), the run without the pool a test
compares with (:func:`reference_outputs`, :func:`differing_tokens`), and :func:`groups_skipped`."""

from __future__ import annotations

import time
from contextlib import contextmanager as _contextmanager

from .instance import PoolInstance
from .runtime import setup_runtime


@_contextmanager
def groups_skipped(*groups: str):
    """Every target imported (:func:`setup_runtime`) and the library re-activated with ``groups`` skipped;
    afterwards re-activated as this process's environment says (``support.activate_skipping``)."""
    from support import activate_skipping

    setup_runtime()
    activate_skipping(*groups)
    try:
        yield
    finally:
        activate_skipping()


def reference_outputs(requests: dict[str, list[int]], max_tokens: int = 1, **kwargs) -> dict[str, list[int]]:
    """The tokens a run without the pool samples for each prompt (the same stand-in model)."""
    inst = PoolInstance(None, name="reference", **kwargs)
    for req_id, prompt in requests.items():
        inst.add_request(req_id, prompt, max_tokens=max_tokens)
    engine_loop(inst)
    return {req_id: list(inst.outputs.get(req_id, [])) for req_id in requests}


def differing_tokens(outputs: dict[str, list[int]], reference: dict[str, list[int]]) -> int:
    """How many of ``reference``'s tokens ``outputs`` does not have at their place."""
    return sum(sum(x != y for x, y in zip(outputs.get(r, []), ref)) + max(0, len(ref) - len(outputs.get(r, []))) for r, ref in reference.items())


def engine_loop(inst: PoolInstance, *, max_steps: int = 1000, on_step=None) -> int:
    """Step ``inst`` exactly as ``EngineCoreProc.run_busy_loop`` does: only while it has work.

    Returns the number of steps taken. ``on_step(inst, scheduler_output)`` runs after each step.
    """
    n = 0
    while inst.has_work() and n < max_steps:
        so = inst.step()
        n += 1
        if on_step is not None:
            on_step(inst, so)
        if so is not None and not so.total_num_scheduled_tokens and inst.has_work():
            time.sleep(0.001)  # EngineCoreProc._process_engine_step: no model run, still has requests
    return n


def hit_after_chunked_prefill(pool) -> tuple[PoolInstance, dict[str, int]]:
    """A prefills 16 blocks + 5 tokens in 4-block chunks (GDN states saved at 64, 128, 192, 256); B,
    on the same pool, hits all 16 blocks. Returns B and the bytes B's loads read from each of the GDN
    group's keys (``mamba_pool_resume_load``'s scenario: how many chunk-end states a hit loads)."""
    from byte_store import G2L

    prompt = list(range(8000, 8000 + 16 * 16 + 5))
    a = PoolInstance(pool, name="A", max_num_batched_tokens=64, long_prefill_token_threshold=64)
    a.add_request("a", prompt, max_tokens=1)
    engine_loop(a)
    b = PoolInstance(pool, name="B")
    group = str(b.group_of[b.gdn_layers[0]])
    pool.key_bytes[G2L].clear()
    b.add_request("b", prompt[:256] + [1, 2, 3], max_tokens=1)
    engine_loop(b)
    return b, {k: n for k, n in pool.key_bytes[G2L].items() if k.split("@")[1] == group}
