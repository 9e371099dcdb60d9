"""What vLLM 0.26.0 / vllm-ascend 0.26.0rc1 already do about issue 11 (the library is out of range
there; these are the detectors that decide what would apply if the range were widened)."""

from __future__ import annotations

import pytest

from ascend_layerwise_patch.patches import gdn_tp_keys, load_failures

from support import PAIR

pytestmark = pytest.mark.pairs("v0260")
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
