"""The pool harness: vLLM + vllm-ascend's layerwise KV pool on real objects, on a CPU (one harness).

:class:`PoolInstance` is one vLLM instance (scheduler + TP worker ranks) attached to a byte-level
MemCache pool (``byte_store``); :func:`make_pool`, :func:`engine_loop` (EngineCoreProc's loop) and
:class:`GDNRead` (what each layer read) go with it, and further modules add drivers on top of it:
:func:`soak` / :func:`slow_store` (liveness under a slow store), :class:`InFlightWrites` /
:class:`DelayedUploads` (async scheduling), :class:`StatsTap` (connector stats), and
:class:`Lifetime` / :class:`BlockOwners` (block lifetime under layerwise sends: which request's
block each save copy reads, copies held at a gate, failing or raising).

Modules (this package re-exports their public names; the timing knobs are read from ``timing``):

- ``timing``: ``TIME_SCALE``, ``GATE_LIMIT_S``, ``STEP_LIMIT_S``, ``LOAD_WAIT_SCALE`` (a test sets
  them there: ``monkeypatch.setattr(harness_pool.timing, "LOAD_WAIT_SCALE", 0.05)``), ``ScaledEvent``;
- ``model``: the stand-in model (``state_value``, ``next_token``, the hidden state, ``sample``);
- ``runtime``: process-wide setup and state (``setup_runtime``, ``set_none_hash``, ``checkpoint_dir``,
  ``make_pool``, the host cache regions and the NPU batch copy's stand-in);
- ``rank`` / ``rank_step``: one TP rank, its caches and layers / its step (``GDNRead``);
- ``instance``: ``PoolInstance``; ``engine``: ``engine_loop``, ``reference_outputs``,
  ``differing_tokens``, ``groups_skipped``;
- ``soak``, ``async_drivers``, ``stats``, ``lifetime``: the drivers named above.

Usage:

  pool = make_pool()                                   # a byte-level MemCache pool (byte_store)
  a = PoolInstance(pool, name="A")                     # one vLLM instance attached to it
  a.add_request("a", prompt); engine_loop(a)           # EngineCoreProc's loop
  b = PoolInstance(pool, name="B")                     # a second instance, same pool
  ...; b.wrong_reads("b")                              # what each GDN layer read, right or not

Real: vLLM's ``Scheduler`` (``scheduler_config.get_scheduler_cls()``) with its KVCacheManager /
HybridKVCacheCoordinator in mamba ``align`` mode, with vllm-ascend's process-wide patches applied
as its platform plugin applies them (``load_general_plugins`` + ``pre_register_and_update`` ->
``adapt_patch(is_global_patch=True)``; the worker patches as its NPU worker applies them,
``adapt_patch()``); the AscendStore connector's scheduler and worker halves made by vLLM's
``KVConnectorFactory`` from a ``kv_transfer_config`` (use_layerwise, MemCache backend), the
worker's ``register_kv_caches`` and the layer sending / receiving threads it starts; vLLM's
``KVOutputAggregator``; ``NPUModelRunner.execute_model``'s order replayed with the functions
looked up where it looks them up (``handle_preemptions``, ``mamba_utils.preprocess_mamba``,
``NPUModelRunner.maybe_get_kv_connector_output`` / ``kv_connector_no_forward``,
``mamba_utils.do_mamba_copy_block``), each GDN layer entered through its (patched or not)
``AscendGatedDeltaNetAttention._forward_core`` and saved by ``ops.gdn``'s
``maybe_save_kv_layer_to_connector``, each attention layer through vLLM's
``maybe_transfer_kv_layer``.

Stood in for, and why:
- the model config is a tiny Qwen3-Next (``config.json`` in a temp dir, no weights, no hub);
  vLLM's model inspection subprocess gets the CPU stand-ins through a ``sitecustomize``;
- the KV cache specs are the harness's (``block_size`` tokens in every group, small states, the
  mamba page padded to the attention page): vllm-ascend's platform forces 128-token attention
  blocks for this model; the scheduler's block size is set the way EngineCore sets it (min of
  the groups' block sizes);
- MemCache: ``byte_store`` (real bytes, bounds-checked, faults, per-key write records);
- the NPU batch-copy kernel (``mamba_utils.batch_memcpy``, a Triton launcher on NPU): host
  ``memmove`` of the same (src, dst, size) rows, bounds-checked against the cache tensors;
- the NPU caches: host tensors laid out as vLLM lays out shared hybrid pages (one raw tensor per
  ``KVCacheTensor``, attention K/V and mamba conv/SSM views with the page as block stride);
- one process per TP rank: each rank's worker half is built while vllm-ascend's pool worker and
  MemCache backend see that rank's parallel state; each rank's step runs with its connector as
  the process's transfer group;
- the drafter (``PoolInstance(mtp=N)``): the draft model's attention layer is in the KV cache as vLLM
  puts it (``mtp.layers.0.self_attn.attn``, in the target's attention group) and runs through vLLM's
  ``maybe_transfer_kv_layer`` N times per step after the target's forward, before the connector's
  deferred ``finalize_kv_connector`` (skipped where the batch does not fit the drafter, as the
  runners skip it); its proposals (:class:`~harness_pool.rank_step.Draft`) are the true continuation
  at about 3 of 4 positions when its first pass read right KV on every rank, else nothing the
  target samples. They are scheduled as speculative tokens (sync scheduling:
  ``update_draft_token_ids`` after the step, as ``EngineCore.post_step``; async: the scheduler's
  placeholders stand for the runner's own last proposals, and the runner takes the rejected ones
  back at the next step) and verified as vLLM's rejection sampler does at temperature 0; a GDN layer
  of a speculative step reads the state slot of the last accepted token (the temporal state of the
  running block + ``num_accepted - 1``, the conv window at that row offset: :mod:`~harness_pool.model`)
  and writes one per draft, and the align postprocess after sampling copies the accepted state to a
  block boundary the accepted tokens crossed (``_RankStep._postprocess``).
  ``PoolInstance.acceptance`` counts each proposal's tokens that the target's tokens confirm;
- the model's compute: a GDN layer "computes" when the original ``_forward_core`` first reads its
  state (``self.kv_cache[1]``): the harness records what the state block of each request holds
  (a :class:`GDNRead`), writes the state after this step's tokens, and stops the original there
  (the NPU kernels that follow cannot run on a CPU). Attention layers check their computed blocks
  and write the new ones the same way. Every state / KV block value names its content: "the
  state of layer L (TP slice R) after the first t tokens of this token sequence"
  (:func:`state_value`); a wrong read propagates (the layer writes a value derived from what it
  read), as a real model would compute on.
"""

