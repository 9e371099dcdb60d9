"""Two engines writing the same prefix at once on the real MemCache, and a third engine that looks the
prefix up while it is still being written.

A's layerwise save of the prefix is held before its final layer's copy (so its keys are allocated and
not finished; A's step goes on in a thread); C schedules a request on the prefix then; B (its own process: another MemCache
client) saves the same prefix, getting A's addresses (MemCache hands a key being written to every
writer); A's copy lands and both finish. What MemCache does at C's lookup depends on its version:

- 1.3.0 (v0251): a key being written does not exist: C computes the prefix itself;
- 1.2.0 (v0260 / v0300, as vllm-ascend pins it): ``batch_is_exist`` says 1 for it and its key info
  has a size, so the scheduler counted a hit; the worker's read lease then failed, and so did the load
  of that block (0.26 stops, 0.30 fails the request under vLLM's default policy). ``pool_hit_written``
  confirms each counted key with a read lease: C computes the prefix itself, as on 1.3.0.

Every engine must sample what a run without the pool samples, read every state right, and a fourth
engine D, after all writes finished, hits the prefix and reads it right (the two writers' bytes).
"""

from __future__ import annotations

import threading
import time

import pytest

import memcache_host
from support import PAIR

PAIRS = ("v0251", "v0260", "v0300")
if PAIR not in PAIRS or memcache_host.version() is None:
    pytest.skip(f"for pairs {', '.join(PAIRS)} with memcache-hybrid; installed: {PAIR}", allow_module_level=True)

import memcache_pool  # noqa: E402
from byte_store import G2L, L2G  # noqa: E402
from harness_pool import PoolInstance, differing_tokens, engine_loop, layer_slot_fault, make_pool, reference_outputs, timing  # noqa: E402
from harness_pool.lifetime import ready_with_a_gap  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

PREFIX = list(range(3000, 3048))  # 3 blocks of 16
PROMPTS = {"a": PREFIX + [1], "b": PREFIX + [2], "c": PREFIX + [3, 4], "d": PREFIX + [5, 6, 7]}
MAX_TOKENS = 3


@pytest.fixture(scope="module")
def reference():
    return reference_outputs(PROMPTS, max_tokens=MAX_TOKENS)


#: MemCache 1.2.x shows a key being written to exists and key info: without ``pool_hit_written`` the
#: hit check counts it and the load fails -- the pairs that pin 1.2.0 stop (0.26.0rc1) or end the
#: reader's request with an error under vLLM's default policy (0.30.0rc2)
SHOWS_WRITING = memcache_host.shows_writing()


_MARKS = (
    []
    if SHOWS_WRITING
    else [pytest.mark.control("MemCache 1.3.0 shows no key being written: nothing fails, with or without the library")]
)


def _a_writing(pool, a, step):
    """A's prefill in its own thread (``step``), held at its final layer's copy: its keys allocated,
    every other layer copied, none finished. (the gate fault, the thread, the keys being written)"""
    final = len(a.layer_order) - 1  # the final layer's copy comes before every key's finish
    held = pool.add_fault("gate", direction=L2G, times=1, at=layer_slot_fault(a, [final]))
    a.add_request("a", PROMPTS["a"], max_tokens=MAX_TOKENS)
    stepping = threading.Thread(target=step, name="A-step", daemon=True)
    stepping.start()
    for _ in range(2000):  # until A's final copy waits at the gate (bounded: 20 s)
        if held.hits:
            break
        time.sleep(0.01)
    assert held.hits == 1, "A's final-layer copy never came"
    writing = [k for k, blob in pool.blobs.items() if blob.state == "writing"]
    assert writing, "A's keys should be in flight"
    return held, stepping, writing


