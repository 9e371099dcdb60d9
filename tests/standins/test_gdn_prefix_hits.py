"""Issue 10: every GDN layer starts from the right state on every prefix hit.

On the pool harness (tests/standins/harness_pool): vLLM 0.25.1's (0.26.0's) Scheduler + KVCacheManager in
mamba align mode with vllm-ascend's process-wide patches, the AscendStore connector's halves from
KVConnectorFactory (use_layerwise, MemCache backend), the real layer threads, a byte-level pool,
and ``execute_model``'s order replayed. Each state names its content ("layer L after the first t
tokens"); the harness records, at the moment each GDN layer reads its state, what it found.

Scenarios (issue 10's "How to prove it"): (a) a pool hit longer than the local hit, on a second
instance; (b) a local prefix hit with the connector on; (c) hit boundaries where no saved state
exists. Controls: no hit at all; no connector at all. Each must be right with the library on; with
it off (``test_library_off_reads_wrong_states`` and ``ASCEND_LAYERWISE_PATCH=0``) the (a)/(b)/(c)
scenarios read wrong states.
"""

from __future__ import annotations

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch.registry import APPLIED
from support import PAIR

PAIRS = ("v0251", "v0260", "v0300")
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from harness_pool import PoolInstance, engine_loop, make_pool  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

BS = 16
A = list(range(1000, 1040))  # 40 tokens
X = list(range(5000, 5040))  # an unrelated prompt
TAIL = [7, 8, 9, 10, 11]


EXTRA: dict = {}  # PoolInstance options every scenario adds (the speculative-decoding control)


def _inst(pool, **kwargs) -> PoolInstance:
    return PoolInstance(pool, **{**kwargs, **EXTRA})


def _serve(inst: PoolInstance, req_id: str, prompt, max_tokens: int = 1) -> None:
    inst.add_request(req_id, prompt, max_tokens)
    engine_loop(inst)


def _first_step_reads(inst: PoolInstance, req_id: str):
    step = inst.first_step_of(req_id)
    return inst.reads_of(req_id, step=step), inst.reads_of(req_id, kind="attn", step=step)


# ------------------------------------------------------------------------------ scenarios
# Each returns (instance, request ids whose first step must read right, expected hit tokens).


def pool_hit_plus_5():
    """(a) B on a second instance (empty HBM, same pool) = A's first 32 tokens + 5 others."""
    pool = make_pool()
    _serve(_inst(pool, name="A"), "a", A)
    b = _inst(pool, name="B")
    _serve(b, "b", A[:32] + TAIL)
    return b, {"b": 32}


def pool_hit_plus_1():
    """(a) + exactly 1 more token."""
    pool = make_pool()
    _serve(_inst(pool, name="A"), "a", A)
    b = _inst(pool, name="B")
    _serve(b, "b", A[:32] + [7])
    return b, {"b": 32}


def pool_and_local_hits_in_one_batch():
    """(a) a batch mixing a pool-hit request with a local-hit one."""
    pool = make_pool()
    _serve(_inst(pool, name="A"), "a", A)
    b = _inst(pool, name="B")
    _serve(b, "x", X)  # B's own prefix cache now holds X
    b.add_request("b1", A[:32] + TAIL)  # pool hit
    b.add_request("b2", X[:32] + TAIL)  # local hit
    engine_loop(b)
    return b, {"b1": 32, "b2": 32}


def _local_hit(inst: PoolInstance):
    """A then B sharing 32 tokens on one instance: B's first step reads the local hit."""
    _serve(inst, "a", A)
    _serve(inst, "b", A[:32] + TAIL)
    return inst, {"b": 32}


def local_hit_with_connector():
    """(b) one instance with the connector: A then B sharing 32 tokens (pool hit == local hit)."""
    return _local_hit(_inst(make_pool(), name="A"))


def local_hit_empty_pool():
    """(b) a local hit with the connector on and nothing in the pool."""
    pool = make_pool()
    inst = _inst(pool, name="A")
    _serve(inst, "a", A)
    pool.clear()
    _serve(inst, "b", A[:32] + TAIL)
    return inst, {"b": 32}


def local_hit_consumer():
    """(b) a local hit on a kv_consumer instance of the pool: vllm-ascend 0.26.0rc1 keeps the
    per-group lookup (mamba groups skipped) for consumers, where it fixed producers."""
    return _local_hit(_inst(make_pool(), name="A", kv_role="kv_consumer"))


