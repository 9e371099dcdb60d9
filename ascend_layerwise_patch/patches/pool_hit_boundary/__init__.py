"""A whole-prompt pool hit of a hybrid (GDN) request resumes on a mamba-state boundary.

Target   vllm_ascend...ascend_store.pool_scheduler: KVPoolScheduler.get_num_new_matched_tokens.
Versions vLLM >=0.29,<0.31; vllm-ascend 0.30.0rc2 (>=0.30,<0.31). On 0.25 / 0.26 the same defect is
         mamba_pool_hit's (a different lookup: ``_get_layerwise_gva_hit_tokens``).
Why      When the pool holds the whole prompt, ``get_num_new_matched_tokens`` returns the hit minus
         one token (``num_external_hit_tokens == request.num_tokens`` -> ``-= 1``: the last token
         must be computed to sample). For full attention that is right (the last token's KV is
         recomputed); for a GDN layer it is not: the request resumes at ``prompt - 1``, inside a
         block, and its GDN layers read the state block saved at the prompt end -- a state that
         already contains the token being computed. No state exists at ``prompt - 1``; the one to
         resume from is the last saved block boundary below the prompt end. The layerwise lookup
         (``_lookup_layerwise_with_coordinator`` / the contiguous one) only answers on boundaries
         where the mamba state was saved; the ``- 1`` steps off them. (Pool harness,
         tests/standins/test_pool_hit_boundary.py: 2 wrong GDN reads of 2 layers off, 0 on.)
How      For a hybrid scheduler (mamba groups: ``num_speculative_blocks_by_group``), the lookups
         that ``get_num_new_matched_tokens`` calls (``_get_layerwise_hit_tokens``,
         ``_get_block_key_layerwise_hit_tokens``, ``_get_store_lookup_hit_tokens``) see at most
         ``request.num_tokens - 1`` tokens for the duration of that call: the hit they find is the
         longest one strictly below the prompt end whose mamba state is in the pool (the
         coordinator checks the state at the boundary it answers), so the ``- 1`` never fires and
         the request resumes where a state was saved (or at 0: the whole prompt recomputes).
         Everything after the lookup (EAGLE trim, load spec, store-skip) is upstream's, unchanged.
         Non-hybrid schedulers keep upstream's answer. The cap is set on the instance for one call
         (the scheduler calls this from its own thread) and restored after.
Removal  When the real method, called on a probe scheduler whose pool holds every block and state
         of a 2-block prompt, lands the hit on a block boundary below the prompt (detected: the
         group skips itself).
"""

from __future__ import annotations

import functools

from .._checks import Counts, Group, lookup, source
from .._checks import param_names as _params
from .._ranges import V029_030
from .._targets import STORE

POOL_SCHEDULER = f"{STORE}.pool_scheduler:KVPoolScheduler"
#: the hit lookups ``get_num_new_matched_tokens`` dispatches to (each takes request, token_len, ...)
LOOKUPS = ("_get_layerwise_hit_tokens", "_get_block_key_layerwise_hit_tokens", "_get_store_lookup_hit_tokens")

_COUNTS = Counts("capped_lookups")


def _precondition(original) -> str | None:
    if _params(original) != ["self", "request", "num_computed_tokens"]:
        return f"KVPoolScheduler.get_num_new_matched_tokens parameters are {_params(original)}"
    text = source(original)
    if text and ("request.num_tokens" not in text or "_get_layerwise_hit_tokens" not in text):
        return "get_num_new_matched_tokens no longer compares the hit with request.num_tokens after _get_layerwise_hit_tokens"
    scheduler = lookup(POOL_SCHEDULER)
    for name in LOOKUPS:
        method = getattr(scheduler, name, None)
        if method is None:
            return f"KVPoolScheduler.{name} is gone"
        if _params(method)[:3] != ["self", "request", "token_len"]:
            return f"KVPoolScheduler.{name} parameters are {_params(method)}"
    return None


