"""Issue 33: under MTP a pool hit resumes where every group holds a saved state, on every pair.

vllm-ascend 0.26.0rc1's ``KVPoolScheduler.get_num_new_matched_tokens`` drops the hit's last block
whenever a draft model of the eagle family runs (``use_eagle``; MTP is one), after the hit check --
where ``mamba_pool_hit`` ended the hit on a block with a saved GDN state -- so the trimmed hit lands
one block earlier, often where no state was saved. On the pool harness (the pair's Scheduler in align
mode, its AscendStore halves, the byte-level pool), both instances with vLLM's SpeculativeConfig for
the stand-in checkpoint's MTP (``qwen3_next_mtp``, 3 speculative tokens; Qwen3.5's ``qwen3_5_mtp``
is the same family): A serves 48 tokens prefilled in chunks of 32 + 16, so GDN states are saved at
32 and 48, none at 16; B asks A's first 32 tokens plus 5. On 0.26 the hit check says 32 and the trim
makes it 16; ``mamba_pool_hit`` now applies its boundary rule to the hit as the trim leaves it (one
rule, applied once): B resumes at 0 here, and at 16 when A was prefilled in 16-token chunks (a state
saved at 16). 0.25.1rc1 does not trim; 0.30.0rc2 trims only a hit reaching the prompt's last block
(vouched with the library off).

Not yet modelled (issue 33, open): the MTP layer and a drafter (draft tokens, their verification,
acceptance); the scheduler half of MTP is all the trim needs.
"""

from __future__ import annotations

import pytest

from support import PAIR

PAIRS = ("v0260", "v0251", "v0300")
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from ascend_layerwise_patch.patches import mamba_pool_hit  # noqa: E402
from harness_pool import PoolInstance, engine_loop, groups_skipped, make_pool, reference_outputs  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)


@pytest.mark.pairs("v0300")
@pytest.mark.control("vouches 0.30.0rc2's own trim (only a hit reaching the prompt's last block): the library is off in the test")
def test_030_trims_an_mtp_hit_only_at_the_prompts_last_block(reference):
    """vLLM 0.30 + vllm-ascend 0.30.0rc2 with the library off: B's interior 32-token hit is kept under
    MTP and resumes on the state saved at 32 (A prefilled 32 + 16): 0 wrong reads, reference tokens."""
    from support import library_off

    with library_off():
        off = _mtp_hit(32)
    assert off["error"] is None and off["resumed"] == 32 and off["wrong"] == [] and off["tokens"] == reference, off

A = list(range(4000, 4048))  # 48 tokens, 16-token blocks
B = A[:32] + [1, 2, 3, 4, 5]


def _mtp_hit(chunk: int) -> dict:
    """A prefilled in ``chunk``-token chunks, then B on a second instance with the MTP trim on."""
    pool = make_pool()
    a = PoolInstance(pool, name="A", long_prefill_token_threshold=chunk, mtp=3)
    a.add_request("a", A, max_tokens=1)
    engine_loop(a)
    b = PoolInstance(pool, name="B", mtp=3)  # MTP, 3 speculative tokens: use_eagle() is true
    assert b.configs[0].speculative_config.use_eagle()
    assert getattr(b.scheduler.connector.connector_scheduler, "use_eagle", True) is True  # 0.25.1rc1 reads none
    req = b.add_request("b", B, max_tokens=2)
    out: dict = {"error": None}
    try:
        engine_loop(b)
    except Exception as exc:  # noqa: BLE001 - the worker's stop, reported
        out["error"] = f"{type(exc).__name__}: {exc}"
    first = b.reads_of("b", step=0)  # B's first step starts from the pool's state, if it got a hit
    out.update(
        resumed=min((r.expected for r in first), default=0),  # tokens B resumed at (0: computed from the start)
        wrong=[r for kind in ("gdn", "attn") for r in b.wrong_reads("b", kind=kind)],
        tokens=list(req.output_token_ids),
    )
    return out


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return reference_outputs({"b": B}, max_tokens=2)["b"]


#: where B resumes, by pair and A's chunk: 0.26 trims the hit by a block (to 16: a state only when A
#: was prefilled in 16-token chunks); 0.25.1rc1 does not trim (it reads no speculative config); 0.30.0rc2 trims only a hit that
#: reaches the prompt's last block (B's 32-token hit is interior: kept)
RESUMED = {"v0260": {32: 0, 16: 16}, "v0251": {32: 32, 16: 32}, "v0300": {32: 32, 16: 32}}


_VOUCH = pytest.mark.control("v0300: vllm-ascend 0.30.0rc2 trims only a hit reaching the prompt's last block (vouched)")


@pytest.mark.parametrize("chunk", [pytest.param(c, marks=[_VOUCH] if PAIR == "v0300" else []) for c in (32, 16)])
def test_an_mtp_pool_hit_resumes_on_a_saved_state(reference, chunk):
    on = _mtp_hit(chunk)
    print(f"\n{PAIR}, MTP (3 speculative tokens), A prefilled in {chunk}-token chunks: B resumed at {on['resumed']}")
    assert on["error"] is None, on["error"]
    assert on["wrong"] == [] and on["tokens"] == reference
    assert on["resumed"] == RESUMED[PAIR][chunk], on


@pytest.mark.pairs("v0260")
def test_without_mamba_pool_hit_the_trimmed_hit_reads_an_unsaved_state(reference):
    """``mamba_pool_hit`` skipped (vllm-ascend as released for this hit): the trimmed hit at 16 loads
    the key saved for A's block 0 -- a mamba group's null block (A never checkpointed at 16) -- and
    B's GDN layers start from it. Not a control: with the whole library off 0.26's layer wait has no
    bound and the load step hangs before any state is read (ASCEND_LAYERWISE_PATCH=0 run)."""
    with groups_skipped(*{s.group for s in mamba_pool_hit.SPECS}):
        off = _mtp_hit(32)
    differ = sum(x != y for x, y in zip(off["tokens"], reference))
    print(f"\nmamba_pool_hit off, MTP trim, A prefilled 32 + 16: resumed at {off['resumed']}, {len(off['wrong'])} wrong reads, "
          f"{differ} of 2 tokens differ, error {off['error']}")
    assert off["error"] is None and off["resumed"] == 16 and off["wrong"]


@pytest.mark.pairs("v0260")
def test_without_the_trim_rule_the_mtp_hit_stops_the_engine(monkeypatch):
    """Only the trim rule off (``mamba_pool_hit`` as it was before issue 33: the hit ends on the saved
    state at 32, the trim moves it to 16): vllm-ascend 0.26.0rc1's worker finds no key for the mamba
    state at 16 (never published: A saved no state there) and stops the engine."""
    monkeypatch.setattr(mamba_pool_hit, "_eagle_trim", lambda _scheduler: 0)
    off = _mtp_hit(32)
    print(f"\ntrim rule off, A prefilled 32 + 16: {off['error']}")
    assert off["error"] is not None and "Layerwise multi-group KV load failed" in off["error"], off
