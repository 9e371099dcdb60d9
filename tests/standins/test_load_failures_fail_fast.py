"""vllm-ascend 0.26.0rc1 stops the engine on a failed hybrid layerwise load (fail-fast by design):
the keys the failing step saved never become ready before it stops.

Harness: tests/standins/harness_pool. Instance A fills the pool with a 40-token prompt; B hits its
first 32 tokens for a prompt with 16 new tokens after them (so the failing step saves a full block of
each group), and its load of the last GDN or the last attention layer (the final layer: every
earlier layer's save is already queued) fails: the copy returns an error, raises, or the key is
evicted between the scheduler's hit check and the worker's load. ``load_failures`` is out of range
here (skipped); nothing of this library changes the stop.
"""

from __future__ import annotations

import time

import pytest

from support import PAIR

PAIRS = ("v0260",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from byte_store import G2L  # noqa: E402
from harness_pool import PoolInstance, engine_loop, make_pool  # noqa: E402

pytestmark = [pytest.mark.pairs(*PAIRS), pytest.mark.control("vllm-ascend 0.26.0rc1's own fail-fast stop: nothing of this library changes it (load_failures is out of range)")]

PROMPT = list(range(3000, 3040))
B_PROMPT = PROMPT[:32] + list(range(6000, 6016)) + [1, 2, 3, 4, 5]


@pytest.mark.parametrize("fault,layer", [("error", "gdn"), ("raise", "attn"), ("evict", "gdn")])
def test_failing_step_keys_never_become_ready(fault, layer):
    pool = make_pool()
    a = PoolInstance(pool, name="A")
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    b = PoolInstance(pool, name="B")  # policy fail (vllm-ascend refuses recompute for hybrids)
    group = str(b.group_of[(b.gdn_layers if layer == "gdn" else b.attn_layers)[-1]])
    in_group = lambda key: key.split("@")[1] == group  # noqa: E731
    if fault == "evict":

        def evict(inst, _so):
            if inst.steps == 0:
                assert pool.evict(lambda key: in_group(key) and pool.blobs[key].state == "ready")

        b.after_schedule = evict
    else:
        pool.add_fault(fault, direction=G2L, times=1, match=in_group)
    before = dict(pool.blobs)
    b.add_request("b", B_PROMPT, max_tokens=3)
    with pytest.raises(Exception) as stopped:  # the engine stops (the worker raises)
        engine_loop(b)
    assert b.steps == 0, "the failing step completed"
    made = {k: blob for k, blob in pool.blobs.items() if before.get(k) is not blob}
    # (evict: 0.26's _prepare_load_gvas raises for the missing key, before any save key is allocated)
    assert made or fault == "evict", "the failing step allocated no save keys"
    time.sleep(0.2)  # the sending thread may still be draining the layers queued before the stop
    print(f"\n0.26, {fault} on the {layer} load: stopped with {stopped.value!r:.80}; failing-step keys: "
          f"{sorted(blob.state for blob in made.values())}")
    assert [k for k, blob in made.items() if blob.state == "ready"] == []
