"""vLLM's invalid-block handling for a hybrid (attention + mamba) KV cache coordinator.

Real vLLM 0.25 ``Scheduler._handle_invalid_blocks`` / ``_update_requests_with_invalid_blocks`` over a
real ``KVCacheManager`` (``HybridKVCacheCoordinator``, a full-attention group and a mamba group in
``align`` mode). The ``Scheduler`` is made with ``object.__new__`` plus the attributes these two
methods read (its ``__init__`` needs a full ``VllmConfig``); the blocks, requests and rollback are
vLLM's own.
"""

from __future__ import annotations

import pytest
import torch

import ascend_layerwise_patch
from ascend_layerwise_patch.patches import load_failures
from ascend_layerwise_patch.registry import APPLIED, MARKER

from support import PAIR

PAIRS = ("v0251",)  # on v0250 the KV cache manager fails to build (arguments vLLM 0.25.0 does not take)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

BS = 4
ATTN, MAMBA = 0, 1
_NAMES = {s.name for s in load_failures.SPECS if s.group == load_failures.GROUP}


def test_load_failures_scheduler_half_applies(patched):
    """The group's state, on its own (the defect tests run as configured)."""
    assert {st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.name in _NAMES} == {APPLIED}


_METHOD = "_update_requests_with_invalid_blocks"


@pytest.fixture
def unpatched():
    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    # on whichever class of the MRO defines it (vllm-ascend may have rebound ``Scheduler`` to a subclass)
    defined = next(vars(c)[_METHOD] for c in Scheduler.__mro__ if _METHOD in vars(c))
    assert not hasattr(defined, MARKER)
    yield
    reg.activate()


def _config(hybrid: bool = True) -> KVCacheConfig:
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attn)]
    if hybrid:
        mamba = MambaSpec(block_size=BS, shapes=((2, 2),), dtypes=(torch.float32,), mamba_cache_mode="align")
        groups.append(KVCacheGroupSpec([f"model.layers.{i}.linear_attn" for i in range(3)], mamba))
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


class Pool:
    """A scheduler with its KV cache manager; requests are admitted the way vLLM's ``schedule``
    admits one with an external (pool) hit: ``allocate_slots`` with ``num_external_computed_tokens``."""

    def __init__(self, *, hybrid: bool = True, policy: str = "recompute"):
        init_none_hash(sha256)
        self.config = _config(hybrid)
        self.manager = KVCacheManager(self.config, max_model_len=256, scheduler_block_size=BS, hash_block_size=BS)
        s = object.__new__(Scheduler)  # __init__ needs a VllmConfig with a model
        s.kv_cache_config = self.config
        s.kv_cache_manager = self.manager
        s.block_size = BS
        s.running = []
        s.skipped_waiting = create_request_queue(SchedulingPolicy.FCFS)
        s.failed_recving_kv_req_ids = set()
        s.recompute_kv_load_failures = policy == "recompute"
        self.sched = s
        self._hasher = get_request_block_hasher(BS, sha256)
        self._tokens = iter(range(1000, 10**6))
        self.scheduled: dict[str, int] = {}

    def admit(self, req_id: str, *, external: int, new: int) -> Request:
        """A request whose first ``external`` tokens come from the pool, with ``new`` computed now."""
        tokens = [next(self._tokens) for _ in range(external + new)]
        req = Request(req_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=self._hasher)
        computed, hit = self.manager.get_computed_blocks(req)
        assert hit == 0
        assert self.manager.allocate_slots(req, new, 0, computed, num_external_computed_tokens=external) is not None
        req.num_computed_tokens = external + new  # Scheduler._update_after_schedule
        self.sched.running.append(req)
        self.scheduled[req_id] = new
        return req

    def blocks(self, req_id: str) -> tuple[list[int], ...]:
        return self.manager.get_block_ids(req_id)

    def handle(self, invalid: set[int]) -> set[str]:
        return self.sched._handle_invalid_blocks(invalid, self.scheduled)


@pytest.mark.control("the defect pinned with the group reverted in the test: passes in both modes by design (its fixed twin fails without the library)")
def test_unpatched_hybrid_report_raises(unpatched):
    """Why vllm-ascend never reports a hybrid request's failed blocks: vLLM 0.25's handler raises."""
    p = Pool()
    p.admit("a", external=8, new=8)
    with pytest.raises(ValueError, match="too many values to unpack"):
        p.handle({p.blocks("a")[ATTN][0]})


@pytest.mark.parametrize("group", [ATTN, MAMBA])
def test_hybrid_recompute_rolls_every_group_back(patched, group):
    p = Pool()
    a = p.admit("a", external=8, new=8)
    b = p.admit("b", external=0, new=12)  # computes from scratch: nothing loaded, not affected
    attn, mamba = p.blocks("a")
    assert mamba[1] != 0, mamba  # the loaded mamba state (after 8 tokens) sits at index 8 // BS - 1
    bad = {ATTN: attn[1], MAMBA: mamba[1]}[group]
    assert p.handle({bad}) == {"a"}
    # The attention prefix before the bad block is fine, but the GDN state there was freed in align
    # mode (null block), so the only point every group can resume from is the start.
    assert a.num_computed_tokens == 0
    assert b.num_computed_tokens == 12
    assert all(p.manager.block_pool.blocks[x].block_hash is not None for x in attn[:2])  # recompute: kept


def test_hybrid_fail_policy_fails_and_evicts(patched):
    p = Pool(policy="fail")
    p.admit("a", external=8, new=8)
    p.admit("b", external=0, new=12)
    attn, mamba = p.blocks("a")
    hashed = [x for x in (*attn, *mamba) if x and p.manager.block_pool.blocks[x].block_hash is not None]
    assert hashed
    assert p.handle({mamba[1]}) == {"a"}
    assert all(p.manager.block_pool.blocks[x].block_hash is None for x in hashed)  # no later hit reads them


def test_hybrid_unaffected_blocks_change_nothing(patched):
    p = Pool()
    a = p.admit("a", external=8, new=8)
    new_block = p.blocks("a")[ATTN][3]  # computed in this step, not loaded
    assert p.handle({new_block}) == set()
    assert a.num_computed_tokens == 16


@pytest.mark.control("a single-group model: the group hands it to upstream, the same with the library off")
def test_single_group_runs_upstream(patched):
    p = Pool(hybrid=False)
    a = p.admit("a", external=8, new=8)
    assert p.handle({p.blocks("a")[ATTN][1]}) == {"a"}
    assert a.num_computed_tokens == BS  # upstream: truncated at the first failed block


@pytest.mark.control("a resume point computed by vLLM's own block bookkeeping: no patch involved")
def test_resume_point_keeps_a_valid_prefix():
    """A held, valid GDN state before the bad attention block is a resume point."""
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    mamba = MambaSpec(block_size=BS, shapes=((2,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    specs = [attn, mamba]
    blocks = ([1, 2, 3, 4, 5], [0, 7, 0, 8, 0])  # GDN states after 8 and after 16 tokens
    point = load_failures._resume_point
    assert point(specs, blocks, {4}, 20, MambaSpec) == 8  # attention block 3 bad: resume at 8
    assert point(specs, blocks, {8}, 20, MambaSpec) == 8  # state at 16 bad: back to the one at 8
    assert point(specs, blocks, {7}, 20, MambaSpec) == 0  # the only earlier state is bad
    assert point(specs, blocks, {2}, 20, MambaSpec) == 0
    assert point(specs, blocks, {99}, 20, MambaSpec) is None
