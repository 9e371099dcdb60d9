"""What vLLM 0.26.0 / vllm-ascend 0.26.0rc1 already do themselves: the detectors that decide which
members are skipped there as fixed upstream or kept out of range, and the upstream behaviour behind
those decisions."""

from __future__ import annotations

import pytest

from ascend_layerwise_patch.patches import gdn_tp_keys, load_failures

from support import PAIR

pytestmark = [pytest.mark.pairs("v0260"), pytest.mark.control("the fix detectors run on vllm-ascend 0.26.0rc1's own code: no patch involved")]
if PAIR != "v0260":
    pytest.skip(f"for pair v0260; installed: {PAIR}", allow_module_level=True)


def test_load_failure_fail_fast_is_detected():
    """0.26.0rc1's receiving thread raises on a failed layerwise load (the engine stops): the worker
    half of load_failures would skip itself as fixed upstream."""
    reason = load_failures._upstream_reports(None)
    assert reason and "raises" in reason


def test_scheduler_half_still_needed():
    """vLLM 0.26.0 still unpacks one KV cache group: the scheduler half is not fixed upstream."""
    from vllm.v1.core.sched.scheduler import Scheduler

    base = next(c for c in Scheduler.__mro__ if "_update_requests_with_invalid_blocks" in vars(c))
    assert load_failures._upstream_hybrid(vars(base)["_update_requests_with_invalid_blocks"]) is None


def test_gdn_keys_still_per_kv_head():
    """vllm-ascend 0.26.0rc1 still keys layerwise GDN state per KV head: gdn_tp_keys is still needed."""
    assert gdn_tp_keys._upstream_keys_per_rank(None) is None


@pytest.mark.parametrize("kind", ["raise", "fail"])
def test_failed_save_copy_finishes_no_key(kind):
    """send_integrity_copy is skipped here as fixed upstream: a save copy that raises or fails
    stops 0.26.0rc1's layer sending thread before any key is finished, and the worker raises (the
    engine stops) -- no key is ever ready with an unwritten layer slot."""
    import ascend_layerwise_patch
    from harness_pool import make_lifetime

    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    try:
        h = make_lifetime(tp=1, num_blocks=64, chunk=8)
        try:
            h.add("r0", 12, 0, kind, layers=frozenset([1]))
            with pytest.raises(RuntimeError, match="KVCacheStoreLayerSendingThread failed"):
                for _ in range(5):
                    h.step()
        finally:
            h.close()
    finally:
        reg.activate()
    assert [c for c in h.pool.copy_log if c[0] == 0]  # save copies ran (and one of them failed)
    assert h.stale_ready() == [] and not [k for k, res in h.finished().items() if res == 0]
