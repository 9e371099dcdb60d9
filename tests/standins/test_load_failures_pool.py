"""A failed layerwise load costs time, never tokens: what the failed step saved is never published.

Harness: tests/standins/harness_pool.py (``PoolInstance``: vLLM's real Scheduler, the AscendStore
connector halves, the real layer threads, a byte-level MemCache with faults). Instance A fills the
pool with a 40-token prompt (2 full blocks of 16 tokens). Instance B (policy ``recompute``) hits
those 32 tokens for a prompt with 16 new tokens after them, and its first GDN load fails: the copy
returns an error, raises, stays blocked past the wait, or the key is evicted between the
scheduler's hit check and the worker's load. B's failed step computes tokens 32..48 on the state
that was never loaded and saves block 2 of every group (the chunk-end GDN state included).
Instance C then asks for the same 48 tokens plus 16 more: a hit on a key saved in B's failed step
would load state computed from garbage (``PoolInstance.wrong_reads``).
"""

from __future__ import annotations

import os

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.patches import load_failures
from ascend_layerwise_patch.registry import APPLIED, SKIPPED

from support import PAIR

PAIRS = ("v0251",)
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from byte_store import G2L  # noqa: E402
from harness_pool import PoolInstance, engine_loop, make_pool  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

PROMPT = list(range(3000, 3040))
NEW = list(range(6000, 6016))  # one full block after the 32-token hit: the failed step saves it
B_PROMPT = PROMPT[:32] + NEW + [1, 2, 3, 4, 5]
C_PROMPT = PROMPT[:32] + NEW + list(range(7000, 7016))
MAX_TOKENS = 3
_GROUPS = {
    "on": set(),
    "off": {load_failures.GROUP, load_failures.SAVES_GROUP},  # the library's load-failure handling off
    "saves_off": {load_failures.SAVES_GROUP},  # only this change off
}


def _set(mode: str) -> None:
    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    skip = _GROUPS[mode]
    reg.activate(environ={**os.environ, "ASCEND_LAYERWISE_PATCH_SKIP": ",".join(sorted(skip))} if skip else dict(os.environ))
    for st in reg.status():
        if st.group in (load_failures.GROUP, load_failures.SAVES_GROUP):
            assert st.state == (SKIPPED if st.group in skip else APPLIED), (st.name, st.state, st.reason)


@pytest.fixture
def library():
    yield _set
    _set("on")


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    """Tokens of runs without any pool (vLLM's own prefix caching only)."""
    inst = PoolInstance(None, name="control")
    reqs = [inst.add_request("b", B_PROMPT, max_tokens=MAX_TOKENS), inst.add_request("c", C_PROMPT, max_tokens=2)]
    engine_loop(inst)
    assert inst.wrong_reads() == [] and inst.wrong_reads(kind="attn") == []
    return {r.request_id: list(r.output_token_ids) for r in reqs}


class Run:
    """A fills the pool, B's first GDN load fails (``fault``), then C hits the same prefix."""

    def __init__(self, fault: str, policy: str = "recompute"):
        self.pool = pool = make_pool()
        a = PoolInstance(pool, name="A")
        a.add_request("a", PROMPT, max_tokens=1)
        engine_loop(a)
        self.b = b = PoolInstance(pool, name="B", kv_load_failure_policy=policy)
        group = str(b.group_of[b.gdn_layers[0]])
        is_gdn = lambda key: key.split("@")[1] == group  # noqa: E731
        self.fault = None
        if fault == "evict":
            # after the scheduler's hit check, before the worker's load: the state B resumes from goes
            def evict(inst, _so):
                if inst.steps == 0:
                    self.evicted = pool.evict(lambda key: is_gdn(key) and pool.blobs[key].state == "ready")

            b.after_schedule = evict
        else:
            self.fault = pool.add_fault(fault, direction=G2L, times=1, match=is_gdn)
        self.free_at_start = b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        self.req_b = b.add_request("b", B_PROMPT, max_tokens=MAX_TOKENS)
        before = dict(pool.blobs)
        self.failed_step_keys: dict = {}

        def after(inst, _so):
            if inst.steps == 1:  # the keys B's failed step allocated (and saved)
                self.failed_step_keys = {k: blob for k, blob in pool.blobs.items() if before.get(k) is not blob}
                if self.fault is not None:
                    self.fault.gate.set()

        engine_loop(b, on_step=after)
        self.c = c = PoolInstance(pool, name="C")
        self.req_c = c.add_request("c", C_PROMPT, max_tokens=2)
        engine_loop(c)

    def ready_failed_step_keys(self) -> list[str]:
        return [k for k, blob in self.failed_step_keys.items() if blob.state == "ready"]

    def wrong_reads_b(self) -> list:
        """B's reads after its failed step (the failed step's own reads are what failed)."""
        return [r for kind in ("gdn", "attn") for r in self.b.wrong_reads("b", kind=kind) if r.step > 0]

    def wrong_reads_c(self) -> list:
        return [r for kind in ("gdn", "attn") for r in self.c.wrong_reads("c", kind=kind)]

    def check_clean_end(self) -> None:
        assert not self.b.has_work() and not self.c.has_work()
        assert self.pool.violations == []
        assert all(blob.leases == 0 for blob in self.pool.blobs.values())  # every read lease released
        assert not [k for k, blob in self.pool.blobs.items() if blob.state == "writing"]  # every key finished
        assert self.b.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == self.free_at_start  # no leak


@pytest.mark.parametrize("fault", ["error", "raise", "gate", "evict"])
def test_failed_step_saves_are_never_published(library, expected, monkeypatch, fault):
    library("on")
    monkeypatch.setattr(load_failures, "WAIT_S", 0.3)  # upstream's 10 s, shortened for the gate fault
    run = Run(fault)
    assert run.fault is None or run.fault.hits == 1
    assert run.b.kv_outputs[0].invalid_block_ids  # reported in the failed step
    assert run.failed_step_keys  # the failed step did save (a full block of each group)
    assert run.ready_failed_step_keys() == []
    assert run.wrong_reads_b() == [] and run.wrong_reads_c() == []
    assert list(run.req_b.output_token_ids) == expected["b"]
    assert list(run.req_c.output_token_ids) == expected["c"]
    assert run.req_b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    run.check_clean_end()


@pytest.mark.parametrize("mode", ["off", "saves_off"])
def test_without_the_fix_the_failed_step_poisons_the_pool(library, mode):
    """The library's load-failure handling off (vllm-ascend as released, policy ``fail`` since it
    refuses ``recompute`` for hybrids), or only ``load_failures_saves`` off: B's failed step
    publishes its keys, and C computes on them."""
    library(mode)
    run = Run("error", policy="fail" if mode == "off" else "recompute")
    ready, wrong = run.ready_failed_step_keys(), run.wrong_reads_c()
    print(f"\n{mode}: {len(ready)} keys saved in the failed step published ready; {len(wrong)} wrong reads of C "
          f"({len(run.wrong_reads_b())} of B after its failed step)")
    assert ready and wrong