@pytest.mark.parametrize("store", [pytest.param("memcache", marks=_MARKS)])
def test_two_writers_and_a_reader_in_between(monkeypatch, reference, store):
    # 0.25's save_kv_layer waits 10 s for the held copy: 0.1 s (MemCache's own allocation lease is
    # ~10 s: a copy later than that fails, and its key is never published)
    monkeypatch.setattr(timing, "TIME_SCALE", 0.01)
    pool = make_pool(store)
    a = PoolInstance(pool, name="A")
    a.scale_save_wait()
    b = PoolInstance(pool, name="B", processes=True)  # another MemCache client
    c = PoolInstance(pool, name="C")
    d = PoolInstance(pool, name="D")
    stepping = None
    try:
        # (0.25's step returns meanwhile; 0.26 / 0.30 wait in the step for the copy)
        held, stepping, writing = _a_writing(pool, a, a.step)
        seen = pool.batch_is_exist(writing)
        c.add_request("c", PROMPTS["c"], max_tokens=MAX_TOKENS)
        so_c = c.step()  # C's lookup while A writes
        c_hit = so_c.scheduled_new_reqs[0].num_computed_tokens  # what C's scheduler took from the pool
        b.add_request("b", PROMPTS["b"], max_tokens=MAX_TOKENS)
        b.step()  # B saves the same prefix: MemCache gives it A's addresses
        held.gate.set()  # A's final copy lands; A and B both finish
        stepping.join(timing.STEP_LIMIT_S)
        assert not stepping.is_alive()
        for inst in (a, b, c):
            engine_loop(inst)
        d.add_request("d", PROMPTS["d"], max_tokens=MAX_TOKENS)
        loads_before = sum(1 for direction, _k, res in pool.copy_log if direction == G2L and res == 0)
        engine_loop(d)
        loads = sum(1 for direction, _k, res in pool.copy_log if direction == G2L and res == 0) - loads_before
        outputs = {**a.outputs, **b.outputs, **c.outputs, **d.outputs}
        print(f"\nMemCache {memcache_host.version()}: exists of A's keys in flight {seen}; C scheduled with {c_hit} "
              f"tokens from the pool; D loaded {loads} copies")
        assert seen == [int(SHOWS_WRITING)] * len(writing)  # what C's scheduler saw
        assert c_hit == 0  # a key being written is no hit (pool_hit_written confirms each by a read lease)
        assert differing_tokens(outputs, reference) == 0, (outputs, reference)
        for inst, req in ((a, "a"), (b, "b"), (c, "c"), (d, "d")):
            assert inst.wrong_reads(req) == [] and inst.wrong_reads(req, kind="attn") == [], inst.name
        assert loads > 0 and d.first_step_of("d") is not None
        assert min(r.expected for r in d.reads_of("d", step=d.first_step_of("d"))) == len(PREFIX)  # a hit on the prefix
        assert pool.violations == []
    finally:
        pool.clear_faults()  # (opens the gate)
        b.close()
        if stepping is not None and stepping.is_alive():  # 0.26 after its sending thread stopped: the
            # step waits for the final layer's save forever (logging each wait); let that wait end
            for event in a.ranks[0].connector.connector_worker.layer_save_finished_events:
                event.set()
            stepping.join(timing.STEP_LIMIT_S)


def test_a_writer_that_dies_mid_write_costs_the_others_nothing(monkeypatch, reference):
    """A's engine host dies while A saves the prefix: its rank process and its MemCache client are
    killed (SIGKILL) with A's keys allocated and not finished. C then serves a request on the prefix
    and D one after C: each must sample what a run without the pool samples and read every state
    right -- whatever MemCache still says of A's keys (1.2.0 shows a key being written to ``exists``).
    MemCache 1.2.0's MetaService frees a dead writer's unfinished keys only once their allocation
    lease ends, and answers no client meanwhile (seen in gdb: ``FreeBlobs`` -> ``LeaseWait``): with
    0.30's 5-minute lease C's hit check then outlasts the step limit (``pool_alloc_lease`` asks
    MemCache's own, 10 s by default)."""
    monkeypatch.setattr(timing, "TIME_SCALE", 0.01)
    cluster = memcache_host.Cluster()  # its own: a killed client leaves its rank's share behind
    pool = memcache_pool.MemcachePool(cluster)
    a = PoolInstance(pool, name="A", processes=True)
    c, d = PoolInstance(pool, name="C"), PoolInstance(pool, name="D")
    stepping = None
    try:
        died = []

        def step_a():
            try:
                a.step()
            except Exception as exc:  # noqa: BLE001 -- A's rank process is killed under it
                died.append(exc)

        held, stepping, writing = _a_writing(pool, a, step_a)
        rank = a.procs.procs[0]
        agent = cluster.agents[rank.pid]
        rank.kill()
        agent.proc.kill()
        rank.join(10)
        agent.proc.wait(10)
        held.gate.set()  # the copy A's server thread held now goes to a client that is gone
        stepping.join(timing.STEP_LIMIT_S)
        assert died, "A's step should fail with its rank process gone"
        seen = pool.batch_is_exist(writing)
        c.add_request("c", PROMPTS["c"], max_tokens=MAX_TOKENS)
        engine_loop(c)
        d.add_request("d", PROMPTS["d"], max_tokens=MAX_TOKENS)
        engine_loop(d)
        outputs = {**c.outputs, **d.outputs}
        print(f"\nMemCache {memcache_host.version()}: after A died mid-write, exists of its keys {seen}; C hit "
              f"{c.reads_of('c', step=c.first_step_of('c'))[:1]}")
        assert differing_tokens(outputs, {r: reference[r] for r in ("c", "d")}) == 0, (outputs, reference)
        for inst, req in ((c, "c"), (d, "d")):
            assert inst.wrong_reads(req) == [] and inst.wrong_reads(req, kind="attn") == [], inst.name
    finally:
        pool.clear_faults()
        cluster.agents.pop(a.procs.procs[0].pid, None) if a.procs else None
        a.close()
        if stepping is not None:
            stepping.join(timing.STEP_LIMIT_S)
        cluster.close()