def local_hit_balance_scheduling():
    """(b) a local hit with vllm-ascend's balance scheduling on (meant for DP > 1; its schedule path is
    the same with one rank): that path keeps the per-group lookup for every KV role."""
    balance = {"scheduler_config": {"enable_balance_scheduling": True}}
    inst = _inst(make_pool(), name="A", additional_config=balance)
    assert inst.scheduler._balance_enabled, "balance scheduling did not turn on"
    return _local_hit(inst)


def whole_prompt_one_chunk():
    """(c1) B = exactly A's first 32 tokens, A prefilled in one chunk."""
    pool = make_pool()
    _serve(_inst(pool, name="A"), "a", A)
    b = _inst(pool, name="B")
    _serve(b, "b", A[:32])
    return b, {"b": 16}


def whole_prompt_16_token_chunks():
    """(c1) B = exactly A's first 32 tokens, A prefilled in 16-token chunks."""
    pool = make_pool()
    _serve(_inst(pool, name="A", max_num_batched_tokens=16, max_num_seqs=4), "a", A)
    b = _inst(pool, name="B")
    _serve(b, "b", A[:32])
    return b, {"b": 16}


def first_block_only():
    """(c2) B shares only A's first 16 tokens; A (one chunk) never checkpointed block 0."""
    pool = make_pool()
    _serve(_inst(pool, name="A"), "a", A)
    b = _inst(pool, name="B")
    _serve(b, "b", A[:16] + TAIL)
    return b, {"b": 0}


def no_hit():
    """Control: nothing shared."""
    pool = make_pool()
    _serve(_inst(pool, name="A"), "a", A)
    b = _inst(pool, name="B")
    _serve(b, "b", X)
    return b, {"b": 0}


def no_connector():
    """Control: no KV connector at all; vLLM's prefix cache serves the hit."""
    return _local_hit(_inst(None, name="local"))


SCENARIOS = {
    f.__name__: f
    for f in (
        pool_hit_plus_5,
        pool_hit_plus_1,
        pool_and_local_hits_in_one_batch,
        local_hit_with_connector,
        local_hit_empty_pool,
        local_hit_consumer,
        local_hit_balance_scheduling,
        whole_prompt_one_chunk,
        whole_prompt_16_token_chunks,
        first_block_only,
        no_hit,
        no_connector,
    )
}
CONTROLS = {"no_hit", "no_connector"}
#: local hits vllm-ascend 0.26.0rc1's scheduler serves right itself (a KV producer takes the joint
#: lookup of every group): right with or without the library there
RIGHT_ON_026 = {"local_hit_with_connector", "local_hit_empty_pool"}


HUNG = "hung"
#: Scenarios upstream already gets right on a pair. vllm-ascend 0.26.0rc1: a local hit keeps its
#: mamba state on a kv_both / kv_producer instance (its scheduler takes the joint lookup for
#: producers); a kv_consumer's does not (local_hit_consumer), nor does any instance's with balance
#: scheduling on (local_hit_balance_scheduling).
#: vllm-ascend 0.30.0rc2: every scenario but a whole-prompt hit (that one is pool_hit_boundary's,
#: applied there): its hit check takes vLLM's per-group rule and its saves skip null blocks
#: (mamba_pool_hit_030 vouches it; the group's 0.25 / 0.26 members read ``ported`` there).
RIGHT_WITHOUT_LIBRARY = {
    "v0260": ("local_hit_with_connector", "local_hit_empty_pool"),
    "v0300": (
        "pool_hit_plus_5",
        "pool_hit_plus_1",
        "pool_and_local_hits_in_one_batch",
        "local_hit_with_connector",
        "local_hit_empty_pool",
        "local_hit_consumer",
        "local_hit_balance_scheduling",
        "first_block_only",
    ),
}


def _scenario(name: str):
    """One scenario as a test parameter, a control where it is right without the library too."""
    why = ("a control scenario: no pool hit, or no connector" if name in CONTROLS else
           "vllm-ascend 0.26.0rc1 serves this local hit right itself" if PAIR == "v0260" and name in RIGHT_ON_026 else
           "vllm-ascend 0.30.0rc2 serves this hit right itself (mamba_pool_hit_030 vouches it)"
           if PAIR == "v0300" and name in RIGHT_WITHOUT_LIBRARY["v0300"] else "")
    return pytest.param(name, id=name, marks=[pytest.mark.control(why)] if why else [])


