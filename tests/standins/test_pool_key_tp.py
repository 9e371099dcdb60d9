"""Issue 25 (d): on vllm-ascend 0.30.0rc2 the layerwise pool keys (``model@group@hash@rank``) name no
TP size, so an instance at another TP size sharing the pool loads another layout's GDN slices (group
``pool_key_tp`` names the TP size in every key).

On the pool harness running vLLM 0.30.0 + vllm-ascend 0.30.0rc2 (v0300 only; see
test_pool_hit_boundary.py for v0290): instance W at TP 4 (2 KV heads) serves A (40 tokens); instance R
at TP 2, same pool and checkpoint, serves A's first 32 tokens + 5. Each GDN state value names its TP
slice (``gdn<rank>/<tp>``), so a slice cut for TP 4 read by a TP 2 rank is a wrong read. (The harness
gives every TP size the same state shape; on a device the slices also differ in size.) Control: R at
TP 4 still hits and reads right with the group on. The same key shape is what a pool left by
0.25 / 0.26 without this library holds (GDN keys per KV head): test_pool_upgrade.py.
"""

from __future__ import annotations

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.registry import APPLIED
from support import PAIR, group_states

PAIRS = ("v0300",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

import byte_store  # noqa: E402
from harness_pool import PoolInstance, differing_tokens, engine_loop, groups_skipped, make_pool, reference_outputs  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

A = list(range(1000, 1040))


def _row(reader_tp: int):
    """(wrong GDN reads, GDN reads, keys loaded, R's tokens that differ from a run without the pool)."""
    pool = make_pool()
    w = PoolInstance(pool, name="W", tp=4, kv_heads=2)
    w.add_request("a", A)
    engine_loop(w)
    prompt = A[:32] + [7, 8, 9, 10, 11]
    r = PoolInstance(pool, name="R", tp=reader_tp, kv_heads=2)
    r.add_request("b", prompt)
    engine_loop(r)
    reads = r.reads_of("b", step=r.first_step_of("b"))
    differ = differing_tokens(r.outputs, reference_outputs({"b": prompt}))
    return sum(not x.ok for x in reads), len(reads), len(pool.key_bytes[byte_store.G2L]), differ


def _rows(*skip: str) -> dict:
    with groups_skipped(*skip):
        return {tp: _row(tp) for tp in (2, 4)}


def test_pool_key_tp_applies():
    assert group_states("pool_key_tp") == {APPLIED}


def test_a_pool_written_at_another_tp_size_is_not_read():
    # pool_key_layout too: its 0.30 member binds the same builder with a namespace that names the TP size
    off = _rows("pool_key_tp", "pool_key_layout")
    on = _rows()
    print(f"\npool_key_tp off: reader TP 2 {off[2]}, TP 4 {off[4]}\npool_key_tp on:  reader TP 2 {on[2]}, TP 4 {on[4]}")
    assert off[2][:2] == (4, 4) and off[2][3] == 1  # every GDN layer of both ranks read a TP 4 slice: a wrong token
    assert on[2][0] == 0 and on[2][2] == 0 and on[2][3] == 0  # TP 2 misses the TP 4 keys: recomputed
    assert off[4][0] == on[4][0] == 0 and on[4][2] > 0 and off[4][3] == on[4][3] == 0  # same TP size: still hit, read right


@pytest.mark.control("the fix detector run on upstream's own code")
def test_detector_sees_no_tp_size_in_upstream_keys():
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import memcache_backend

    from ascend_layerwise_patch.patches import pool_key_tp

    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    try:
        original = memcache_backend.bind_layerwise_keys
        assert pool_key_tp._precondition(original) is None
        assert pool_key_tp._fixed_upstream(original) is None
        assert pool_key_tp._fixed_upstream(pool_key_tp.tp_named_keys(original)) is not None
    finally:
        reg.activate()
