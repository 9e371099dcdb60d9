"""A layerwise pool hit of a hybrid model ends only where every group holds a saved state.

Target   vllm_ascend...ascend_store.pool_scheduler: KVPoolScheduler._get_layerwise_gva_hit_tokens
         (the scheduler's hit check over MemCache keys); vllm_ascend...ascend_store.pool_worker:
         KVPoolWorker._alloc_gvas_for_save (which keys a layerwise save publishes) and, on vllm-ascend
         0.26 only, KVPoolWorker._prepare_load_gvas (member ``mamba_pool_null_loads``; on 0.25.1rc1
         the same wrapper is group ``mamba_pool_resume_load``, see ``RESUME_LOAD_SPECS``).
Versions vLLM >=0.25.0,<0.27; vllm-ascend >=0.25.1,<0.27 (``mamba_pool_null_loads``: vllm-ascend
         >=0.26.0,<0.27; ``mamba_pool_resume_load``: <0.26). vllm-ascend 0.26.0rc1's hit check and save are unchanged (same defects).
         vllm-ascend 0.30.0rc2 (vLLM 0.29 / 0.30) ends a hybrid hit by vLLM's own per-group rule and
         skips null blocks in its saves: member ``mamba_pool_hit_030`` reads that in its code and is
         skipped as fixed upstream (the group fails there if it is gone), the others read ``ported``
         (tests/standins/test_gdn_prefix_hits.py runs the pool-hit scenarios there, library on and off).
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
vllm-ascend 0.26
         Its ``_alloc_gvas_for_save`` first asks MemCache (``batch_is_exist``) about every cached key
         and drops those it lacks -- the placeholders above included -- so during the call the
         worker's client answers the placeholders as present. Its ``_prepare_load_gvas`` looks up
         every block of the load range in every group, the mamba group's null blocks included (a
         request resuming at block k holds null blocks below k), and raises for a hybrid request
         when one is missing ("Layerwise multi-group KV load failed"): with null blocks never
         published, every pool hit would stop the engine. ``mamba_pool_null_loads`` answers the
         keys of this step's null mamba blocks as present (found, leased) during the call and then
         zeroes their GVAs and drops them from the request's lease keys; null blocks of align-state
         groups are skipped by the layer batch builder anyway, so nothing is copied for them. A key
         another request of the step loads into a real block is looked up as usual. vllm-ascend
         0.25.1rc1 logs the missing key and loads nothing for it, so the member is not needed there.
MTP      vllm-ascend 0.26's ``get_num_new_matched_tokens`` then drops the hit's last LCM block when an
         eagle-family draft runs (``use_eagle``: MTP is one; "support loading the trailing block as
         dirty data" is its TODO), so the hit it loads ends one block before the state-aligned one,
         often where no state was saved (A prefilled in one chunk): the worker stops the engine on
         the missing key, or with this group off GDN starts from a null block's bytes. Under that
         trim the hit check ends the hit so that the trim lands on a block boundary with every
         mamba group's state ready (or returns 0): one boundary rule, applied to the hit that is
         loaded (issue 33).
Removal  When vllm-ascend's hit check knows mamba groups (detected: the group skips itself when
         ``_get_layerwise_gva_hit_tokens`` mentions mamba).
"""

from __future__ import annotations

import functools
import importlib
import math

from ... import pool_events
from .._targets import STORE as POOL
from .._checks import Group, expects, source
from .._ranges import ASCEND_026, V025, V025_026, V029_030
from .._checks import param_names as _params

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
    if "mamba" in source(original):
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


