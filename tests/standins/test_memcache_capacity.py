"""A full pool on the real MemCache: its own eviction, driven for real.

Engine A serves distinct prompts into a small MemCache pool (one 4 MB share); halfway through,
another tenant puts twice what the pool holds, so MemCache evicts on its own (above ~90% of its
capacity, roughly oldest first, down to ~80%: 16 LRU shards, not strict), key by key: a prefix may
lose a middle block's attention keys and keep its GDN state, or the reverse. Engine B then serves
every prompt A served, on the same pool, which is full: on MemCache 1.2.0 (v0260 / v0300) B's saves
of the evicted prefixes fail (copy -3102), which stopped vllm-ascend 0.26 and 0.30 (group
``pool_save_failures``). Whatever B's hit check finds -- a prefix whole, cut short where a key went,
or gone -- B must sample what a run without the pool samples and read every GDN and attention state
right, and no block may stay held.
"""

from __future__ import annotations

import os

import pytest

import memcache_host
from support import PAIR

PAIRS = ("v0251", "v0260", "v0300")
if PAIR not in PAIRS or memcache_host.version() is None:
    pytest.skip(f"for pairs {', '.join(PAIRS)} with memcache-hybrid; installed: {PAIR}", allow_module_level=True)

import memcache_pool  # noqa: E402
from byte_store import G2L  # noqa: E402
from harness_pool import PoolInstance, differing_tokens, engine_loop, reference_outputs  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

#: distinct 3-block prompts (48 tokens + one): ~100 KiB of keys of this tiny model
PROMPTS = {f"r{i}": [5000 + 64 * i + t for t in range(48)] + [i] for i in range(8)}
MAX_TOKENS = 2
FILLER = 96 << 10  # bytes of each of another tenant's objects
DRAM = 4 << 20  # the pool, one share (at 2 MB some of the tenant's puts failed, -1, and 0.30's A kept no key)


@pytest.fixture(scope="module")
def cluster():
    c = memcache_host.Cluster(dram=f"{DRAM >> 20}MB")
    yield c
    c.close()


def test_a_pool_memcache_evicts_from_serves_what_a_run_without_it_serves(cluster):
    reference = reference_outputs(PROMPTS, max_tokens=MAX_TOKENS)
    pool = memcache_pool.MemcachePool(cluster)
    a, b = PoolInstance(pool, name="A"), PoolInstance(pool, name="B")
    try:
        # halfway through A's prompts another tenant puts twice the pool's size: MemCache evicts,
        # oldest first, what A wrote until then (and the tenant's own oldest objects)
        tenant, puts = cluster.agent(os.getpid()), []
        for i, (req, prompt) in enumerate(PROMPTS.items()):
            if i == len(PROMPTS) // 2:
                puts = [tenant.call("put", f"{pool.prefix}tenant/{n}", bytes(FILLER)) for n in range(2 * DRAM // FILLER)]
            a.add_request(req, prompt, max_tokens=MAX_TOKENS)
            engine_loop(a)
        keys = sorted(pool.blobs)
        evicted = [k for k, there in zip(keys, pool.exists_now(keys)) if not there]
        loads_before = sum(1 for direction, _k, res in pool.copy_log if direction == G2L and res == 0)
        for req, prompt in PROMPTS.items():
            b.add_request(req, prompt, max_tokens=MAX_TOKENS)
            engine_loop(b)
        loads = sum(1 for direction, _k, res in pool.copy_log if direction == G2L and res == 0) - loads_before
        print(f"\nMemCache {memcache_host.version()}, {DRAM >> 20} MB: A wrote {len(keys)} keys "
              f"({sum(pool.blobs[k].size for k in keys) >> 10} KiB), {len(evicted)} evicted by "
              f"MemCache after {len(puts)} puts of another tenant (results {sorted(set(puts))}); B loaded {loads} copies")
        assert differing_tokens(a.outputs, reference) == 0 and differing_tokens(b.outputs, reference) == 0
        for inst in (a, b):
            assert inst.wrong_reads() == [] and inst.wrong_reads(kind="attn") == [], inst.name
            assert inst.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == inst.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1, inst.name
        assert evicted, "the pool never filled: MemCache evicted nothing"
        assert len(evicted) < len(keys) and loads, "nothing of A's stayed: B never hit"
    finally:
        a.close()
        b.close()