def probe_hit(original) -> int:
    """Where ``original`` (``get_num_new_matched_tokens``) lands a whole-prompt hit: a probe
    scheduler (hybrid, GVA layerwise, 16-token blocks in every group) whose pool holds every block
    of a 32-token prompt with its state at every boundary (its lookup answers ``token_len`` floored
    to a block). Right: 16 (the last boundary below the prompt end); 0.30.0rc2: 31."""
    from types import SimpleNamespace

    probe = object.__new__(lookup(POOL_SCHEDULER))
    bs = 16
    probe.__dict__.update(
        kv_role="kv_both",
        consumer_is_to_load=True,
        use_layerwise=True,
        use_layerwise_transfer=True,
        use_block_key_layerwise=False,
        use_eagle=False,
        load_async=False,
        lcm_block_size=bs,
        cache_transfer_granularity=bs,
        _discard_partial_chunks=True,
        cacheable_group_ids=[0, 1],
        original_block_size=[bs, bs],
        grouped_block_size=[bs, bs],
        num_speculative_blocks_by_group={0: 0},
        load_specs={},
        _get_layerwise_hit_tokens=lambda request, token_len, num_computed_tokens: token_len // bs * bs,
    )
    request = SimpleNamespace(request_id="alp-probe", prompt_token_ids=list(range(2 * bs)), num_tokens=2 * bs, block_hashes=[])
    import logging

    quiet = _ProbeLines()
    log = logging.getLogger("vllm.logger")  # the scheduler logs through vllm.logger.logger: the probe stays out
    log.addFilter(quiet)
    try:
        original(probe, request, 0)
    finally:
        log.removeFilter(quiet)
    spec = probe.load_specs.get(request.request_id)
    return spec.kvpool_cached_tokens if spec is not None else 0


class _ProbeLines:
    """A logging filter dropping the records that name the probe request."""

    @staticmethod
    def filter(record) -> bool:
        return "alp-probe" not in str(record.args)


def _fixed_upstream(original) -> str | None:
    try:
        hit = probe_hit(original)
    except Exception:  # a probe the method no longer runs on: not known to be fixed (the cap is harmless)
        return None
    if hit % 16 == 0 and hit < 32:
        return f"a whole-prompt pool hit already lands on a block boundary (probe: {hit} of 32 tokens)"
    return None


def _capped(lookup, cap: int):
    def capped(request, token_len, *args, **kwargs):
        if token_len > cap:
            _COUNTS.add("capped_lookups")
            token_len = cap
        return lookup(request, token_len, *args, **kwargs)

    return capped


def boundary_hit(original):
    """``get_num_new_matched_tokens`` whose lookups stop one token before the prompt end (hybrid)."""

    @functools.wraps(original)
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not getattr(self, "num_speculative_blocks_by_group", None):  # no mamba group: upstream's answer
            return original(self, request, num_computed_tokens)
        cap = request.num_tokens - 1
        own = self.__dict__
        saved = {name: own[name] for name in LOOKUPS if name in own}
        for name in LOOKUPS:
            lookup = getattr(self, name, None)
            if lookup is not None:
                own[name] = _capped(lookup, cap)
        try:
            return original(self, request, num_computed_tokens)
        finally:
            for name in LOOKUPS:
                own.pop(name, None)
            own.update(saved)

    return get_num_new_matched_tokens


counters = _COUNTS.snapshot


GROUP = Group("pool_hit_boundary", V029_030)

SPECS = (
    GROUP.spec(
        "pool_hit_boundary",
        f"{POOL_SCHEDULER}.get_num_new_matched_tokens",
        boundary_hit,
        why="a hybrid request whose whole prompt is in the pool resumes on a saved mamba-state boundary, not at prompt - 1",
        precondition=_precondition,
        fixed_upstream=_fixed_upstream,
        counters=counters,
        risk="a whole-prompt pool hit of a GDN request resumes at prompt - 1 on the state saved at the prompt end",
        after=("load_fail_no_reload",),  # load_failures (vllm-ascend <0.26) on the same method: never both in range
    ),
)