def wrong_layers(name: str) -> tuple[int, int, dict]:
    """(wrong GDN reads, wrong attention block reads) of the checked requests' first steps."""
    inst, checked = SCENARIOS[name]()
    wrong_gdn = wrong_attn = 0
    starts = {}
    for req_id in checked:
        gdn, attn = _first_step_reads(inst, req_id)
        wrong_gdn += sum(not r.ok for r in gdn)
        wrong_attn += sum(not r.ok for r in attn)
        starts[req_id] = {r.expected for r in gdn} or {0}
    return wrong_gdn, wrong_attn, starts


@pytest.fixture
def library_on():
    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    reg.activate()
    yield
    reg.activate()


@pytest.mark.parametrize("name", [_scenario(n) for n in SCENARIOS])
def test_every_gdn_layer_reads_the_right_state(library_on, name):
    wrong_gdn, wrong_attn, starts = wrong_layers(name)
    print(f"\n{name}: wrong GDN reads {wrong_gdn}, wrong attention blocks {wrong_attn}, started at {starts}")
    assert (wrong_gdn, wrong_attn) == (0, 0)


@pytest.fixture
def library_off():
    import harness_pool

    harness_pool.setup_runtime()  # every target imported first: a pending hook would re-apply on import
    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    assert not [st.name for st in reg.status() if st.state == APPLIED]
    yield
    reg.activate()


@pytest.mark.control("the library reverted in the test: it pins the defect of the unpatched release in both modes")
def test_library_off_reads_wrong_states(library_off, monkeypatch):
    """The proof the scenarios can fail: vllm-ascend 0.25.1rc1 as released reads wrong states in
    every (a)/(b)/(c) scenario, and the controls are right either way."""
    import harness_pool

    if PAIR in ("v0260", "v0300"):  # their waits have no time limit: a step is fast or hung, never 10 s per layer
        monkeypatch.setattr(harness_pool.timing, "STEP_LIMIT_S", 5.0)  # a step here takes well under 1 s
    else:  # 0.25.1rc1 waits 10 s for each layer whose load never comes, then computes: 0.5 s here
        monkeypatch.setattr(harness_pool.timing, "LOAD_WAIT_SCALE", 0.05)
    table = {name: _or_hung(name) for name in SCENARIOS}
    print("\nlibrary off: scenario -> (wrong GDN reads, wrong attention blocks, first-step start)")
    for name, row in table.items():
        print(f"  {name}: {row}")
    for name, (wrong_gdn, wrong_attn, _starts) in table.items():
        if name in CONTROLS:
            assert (wrong_gdn, wrong_attn) == (0, 0), name
        elif name in RIGHT_WITHOUT_LIBRARY.get(PAIR, ()):
            assert (wrong_gdn, wrong_attn) == (0, 0), name  # upstream already right: see the note there
        else:
            assert wrong_gdn == HUNG or wrong_gdn > 0, name


def _or_hung(name: str):
    """``wrong_layers(name)``, or (HUNG, HUNG, {}) when a step hangs: without the GDN per-layer wait,
    vllm-ascend 0.26.0rc1's ``wait_for_layer_load`` waits without a limit for a layer load that was
    never submitted (0.25.1rc1 gives up after 10 s and computes)."""
    try:
        return wrong_layers(name)
    except AssertionError as exc:
        if "(hung)" not in str(exc):
            raise
        return HUNG, HUNG, {}


@pytest.mark.parametrize("name", [_scenario(n) for n in ("pool_hit_plus_5", "pool_and_local_hits_in_one_batch", "local_hit_with_connector", "no_connector")])
def test_speculative_blocks_control(library_on, monkeypatch, name):
    """Speculative decoding's align layout (one speculative mamba block per request, as with
    num_speculative_tokens=1): the same scenarios read the right states."""
    monkeypatch.setitem(EXTRA, "num_speculative_blocks", 1)
    wrong_gdn, wrong_attn, starts = wrong_layers(name)
    print(f"\n{name} (1 speculative block): wrong GDN reads {wrong_gdn}, wrong attention blocks {wrong_attn}, started at {starts}")
    assert (wrong_gdn, wrong_attn) == (0, 0)


