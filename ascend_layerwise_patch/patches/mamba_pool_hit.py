"""A layerwise pool hit of a hybrid model ends only where every group holds a saved state.

Target   vllm_ascend...ascend_store.pool_scheduler: KVPoolScheduler._get_layerwise_gva_hit_tokens
         (the scheduler's hit check over MemCache keys); vllm_ascend...ascend_store.pool_worker:
         KVPoolWorker._alloc_gvas_for_save (which keys a layerwise save publishes).
Versions vLLM >=0.25.0,<0.26; vllm-ascend >=0.25.1,<0.26.
Why      Two hit boundaries where no saved state exists, both read by GDN as if it did:
         (c1) a prompt wholly in the pool whose length is a multiple of the block size: the hit
         check returns the whole prompt and ``get_num_new_matched_tokens`` subtracts one TOKEN, so
         GDN resumes after ``len - 1`` tokens from a block no load writes (and the last attention
         block is not loaded either). vLLM's own local path (``max_cache_hit_length = num_tokens -
         1``, then the mamba manager's block-aligned hit) and vLLM's MooncakeStoreConnector align
         such a hit DOWN to a block boundary.
         (c2) the layerwise save publishes every block of a mamba group, null blocks included (a
         request prefilled in one chunk never checkpointed its earlier blocks: vLLM's align mode
         keeps only chunk-end states), so a real block-hash key holds the null block's bytes, and
         a request whose hit ends there starts GDN from them.
How      For a scheduler with mamba groups the hit check is: full-attention groups as upstream
         (contiguous ready keys from block 0), capped at ``num_tokens - 1``; then the hit moves down
         to the last block boundary at which every mamba group's key is ready (align mode needs the
         state at the hit, not before it); 0 -- recompute from token 0, always correct -- when none
         fits. The worker never publishes a mamba group's null block: during its GVA allocation such
         a block's key is shown as already present with GVA 0 (no allocation, no key, no copy; the
         layer batch builder skips GVA 0), and forgotten right after, so a later request that holds
         a real state for that block publishes it. Models without mamba groups: upstream, unchanged.
         Keys written by older processes (null blocks included) are still read; only blocks whose
         key exists count, so those states keep the old risk until the pool is refreshed.
Removal  When vllm-ascend's hit check knows mamba groups (detected: the group skips itself when
         ``_get_layerwise_gva_hit_tokens`` mentions mamba).
"""

from __future__ import annotations

import functools
import importlib
import math

from ..registry import PatchSpec
from ._checks import param_names as _params

VLLM = ">=0.25.0,<0.26"
VLLM_ASCEND = ">=0.25.1,<0.26"
POOL = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store"
NULL_BLOCK_ID = 0  # vLLM's BlockPool.null_block


def _hit_precondition(original) -> str | None:
    if _params(original) != ["self", "request", "token_len", "num_computed_tokens"]:
        return f"_get_layerwise_gva_hit_tokens parameters are {_params(original)}"
    module = importlib.import_module(f"{POOL}.pool_scheduler")
    for name in ("get_block_hashes", "block_hash_to_str"):
        if not callable(getattr(module, name, None)):
            return f"pool_scheduler.{name} is gone"
    for name in ("_make_layerwise_gva_keys_for_hit_check", "_get_effective_group_block_size", "_get_or_create_request_tracker"):
        if not callable(getattr(module.KVPoolScheduler, name, None)):
            return f"KVPoolScheduler.{name} is gone"
    return None


def _hit_fixed(original) -> str | None:
    import inspect

    if "mamba" in inspect.getsource(original):
        return "the layerwise hit check already knows mamba groups"
    return None


def _alloc_precondition(original) -> str | None:
    if _params(original) != ["self", "requests"]:
        return f"_alloc_gvas_for_save parameters are {_params(original)}"
    import inspect

    source = inspect.getsource(original)
    if "self._allocated_gvas" not in source or "batch_alloc" not in source:
        return "_alloc_gvas_for_save no longer allocates through _allocated_gvas / batch_alloc"
    worker = importlib.import_module(f"{POOL}.pool_worker").KVPoolWorker
    for name in ("_make_layerwise_gva_key", "_get_effective_group_block_size"):
        if not callable(getattr(worker, name, None)):
            return f"KVPoolWorker.{name} is gone"
    return None