#: MemCache's allocation lease in the lease test (``ock.mmc.meta.lease_ttl_ms``; its default is
#: ~10 s): short, so the test waits little; A's copies before the held one land well inside it
LEASE_MS = 2000


def test_a_writer_past_its_allocation_lease_publishes_no_key_with_a_gap(monkeypatch, reference):
    """A's save of the prefix stalls past MemCache's allocation lease: held before its final layer's
    copy until the store refuses a copy into a probe allocated after A's keys. MemCache then refuses
    A's final copies (-3106), and a finish with 0 would still publish A's keys with that layer never
    written (measured on 1.2.0 and 1.3.0: finish 0, exists 1). A must sample what a run without the
    pool samples, no key may be ready with a layer never written, and C, then D, serving the prefix
    must read every state right. Without the library 0.26 stops on the refused copy (its sending
    thread raises). 0.30.0rc2 asks a 5-minute lease, which ``pool_alloc_lease`` leaves to MemCache's
    configured one; with that group off the held copy lands inside 0.30's lease, A's keys are whole
    and C hits them (what the test then requires)."""
    monkeypatch.setattr(timing, "TIME_SCALE", 0.01)
    cluster = memcache_host.Cluster(lease_ttl_ms=LEASE_MS)  # its own: the short lease is for this test only
    pool = memcache_pool.MemcachePool(cluster)
    a = PoolInstance(pool, name="A")
    a.scale_save_wait()
    c, d = PoolInstance(pool, name="C"), PoolInstance(pool, name="D")
    stepping = None
    try:
        held, stepping, writing = _a_writing(pool, a, a.step)
        probes = pool.outlive_allocations()  # allocations under the configured lease have now expired
        held.gate.set()
        stepping.join(timing.STEP_LIMIT_S)
        assert not stepping.is_alive(), "A's step never ended after its held copy (the sending thread stopped?)"
        engine_loop(a)
        asked = max(pool.alloc_leases)  # the longest lease A's saves asked (0: the configured one)
        refused = [keys for direction, keys, res in pool.copy_log if direction == L2G and res != 0]
        gaps = ready_with_a_gap(pool, a)
        ready = pool.ready_keys()
        c.add_request("c", PROMPTS["c"], max_tokens=MAX_TOKENS)
        c_hit = c.step().scheduled_new_reqs[0].num_computed_tokens
        engine_loop(c)
        d.add_request("d", PROMPTS["d"], max_tokens=MAX_TOKENS)
        engine_loop(d)
        outputs = {**a.outputs, **c.outputs, **d.outputs}
        print(f"\nMemCache {memcache_host.version()}, allocation lease {LEASE_MS} ms configured, "
              f"{asked or 'none'} asked (the probe copied {probes} times before it was refused): "
              f"{len(refused)} of A's copies refused; {len(ready)} of A's {len(writing)} keys ready, "
              f"{len(gaps)} with a gap; C took {c_hit} tokens from the pool")
        if asked > LEASE_MS:  # the held copy was inside the lease A asked
            assert refused == [] and len(ready) == len(writing) and c_hit == len(PREFIX)
        else:
            assert refused, "MemCache should refuse a copy past the allocation lease"
        assert gaps == [], gaps
        assert differing_tokens(outputs, {r: reference[r] for r in ("a", "c", "d")}) == 0, (outputs, reference)
        for inst, req in ((a, "a"), (c, "c"), (d, "d")):
            assert inst.wrong_reads(req) == [] and inst.wrong_reads(req, kind="attn") == [], inst.name
        assert pool.violations == []
    finally:
        pool.clear_faults()
        if stepping is not None and stepping.is_alive():  # 0.26 without the library: see above
            for event in a.ranks[0].connector.connector_worker.layer_save_finished_events:
                event.set()
            stepping.join(timing.STEP_LIMIT_S)
        for inst in (a, c, d):
            inst.close()
        cluster.close()