@pytest.mark.pairs("v0251", "v0260")  # 0.30: gdn_layerwise is fixed upstream (its detector answers first)
@pytest.mark.control("a registry of the group's own specs, one drifted: the group's all-or-nothing rule, not this process's activation")
def test_precopy_applies_with_gdn_layerwise_or_not_at_all():
    """(a) and the GDN per-layer wait are one group: a drifted pre-copy target takes the wait down
    too (a process that waits per layer but pre-copies in bulk is the bug), and ``check`` shows it."""
    from ascend_layerwise_patch.patches import gdn_layerwise
    from ascend_layerwise_patch.patches.gdn_layerwise import mamba_precopy
    from ascend_layerwise_patch.host import HOST
    from ascend_layerwise_patch.registry import FAILED, Registry

    reg = ascend_layerwise_patch.REGISTRY
    reg.revert()
    try:
        drifted = tuple(
            s._replace(precondition=lambda _o: "drifted in this test") if s.name == "mamba_precopy_defer" else s
            for s in (*gdn_layerwise.SPECS, *mamba_precopy.SPECS)
            if s.group == "gdn_layerwise"
        )
        own = Registry(drifted, host=HOST)
        try:
            own.activate({})
            own.apply_pending()
            states = {st.name: (st.group, st.state) for st in own.status()}
        finally:
            own.revert()
    finally:
        reg.activate()
    assert states == {
        "gdn_layerwise": ("gdn_layerwise", FAILED),
        "mamba_precopy_rows": ("gdn_layerwise", FAILED),
        "mamba_precopy_defer": ("gdn_layerwise", FAILED),
    }, states


@pytest.mark.pairs("v0251", "v0260")  # 0.30: mamba_pool_hit's 0.25 / 0.26 members are out of range
def test_pool_hit_group_off_reads_wrong_states(library_on):
    """Everything else on, ``mamba_pool_hit`` off: the (c) boundaries read states nobody saved
    (on v0260 too, where the library-off run above hangs before it gets there)."""
    from ascend_layerwise_patch.patches import mamba_pool_hit
    from ascend_layerwise_patch.registry import SKIPPED
    from harness_pool import groups_skipped

    assert {s.group for s in mamba_pool_hit.SPECS} == {"mamba_pool_hit"}
    with groups_skipped("mamba_pool_hit"):  # and re-activated as configured after: later modules run with it on
        assert {st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.group == "mamba_pool_hit"} == {SKIPPED}
        table = {name: wrong_layers(name) for name in ("whole_prompt_one_chunk", "whole_prompt_16_token_chunks", "first_block_only")}
    print(f"\nmamba_pool_hit off: {table}")
    assert all(wrong_gdn > 0 for wrong_gdn, _attn, _starts in table.values()), table


if PAIR == "v0251":  # on 0.26.0rc1 the library-off run hangs before any state is read (no GDN layer wait)
    test_pool_hit_group_off_reads_wrong_states = pytest.mark.control(
        "the defect pinned with mamba_pool_hit skipped in the test: with the library off the same wrong reads show"
    )(test_pool_hit_group_off_reads_wrong_states)


@pytest.mark.pairs("v0300")
@pytest.mark.control("a vouch: vllm-ascend 0.30's own fix, run with the library reverted in the test")
def test_030_a_pool_hit_loads_only_the_state_it_resumes_from(library_off):
    """``mamba_pool_resume_load_030`` (vouched): vllm-ascend 0.25.1rc1 loaded every chunk-end GDN state
    of a hit's range into the null block (``mamba_pool_resume_load`` fixes it there). 0.30.0rc2, library
    off: A prefills 16 blocks + 5 tokens in 4-block chunks (GDN states saved at 64, 128, 192, 256), B
    hits all 16 blocks and reads one GDN-group key (the state at 256), right."""
    from harness_pool import hit_after_chunked_prefill

    pool = make_pool()
    b, read = hit_after_chunked_prefill(pool)
    group = str(b.group_of[b.gdn_layers[0]])
    gdn_keys = [k for k in pool.ready_keys() if k.split("@")[1] == group]
    print(f"\nlibrary off: {len(gdn_keys)} GDN-group keys in the pool, B read {len(read)} ({sum(read.values())} bytes)")
    assert len(gdn_keys) == 4 and len(read) == 1
    assert b.reads_of("b")[0].expected == 256  # resumed from the pool at the 16th block
    assert b.wrong_reads() == [] and b.wrong_reads(kind="attn") == []