def state_aligned_hit(original):
    """``_get_layerwise_gva_hit_tokens`` that ends a hybrid hit where every group holds a state."""
    module = importlib.import_module(f"{POOL}.pool_scheduler")

    @functools.wraps(original)
    def _get_layerwise_gva_hit_tokens(self, request, token_len, num_computed_tokens):
        mamba = set(getattr(self, "mamba_group_ids", None) or ())
        if not mamba:
            return original(self, request, token_len, num_computed_tokens)
        self._get_or_create_request_tracker(request.request_id)
        limit = min(token_len, request.num_tokens) - 1  # a hit never covers the last token
        if limit <= 0:
            return 0
        hashes = request.block_hashes[: limit // self.hash_block_size]
        hit, ready_by_mamba, sizes = limit, [], []
        for group_id in range(len(self.grouped_block_size)):
            ebs = self._get_effective_group_block_size(group_id)
            sizes.append(ebs)
            blocks = module.get_block_hashes(hashes, ebs, self.hash_block_size)
            keys = [self._make_layerwise_gva_keys_for_hit_check(group_id, module.block_hash_to_str(bh)) for bh in blocks]
            flat = [k for block_keys in keys for k in block_keys]
            infos = self.store_scheduler.batch_get_key_info(flat) if flat else []
            if len(infos) != len(flat):
                return 0
            ready, pos = [], 0
            for block_keys in keys:  # a block is there only when every rank's key is
                ready.append(all(ki.size() and ki.size() > 0 for ki in infos[pos : pos + len(block_keys)]))
                pos += len(block_keys)
            if group_id in mamba:
                ready_by_mamba.append((ebs, ready))
            else:
                contiguous = next((i for i, r in enumerate(ready) if not r), len(ready))
                hit = min(hit, contiguous * ebs)
        unit = math.lcm(*sizes)
        hit -= hit % unit
        while hit > 0 and not all(hit // ebs <= len(ready) and ready[hit // ebs - 1] for ebs, ready in ready_by_mamba):
            hit -= unit
        return hit

    return _get_layerwise_gva_hit_tokens


def no_null_mamba_keys(original):
    """``_alloc_gvas_for_save`` that never publishes a mamba group's null block under a real key."""
    module = importlib.import_module(f"{POOL}.pool_worker")

    @functools.wraps(original)
    def _alloc_gvas_for_save(self, requests):
        align = [g for g, on in enumerate(getattr(self, "group_uses_align_state", None) or ()) if on]
        if not align or not getattr(self, "use_gva_layerwise", False):
            return original(self, requests)
        shown: list[str] = []
        for request in requests:
            if not request.can_save or not request.block_hashes or request.block_ids_by_group_np is None:
                continue
            for g in align:
                if g >= len(request.block_ids_by_group_np):
                    continue
                ids = request.block_ids_by_group_np[g]
                blocks = module.get_block_hashes(request.block_hashes, self._get_effective_group_block_size(g), self.hash_block_size)
                for i in range(min(len(ids), len(blocks))):
                    if int(ids[i]) == NULL_BLOCK_ID:
                        key = self._make_layerwise_gva_key(g, module.block_hash_to_str(blocks[i]))
                        if key not in self._allocated_gvas:
                            self._allocated_gvas[key] = 0  # "present, GVA 0": no alloc, no key, no copy
                            shown.append(key)
        try:
            return original(self, requests)
        finally:
            for key in shown:
                if self._allocated_gvas.get(key) == 0:
                    del self._allocated_gvas[key]

    return _alloc_gvas_for_save


SPECS = (
    PatchSpec(
        name="mamba_pool_hit",
        group="mamba_pool_hit",
        target=f"{POOL}.pool_scheduler:KVPoolScheduler._get_layerwise_gva_hit_tokens",
        factory=state_aligned_hit,
        why="a hybrid pool hit ends at a block boundary below the prompt end where every mamba group holds a saved state",
        vllm=VLLM,
        vllm_ascend=VLLM_ASCEND,
        precondition=_hit_precondition,
        fixed_upstream=_hit_fixed,
    ),
    PatchSpec(
        name="mamba_pool_no_null_keys",
        group="mamba_pool_hit",
        target=f"{POOL}.pool_worker:KVPoolWorker._alloc_gvas_for_save",
        factory=no_null_mamba_keys,
        why="a layerwise save never publishes a mamba group's null block under a real block-hash key",
        vllm=VLLM,
        vllm_ascend=VLLM_ASCEND,
        precondition=_alloc_precondition,
    ),
)