from __future__ import annotations

import sys as _sys
import types as _types

# imported with the harness: the library's patches of them are in place once a test imports it
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import kv_transfer as _kv_transfer  # noqa: F401
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import pool_scheduler as _pool_scheduler  # noqa: F401
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import pool_worker as _pool_worker  # noqa: F401

from byte_store import PoolService

from . import timing
from .async_drivers import DelayedUploads, InFlightWrites
from .engine import differing_tokens, engine_loop, groups_skipped, hit_after_chunked_prefill, reference_outputs
from .instance import PoolInstance
from .lifetime import ATTN, MAMBA, BadRead, BlockOwners, Lifetime, layer_slot_fault, make_lifetime
from .model import CORRUPT_TOKEN_BASE, HIDDEN_BITS, next_token, sample, state_value, true_hidden, true_output
from .rank_step import GDNRead
from .runtime import checkpoint_dir, make_pool, set_none_hash, setup_runtime
from .soak import SOAK_SCENARIOS, slow_store, soak
from .stats import StatsTap
from .timing import ScaledEvent

__all__ = [
    "ATTN",
    "CORRUPT_TOKEN_BASE",
    "GATE_LIMIT_S",
    "HIDDEN_BITS",
    "LOAD_WAIT_SCALE",
    "MAMBA",
    "SOAK_SCENARIOS",
    "STEP_LIMIT_S",
    "TIME_SCALE",
    "BadRead",
    "BlockOwners",
    "DelayedUploads",
    "GDNRead",
    "InFlightWrites",
    "Lifetime",
    "PoolInstance",
    "PoolService",
    "ScaledEvent",
    "StatsTap",
    "checkpoint_dir",
    "differing_tokens",
    "engine_loop",
    "groups_skipped",
    "hit_after_chunked_prefill",
    "layer_slot_fault",
    "make_lifetime",
    "make_pool",
    "next_token",
    "reference_outputs",
    "sample",
    "set_none_hash",
    "setup_runtime",
    "slow_store",
    "soak",
    "state_value",
    "timing",
    "true_hidden",
    "true_output",
]

#: the timing knobs (``timing``'s upper-case names): the harness reads them from ``timing`` when it
#: needs them, so the package only hands out their current values and refuses to have them set here
#: (a value set on the package would never be read)
_KNOBS = tuple(name for name in vars(timing) if name.isupper())


def __getattr__(name: str):
    if name in _KNOBS:
        return getattr(timing, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(_types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        if name in _KNOBS:
            raise AttributeError(f"{name} is read from harness_pool.timing: set harness_pool.timing.{name}, not harness_pool.{name}")
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
