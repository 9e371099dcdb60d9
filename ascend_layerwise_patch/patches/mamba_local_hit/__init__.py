"""A local prefix hit keeps its mamba state when the KV pool is the connector.

Target   vllm_ascend.patch.platform.patch_kv_cache_coordinator:
         AscendHybridKVCacheCoordinator.find_longest_cache_hit_per_group; and
         vllm_ascend...ascend_store.pool_scheduler: KVPoolScheduler.bind_gpu_block_pool (to know
         which scheduler's block pool the pool connector serves).
Versions vLLM >=0.25.0,<0.31 but 0.27 / 0.28; vllm-ascend >=0.25.1,<0.31 but 0.27-0.29 (0.30.0rc2: issue 25). On vllm-ascend 0.26.0rc1 the scheduler
         (``BalanceScheduler.schedule``, balance scheduling off) hides ``has_mamba_layers`` from
         the lookup choice when the connector is a KV producer (``kv_producer`` / ``kv_both``), so
         those instances take the joint lookup and never reach this method; a ``kv_consumer``
         instance, and every instance with balance scheduling on (``enable_balance_scheduling``:
         that schedule path has no such switch), still takes the per-group lookup and loses its
         mamba state (pool harness, ``test_gdn_prefix_hits.py``: 2 wrong GDN reads on such a local
         hit without this patch, 0 with it, on both pairs).
Why      With a KV connector and mamba layers, vLLM 0.25's ``Scheduler.schedule`` takes the local
         hit from ``coordinator.find_longest_cache_hit_per_group`` and uses the longest group's
         length. vllm-ascend's process-wide coordinator skips every ``MambaSpec`` group there
         ("the connector transfers Mamba state separately") -- true for a P/D connector that always
         ships the state, false for the layerwise pool, which loads only what exceeds the local
         hit. So on a plain local prefix hit of a pool-serving instance the mamba group gets no
         cached block (``MambaManager`` pads with null blocks), the pool loads nothing, and every
         GDN layer starts from the null block: wrong tokens, silently.
How      For a coordinator whose block pool is bound to the AscendStore pool scheduler, the method
         returns the joint hit over all groups exactly as vLLM's own local path computes it
         (``find_longest_cache_hit``: the cached mamba block is in the block table, and if that
         state was evicted the joint hit shrinks and the pool loads the rest), with that length
         for every group. Every other coordinator -- no connector, or a connector that ships mamba
         state itself -- keeps upstream's answer.
         Recognising the connectors: only ``KVPoolScheduler`` (AscendStore's scheduler half, also
         inside a MultiConnector) registers its block pool, in ``bind_gpu_block_pool`` (the
         Scheduler binds the block pool of its own KVCacheManager). A P/D connector (Mooncake,
         NIXL, ...) never does, so it keeps the skip it was written for. Registered pools are held
         weakly.
Removal  When vllm-ascend's coordinator no longer skips mamba groups for the pool (detected: the
         group skips itself when the method no longer tests ``MambaSpec``).
"""

from __future__ import annotations

import functools
import weakref

from .._checks import Group, lookup
from .._ranges import SUPPORTED
from .._checks import param_names as _params

COORDINATOR = "vllm_ascend.patch.platform.patch_kv_cache_coordinator:AscendHybridKVCacheCoordinator"
POOL_SCHEDULER = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.pool_scheduler:KVPoolScheduler"

#: block pools whose scheduler's KV connector is the AscendStore pool (weakly held)
POOL_BLOCK_POOLS: "weakref.WeakSet" = weakref.WeakSet()


def _coordinator_precondition(original) -> str | None:
    if _params(original) != ["self", "block_hashes", "max_cache_hit_length"]:
        return f"find_longest_cache_hit_per_group parameters are {_params(original)}"
    joint = getattr(lookup(COORDINATOR), "find_longest_cache_hit", None)
    if joint is None or _params(joint)[:3] != ["self", "block_hashes", "max_cache_hit_length"]:
        return "AscendHybridKVCacheCoordinator.find_longest_cache_hit is gone or changed"
    return None


#: vllm-ascend's schedulers that take a local hit from the per-group lookup (0.30: balance scheduling,
#: the dynamic load-balance scheduler)
PER_GROUP_CALLERS = ("vllm_ascend.patch.platform.patch_balance_schedule", "vllm_ascend.core.dyntra_lb_scheduler")


def unreconciled_callers() -> list[str]:
    """The callers of ``find_longest_cache_hit_per_group`` in vllm-ascend that take the largest
    per-group hit as the local hit (``max`` over the lengths it returned): read from their source,
    never imported. Such a hit is deeper than the mamba group's when only full attention is cached
    that far, and the request then starts GDN from the null block."""
    import ast
    import importlib.util

    found = []
    for name in PER_GROUP_CALLERS:
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            continue
        if spec is None or not spec.origin:
            continue
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        lengths = set()
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "attr", None) == "find_longest_cache_hit_per_group"
                and isinstance(node.targets[0], ast.Tuple)
                and len(node.targets[0].elts) == 2
                and isinstance(node.targets[0].elts[1], ast.Name)
            ):
                lengths.add(node.targets[0].elts[1].id)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "max"
                and len(node.args) == 1
                and getattr(node.args[0], "id", None) in lengths
            ):
                found.append(f"{name}:{node.lineno}")
    return found


def _coordinator_fixed(original) -> str | None:
    import inspect

    if "MambaSpec" in inspect.getsource(original):  # 0.25 / 0.26: mamba groups are skipped
        return None
    if unreconciled_callers():  # 0.30: every group looked up, but balance scheduling takes the max
        return None
    return "find_longest_cache_hit_per_group no longer skips mamba groups and no caller takes the largest per-group hit"


def _bind_precondition(original) -> str | None:
    if _params(original) != ["self", "gpu_block_pool"]:
        return f"KVPoolScheduler.bind_gpu_block_pool parameters are {_params(original)}"
    return None


def joint_hit_for_pool(original):
    """``find_longest_cache_hit_per_group`` that answers with the joint hit for the pool."""

    @functools.wraps(original)
    def find_longest_cache_hit_per_group(self, block_hashes, max_cache_hit_length):
        if self.block_pool not in POOL_BLOCK_POOLS:
            return original(self, block_hashes, max_cache_hit_length)
        blocks, hit = self.find_longest_cache_hit(block_hashes, max_cache_hit_length)[:2]
        return tuple(blocks), (hit,) * len(blocks)

    return find_longest_cache_hit_per_group


def register_block_pool(original):
    """``bind_gpu_block_pool`` that remembers the pool scheduler's block pool."""

    @functools.wraps(original)
    def bind_gpu_block_pool(self, gpu_block_pool):
        if gpu_block_pool is not None:
            POOL_BLOCK_POOLS.add(gpu_block_pool)
        return original(self, gpu_block_pool)

    return bind_gpu_block_pool


GROUP = Group("mamba_local_hit", SUPPORTED)

SPECS = (
    GROUP.spec(
        "mamba_local_hit",
        f"{COORDINATOR}.find_longest_cache_hit_per_group",
        joint_hit_for_pool,
        why="a pool-serving instance's local prefix hit keeps its mamba state (joint hit over all groups)",
        precondition=_coordinator_precondition,
        fixed_upstream=_coordinator_fixed,
    ),
    GROUP.spec(
        "mamba_local_hit_pool",
        f"{POOL_SCHEDULER}.bind_gpu_block_pool",
        register_block_pool,
        why="marks the block pool whose connector is the AscendStore pool (it does not ship mamba state)",
        precondition=_bind_precondition,
    ),
)
