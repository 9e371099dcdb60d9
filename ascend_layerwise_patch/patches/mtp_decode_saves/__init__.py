"""Decode saves under speculative decoding on a hybrid model: off (group ``mtp_decode_saves``).

Target   vllm_ascend...ascend_store.pool_scheduler: KVPoolScheduler.__init__ (where it reads
         ``save_decode_cache`` from the connector's extra config).
Versions vLLM >=0.25,<0.27 with vllm-ascend 0.25.1rc1 / 0.26.0rc1; vllm-ascend 0.30.0rc2 (vLLM 0.29 /
         0.30) as member ``mtp_decode_saves_030``: the same attribute, read the same way.
Why      With ``save_decode_cache: true`` the layerwise pool saves a decode block once its tokens
         are verified: in the step that computes the block's last token. Under speculative decoding
         (MTP) that step also computes the draft tokens after it, and in align mode the running
         GDN state then sits in the block of the last draft (``mamba_get_block_table_tensor``): the
         state at the block's boundary reaches the block only after sampling, when the align
         postprocess (vLLM's ``postprocess_mamba_align_gpu``, the fused kernel) copies it there. The
         layer's save runs during the forward, before that copy: the key's GDN state is the one the
         block held before (the state some tokens earlier). A later pool hit that resumes on that
         key loads it and computes on: wrong tokens. Pool harness
         (tests/standins/test_mtp_decode_saves.py, A decodes 40 tokens under MTP, B asks for A's
         prompt + 10 of its tokens + 2): group off, on 0.25.1rc1 with MTP 3 and on 0.30.0rc2 with
         MTP 1 and 3, B's GDN layers read a state of 44 / 46 tokens where 48 belong, and B's tokens
         differ from the run without the pool; 0.26.0rc1 resumes such hits earlier (on a prompt
         chunk's state: right bytes, the decode keys unused). With async scheduling the save comes
         a step later, after the copy.
How      After the original ``__init__``, on the layerwise path, when the config has speculative
         decoding and the model is hybrid: ``save_decode_cache`` is set off, with one WARNING that
         says so. Prompt blocks (chunked prefill, where no draft token is scheduled) are saved as
         before; decode blocks are not pooled -- a hit ends at the prompt's last saved block: it
         costs hits, never bytes.
Removal  When the pool saves a decode block's GDN state after the step's align postprocess (the
         test above then reads right with the group off).
"""

from __future__ import annotations

import functools
import inspect

from .._checks import Counts, Group, lookup, source
from .._checks import param_names as _params
from .._ranges import V025_026, V029_030
from .._targets import STORE

SCHEDULER = f"{STORE}.pool_scheduler:KVPoolScheduler"

_COUNTS = Counts("decode_saves_turned_off")
counters = _COUNTS.snapshot


def _spec_decoding_hybrid(vllm_config) -> str | None:
    """What makes decode saves unsafe here (the speculative method and token count), or None."""
    spec = getattr(vllm_config, "speculative_config", None)
    tokens = getattr(spec, "num_speculative_tokens", 0) or 0
    model = getattr(vllm_config, "model_config", None)
    if spec is None or tokens <= 0 or not getattr(model, "is_hybrid", False):
        return None
    return f"{getattr(spec, 'method', None) or 'speculative decoding'}, {tokens} draft tokens"


def no_decode_saves(original):
    """``KVPoolScheduler.__init__`` that turns ``save_decode_cache`` off under speculative decoding on
    a hybrid model (layerwise path)."""

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not (getattr(self, "use_layerwise", False) and getattr(self, "save_decode_cache", False)):
            return
        vllm_config = inspect.signature(original).bind(None, *args, **kwargs).arguments["vllm_config"]
        why = _spec_decoding_hybrid(vllm_config)
        if why is None:
            return
        self.save_decode_cache = False
        _COUNTS.add("decode_saves_turned_off")
        from ...host import logger

        logger().warning(
            "ascend_layerwise_patch: save_decode_cache is turned off for the layerwise pool (%s on a hybrid model): a decode "
            "block's GDN state is saved during the forward, before the align postprocess copies the accepted state into "
            "it, and a pool hit on it would compute on a stale state. Prompt blocks are pooled as before.",
            why,
        )

    return __init__


def _precondition(original) -> str | None:
    params = _params(original)
    if "vllm_config" not in params:
        return f"KVPoolScheduler.__init__ parameters are {params} (no vllm_config)"
    text = source(original)
    if text and "save_decode_cache" not in text:
        return "KVPoolScheduler.__init__ no longer reads save_decode_cache"
    decode = source(getattr(lookup(SCHEDULER), "_process_running_cached_request", None))
    if decode and "self.save_decode_cache" not in decode:
        return "KVPoolScheduler._process_running_cached_request no longer gates decode saves on self.save_decode_cache"
    return None


GROUP = Group(
    "mtp_decode_saves",
    V025_026,
    risk="save_decode_cache under speculative decoding: a pool hit can load a GDN state saved before the accepted-token copy (wrong tokens)",
    ported_to=((V029_030, "member mtp_decode_saves_030 (the same wrapper on 0.30's pool scheduler)"),),
    why="save_decode_cache is turned off under speculative decoding on a hybrid model: decode blocks' GDN states were saved before the align postprocess wrote them",
    precondition=_precondition,
    counters=counters,
)

SPECS = (
    GROUP.spec("mtp_decode_saves", f"{SCHEDULER}.__init__", no_decode_saves, after=("pool_layout_scheduler",)),
    GROUP.spec("mtp_decode_saves_030", f"{SCHEDULER}.__init__", no_decode_saves, ranges=V029_030, after=("pool_layout_scheduler", "mtp_decode_saves")),
)