def _eagle_trim(scheduler) -> int:
    """Tokens vllm-ascend 0.26's ``get_num_new_matched_tokens`` drops from a layerwise hit after the
    hit check when an eagle-family draft (MTP among them) runs: its LCM block (0: no trim; 0.25.1rc1
    has none and no ``use_eagle``)."""
    if getattr(scheduler, "use_layerwise", False) and getattr(scheduler, "use_eagle", False) is True:
        return int(getattr(scheduler, "lcm_block_size", 0) or 0)
    return 0


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
        aligned = hit

        def saved(point: int) -> bool:
            return all(point // ebs <= len(ready) and ready[point // ebs - 1] for ebs, ready in ready_by_mamba)

        # the hit ends where the caller's trim (0 but under an eagle draft on 0.26) leaves a saved state
        trim = _eagle_trim(self)
        point = max(hit - trim, 0)
        point -= point % unit
        while point > 0 and not saved(point):
            point -= unit
        hit = point + trim if point > 0 else 0
        if hit < aligned:
            pool_events.bump("hits_cut_back")
        return hit

    return _get_layerwise_gva_hit_tokens


class _KeyInfo:
    """What ``batch_get_key_info`` answers for a key shown as present (its GVA is zeroed after)."""

    def size(self) -> int:
        return 1

    def gva_list(self) -> list[int]:
        return [_SHOWN_GVA]


_SHOWN_GVA = 1  # any positive GVA: upstream takes it as found, the wrapper zeroes it right after


class _NullKeysPresent:
    """The worker's MemCache client as one call sees it: the keys of mamba null blocks are present
    (exists, found, leased); every other key is asked of the real client, in one call as before."""

    def __init__(self, store, keys: set[str]):
        self._store, self._keys = store, keys

    def __getattr__(self, name):
        return getattr(self._store, name)

    def _answer(self, keys, present, ask, *args):
        others = [k for k in keys if k not in self._keys]
        answers = list(ask(others, *args)) if others else []
        if len(answers) != len(others):
            return answers  # the client's own malformed answer: upstream's length check sees it
        it = iter(answers)
        return [present if k in self._keys else next(it) for k in keys]

    def batch_is_exist(self, keys):  # vllm-ascend 0.26's _refresh_allocated_gvas
        return self._answer(keys, 1, self._store.batch_is_exist)

    def batch_get_key_info(self, keys):
        return self._answer(keys, _KeyInfo(), self._store.batch_get_key_info)

    def batch_add_lease(self, keys, *args):
        return self._answer(keys, 0, self._store.batch_add_lease, *args)


def _with_store(worker, keys: set[str], call):
    """Run ``call()`` with ``worker.m_store`` seeing ``keys`` as present (the layer threads keep
    their own reference to the real client)."""
    if not keys:
        return call()
    store = worker.m_store
    worker.m_store = _NullKeysPresent(store, keys)
    try:
        return call()
    finally:
        worker.m_store = store


def _align_groups(worker) -> list[int]:
    """The align-state (mamba) groups of a layerwise GVA worker; none otherwise."""
    if not getattr(worker, "use_gva_layerwise", False):
        return []
    return [g for g, on in enumerate(getattr(worker, "group_uses_align_state", None) or ()) if on]


def _align_blocks(worker, module, request, align, loading=False):
    """(group, block id, block hash) for each block of ``request`` in the ``align`` groups; with
    ``loading``, only the blocks upstream's ``_prepare_load_gvas`` looks up for it: from vLLM's own
    hit (0 with ``layerwise_offload``) to the last full block of the pool hit."""
    for g in align:
        if g >= len(request.block_ids_by_group_np):
            continue
        ids = request.block_ids_by_group_np[g]
        size = worker._get_effective_group_block_size(g)
        hashes = module.get_block_hashes(request.block_hashes, size, worker.hash_block_size)
        start, end = 0, min(len(ids), len(hashes))
        if loading:
            spec_ = request.load_spec
            cached = spec_.kvpool_cached_tokens
            if not getattr(worker, "use_eagle", False) and spec_.kvpool_store_skip_tokens is not None:
                cached = spec_.kvpool_store_skip_tokens
            start = 0 if getattr(worker, "layerwise_offload", False) else spec_.vllm_cached_tokens // size
            end = min(end, cached // size)
        for i in range(start, end):
            yield g, int(ids[i]), hashes[i]


def no_null_mamba_keys(original):
    """``_alloc_gvas_for_save`` that never publishes a mamba group's null block under a real key. A
    key one request of the step would save from a real block while another holds it as a null block
    stays unpublished this step (the null block wins: never its bytes under a real key)."""
    module = importlib.import_module(f"{POOL}.pool_worker")

    @functools.wraps(original)
    def _alloc_gvas_for_save(self, requests):
        align = _align_groups(self)
        if not align:
            return original(self, requests)
        shown: list[str] = []
        for request in requests:
            if not request.can_save or not request.block_hashes or request.block_ids_by_group_np is None:
                continue
            for g, block_id, block_hash in _align_blocks(self, module, request, align):
                if block_id == NULL_BLOCK_ID:
                    key = self._make_layerwise_gva_key(g, module.block_hash_to_str(block_hash))
                    if key not in self._allocated_gvas:
                        self._allocated_gvas[key] = 0  # "present, GVA 0": no alloc, no key, no copy
                        shown.append(key)
        try:  # vllm-ascend 0.26 first drops cached keys MemCache no longer has: keep the placeholders
            return _with_store(self, set(shown), lambda: original(self, requests))
        finally:
            for key in shown:
                if self._allocated_gvas.get(key) == 0:
                    del self._allocated_gvas[key]

    return _alloc_gvas_for_save


def null_loads_present(original):
    """``_prepare_load_gvas`` that does not look up a mamba group's null blocks: they are never
    loaded (the layer batch builder skips null blocks of align-state groups), and, never
    published (``mamba_pool_no_null_keys``), they would read as a failed load."""
    module = importlib.import_module(f"{POOL}.pool_worker")

    @functools.wraps(original)
    def _prepare_load_gvas(self, requests):
        align = _align_groups(self)
        if not align:
            return original(self, requests)
        null: set[str] = set()
        real: set[str] = set()
        loading = [r for r in requests if r.load_spec is not None and r.load_spec.can_load and r.block_ids_by_group_np is not None]
        for request in loading:
            for g, block_id, block_hash in _align_blocks(self, module, request, align, loading=True):
                key = self._make_layerwise_gva_key(g, module.block_hash_to_str(block_hash))
                (null if block_id == NULL_BLOCK_ID else real).add(key)
        # a key another request LOADS into a real block is looked up as usual (one that only holds
        # it as a block it computes this step, past its hit, does not: that key may not exist yet)
        null -= real
        result = _with_store(self, null, lambda: original(self, requests))
        if null:
            for request in loading:
                gvas = getattr(request, "load_block_gvas_by_group_np", None) or ()
                for g in align:
                    if g < len(gvas) and g < len(request.block_ids_by_group_np):
                        n = min(len(gvas[g]), len(request.block_ids_by_group_np[g]))
                        gvas[g][:n][request.block_ids_by_group_np[g][:n] == NULL_BLOCK_ID] = 0
                if getattr(request, "load_keys", None):
                    request.load_keys = [k for k in request.load_keys if k not in null]
        return result

    return _prepare_load_gvas


def _loads_precondition(original) -> str | None:
    problem = expects(["self", "requests"], needs=("_make_layerwise_gva_key", "batch_get_key_info", "batch_add_lease"))(original)
    if problem:
        return problem
    fields = getattr(importlib.import_module(f"{POOL}.config_data").ReqMeta, "__annotations__", {})
    missing = {"load_keys", "load_block_gvas_by_group_np", "block_ids_by_group_np"} - set(fields)
    if missing:
        return f"ReqMeta lost {sorted(missing)}"
    return None


def _loads_fixed(original) -> str | None:
    text = source(original)
    if "group_uses_align_state" in text or "skip_null" in text:
        return "the layerwise load already leaves mamba null blocks out of its lookups"
    return None


def _hit_fixed_030(original) -> str | None:
    """vllm-ascend 0.30.0rc2 (which reworked this group's targets) ends a hybrid hit by vLLM's own
    per-group rule and never saves a mamba group's null block."""
    coordinator = source(importlib.import_module(f"{POOL}.coordinator"))
    worker = source(importlib.import_module(f"{POOL}.pool_worker").KVPoolWorker)
    if (
        "_lookup_layerwise_with_coordinator" in source(original)
        and "find_longest_cache_hit" in coordinator
        and "skip_null_blocks_by_group = self.group_uses_align_state" in worker
    ):
        return (
            "vllm-ascend's layerwise hit check takes vLLM's longest-hit rule per KV cache group (a mamba "
            "group's hit ends on a saved state) and its saves skip the mamba groups' null blocks"
        )
    return None


GROUP = Group(
    "mamba_pool_hit",
    V025_026,
    # vllm-ascend 0.30.0rc2: fixed there (mamba_pool_hit_030 reads it; tests/standins/test_gdn_prefix_hits.py
    # runs the pool-hit scenarios on v0300 with the library off)
    ported_to=(
        (
            V029_030,
            "member mamba_pool_hit_030 (vllm-ascend's hit check ends on a saved state itself) with group "
            "pool_hit_boundary (a whole-prompt hit)",
        ),
    ),
)

SPECS = (
    GROUP.spec(
        "mamba_pool_hit",
        f"{POOL}.pool_scheduler:KVPoolScheduler._get_layerwise_gva_hit_tokens",
        state_aligned_hit,
        why="a hybrid pool hit ends at a block boundary below the prompt end where every mamba group holds a saved state",
        precondition=_hit_precondition,
        fixed_upstream=_hit_fixed,
    ),
    GROUP.spec(
        "mamba_pool_no_null_keys",
        f"{POOL}.pool_worker:KVPoolWorker._alloc_gvas_for_save",
        no_null_mamba_keys,
        why="a layerwise save never publishes a mamba group's null block under a real block-hash key",
        precondition=_alloc_precondition,
    ),
    GROUP.spec(
        "mamba_pool_null_loads",
        f"{POOL}.pool_worker:KVPoolWorker._prepare_load_gvas",
        null_loads_present,
        ranges=ASCEND_026,  # vllm-ascend 0.25.1rc1 logs a missing key and loads nothing for it
        why="a layerwise load does not look up mamba null blocks (never published; 0.26 stops on a missing key)",
        precondition=_loads_precondition,
        fixed_upstream=_loads_fixed,
    ),
    GROUP.vouched(
        "mamba_pool_hit_030",
        f"{POOL}.pool_scheduler:KVPoolScheduler._get_layerwise_hit_tokens",
        _hit_fixed_030,
        ranges=V029_030,
        what="vllm-ascend 0.30.0rc2's state-aligned layerwise hit check",
    ),
)


def _resume_load_fixed_030(original) -> str | None:
    """vllm-ascend 0.30.0rc2 loads a hit's blocks through the coordinator's reachable-load masks (the
    mamba groups' intermediate states are not in them) and skips null blocks of align-state groups."""
    worker_cls = original.__globals__.get("KVPoolWorker")
    prepare = source(getattr(worker_cls, "_prepare_load_gvas", None)) if worker_cls is not None else ""
    if "_compute_reachable_load_masks" in prepare and "skip_null_blocks_by_group" in source(worker_cls):
        return "vllm-ascend's layerwise load takes only the blocks the hit reaches (reachable-load masks; null blocks skipped)"
    return None


#: Its own group, applied after pool_key_layout and before load_failures (patches.SPECS): the same
#: fix as ``mamba_pool_null_loads`` on vllm-ascend 0.25.1rc1, where a pool hit looked up every block
#: of its range and copied each intermediate chunk-end mamba state that exists into the null block
#: (load cost; the null block is shared). There the null blocks of a hit are neither looked up,
#: leased nor loaded.
RESUME_LOAD_GROUP = Group(
    "mamba_pool_resume_load",
    V025,
    risk="every intermediate mamba state of a pool hit is copied into the null block (load cost, shared null block)",
    # vllm-ascend 0.30.0rc2: tests/standins/test_gdn_prefix_hits.py::test_030_a_pool_hit_loads_only_the_state_it_resumes_from
    # runs the scenario there with the library off (one GDN-group key read of four)
    ported_to=(
        (ASCEND_026, "member mamba_pool_null_loads of group mamba_pool_hit (the same wrapper)"),
        (V029_030, "member mamba_pool_resume_load_030 (vllm-ascend loads only the blocks a hit reaches)"),
    ),
)
RESUME_LOAD_SPECS = (
    RESUME_LOAD_GROUP.spec(
        "mamba_pool_resume_load",
        f"{POOL}.pool_worker:KVPoolWorker._prepare_load_gvas",
        # mamba_pool_hit's 0.26 member, on 0.25.1rc1: the null mamba blocks of a hit are neither looked
        # up nor leased nor loaded (0.25.1rc1 looks up every block of the hit range, and every
        # intermediate chunk-end state that exists is copied into the null block)
        null_loads_present,
        why="a layerwise pool hit loads only the mamba state it resumes from, not every chunk-end state into the null block",
        precondition=_loads_precondition,
        fixed_upstream=_loads_fixed,
        after=("mamba_pool_null_loads",),  # its 0.26 twin (same factory); only one is in range on a pair
    ),
    RESUME_LOAD_GROUP.vouched(
        "mamba_pool_resume_load_030",
        f"{POOL}.pool_worker:KVPoolWorker._compute_reachable_load_masks",
        _resume_load_fixed_030,
        ranges=V029_030,
        what="vllm-ascend 0.30.0rc2's reachable-load masks for a layerwise pool hit",
    ),
)
