"""GDN state in the layerwise pool is keyed, saved and loaded per tensor-parallel rank.

Target   vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store:
         pool_worker.KVPoolWorker._make_layerwise_gva_key, ._process_save_for_layer_batch,
         ._alloc_gvas_for_save, ._build_shared_save_data                        (worker half)
         pool_scheduler.KVPoolScheduler._make_layerwise_gva_keys_for_hit_check   (scheduler half)
Versions vLLM >=0.25.0,<0.27; vllm-ascend >=0.25.1,<0.27 (base releases). vllm-ascend 0.26.0rc1
         still keys, saves and hit-checks per KV head. There its ``_process_save_for_layer_batch`` only
         builds tasks (allocation moved to ``_alloc_gvas_for_save``, which also drops cached keys
         MemCache no longer has: the leader-keys view supports ``pop``), and keys are finished with
         the step's last save task on every rank (``write_finish_keys``), so ``gdn_tp_finish`` is
         skipped there as fixed upstream. vllm-ascend 0.30.0rc2 (vLLM 0.29 / 0.30) keys, saves and
         hit-checks align-state groups per TP rank itself: member ``gdn_tp_keys_030`` reads that in
         its code and is skipped as fixed upstream (the group fails there if it is gone), the others
         read ``ported`` (tests/standins/test_rank_processes.py runs TP 4 / 8 over 2 KV heads there
         with the library off).
Why      When tensor parallel exceeds the model's KV heads (Qwen3-Next: 2 KV heads, TP 4 or 8),
         ``KVPoolWorker`` sets ``put_step = tp_size // num_kv_heads`` and keys every layerwise GVA
         blob by ``head_or_tp_rank = tp_rank // put_step``; only ranks with
         ``tp_rank % put_step == 0`` save, and the scheduler's hit check asks for
         ``tp_size // put_step`` keys per block. Right for full attention (those ranks hold the
         same KV heads), wrong for GDN / mamba state, which every rank holds a different slice of
         (``_init_metadata`` already keys the non-layerwise path by ``tp_rank`` for align-state
         groups). On a pool hit, ranks ``1..put_step-1`` of each head group load the leader rank's
         GDN slice: every GDN layer of those ranks starts from another rank's state.
How      For the groups that hold align state (``group_uses_align_state`` on the worker,
         ``mamba_group_ids`` on the scheduler), and only when ``put_step > 1``:
         - the key is ``model@group@hash@tp<tp_rank>`` (own rank, and a new rank field -- see below);
         - every rank saves its own slice: upstream's save methods run on a view of the worker
           with ``put_step`` 1 (so none of them returns early), in which the keys of the groups
           the leader saves count as already allocated (so a non-leader allocates only its own
           GDN keys, never a second copy of the shared attention keys);
         - the hit check asks for all ``tp_size`` per-rank keys of such a group's block, so a
           block is a hit only when every rank's slice is ready.
         Keys become ready (``batch_write_finish``) only when the sending thread reaches the
         model's final layer, which is a full-attention layer that non-leader ranks do not save:
         when a rank allocated keys in a step but queues nothing at the final layer,
         ``_build_shared_save_data`` adds an empty save task there (no blocks, only the step's
         keys), so the thread finishes them after the rank's last real copy.
         Full-attention groups, single-group models and ``put_step == 1`` are left exactly as they
         are: their keys are byte-identical, existing pools stay valid.
GDN keys already in a pool
         were written by leader ranks only, under ``@<head_or_tp_rank>``; for ``put_step > 1`` the
         new keys carry ``@tp<rank>``, so none of the old GDN keys is ever asked for: they count
         as misses (never as another rank's hit) and age out of MemCache. The first request of a
         prefix after the upgrade therefore misses, recomputes and saves per-rank GDN keys; its
         attention keys already exist, so upstream logs ``alloc_gvas FAIL`` for them once (its
         usual answer to an existing key) and keeps the existing blobs.
Group    ``gdn_tp_step_end`` (vllm-ascend 0.26.0rc1): a non-leader rank saves GDN layers but not the
         final layer (full attention, the leader's). 0.26's ``save_kv_layer`` waits at the final
         layer for that layer's event only; with nothing queued there it sets the event itself and
         ends the step while the rank's GDN copies are still queued, and clears the step's events
         under them. A copy that finishes later leaves its layer's event set: the sending thread's
         next save of that layer stops on its own assertion ("thread: 0 save failed"; the worker
         raises, the engine stops), and the step's blocks may be reused under the copy. When a rank
         queued saves in a step but none at the final layer, an empty task is queued there after
         them (0.26 finishes keys with the last real copy: the task only sets the final layer's
         event, in order). 0.25.1rc1 has ``gdn_tp_finish``'s task there; vllm-ascend 0.30.0rc2's
         final-layer wait drains the sending queue itself (member ``gdn_tp_step_end_030``).
Removal  When vllm-ascend keys layerwise align-state groups per TP rank itself (detected: the
         whole group skips itself if ``_make_layerwise_gva_key`` reads ``group_uses_align_state``).
"""

from __future__ import annotations

import functools
import importlib

from .._checks import Group
from .._ranges import ASCEND_026, V025, V025_026, V029_030
from .._targets import STORE
from .._checks import expects as _expects
from .._checks import source as _source

RISK = "GDN state keyed per KV head: at TP > KV heads, ranks load another rank's GDN slice on a pool hit"


def rank_key(model_name: str, group_id: int, block_hash_hex: str, tp_rank: int) -> str:
    """The layerwise GVA key of one TP rank's slice of an align-state (GDN) group's block."""
    return f"{model_name}@{group_id}@{block_hash_hex}@tp{tp_rank}"


def _per_rank(worker, group_id: int) -> bool:
    if worker.put_step <= 1:
        return False  # every rank keys its own blobs already (put_step 1): nothing changes
    align = worker.group_uses_align_state
    return group_id < len(align) and align[group_id]


# ------------------------------------------------------------------------------------- worker half
def make_key(original):
    @functools.wraps(original)
    def _make_layerwise_gva_key(self, group_id, block_hash_hex):
        if _per_rank(self, group_id):
            return rank_key(self.model_name, group_id, block_hash_hex, self.tp_rank)
        return original(self, group_id, block_hash_hex)

    return _make_layerwise_gva_key


class _LeaderKeysTaken:
    """The worker's GVA cache as a non-leader rank sees it while saving: keys of groups only the
    leader rank saves count as present, so upstream's save code allocates nothing for them."""

    __slots__ = ("cache", "prefixes")

    def __init__(self, cache: dict, prefixes: tuple[str, ...]):
        self.cache, self.prefixes = cache, prefixes

    def __contains__(self, key) -> bool:
        return key.startswith(self.prefixes) or key in self.cache

    def get(self, key, default=None):
        return self.cache.get(key, default)

    def __getitem__(self, key):
        return self.cache[key]

    def __setitem__(self, key, value) -> None:
        self.cache[key] = value

    def __delitem__(self, key) -> None:  # mamba_pool_hit's wrapper takes back its placeholders
        del self.cache[key]

    def pop(self, key, *default):  # vllm-ascend 0.26 drops evicted entries (and partial keys)
        return self.cache.pop(key, *default)


class _AsSaver:
    """A non-leader worker seen as one that saves (``put_step`` 1), for its align-state groups only.

    Everything else -- attributes, methods (bound to the real worker), writes -- is the worker's."""

    put_step = 1

    def __init__(self, worker):
        leader_only = tuple(
            f"{worker.model_name}@{g}@" for g in range(worker.num_kv_cache_groups) if not _per_rank(worker, g)
        )
        object.__setattr__(self, "_worker", worker)
        object.__setattr__(self, "_allocated_gvas", _LeaderKeysTaken(worker._allocated_gvas, leader_only))

    def __getattr__(self, name):
        return getattr(self._worker, name)

    def __setattr__(self, name, value):
        setattr(self._worker, name, value)


def _non_leader(worker) -> bool:
    return worker.put_step > 1 and worker.tp_rank % worker.put_step != 0


def make_process_save(original):
    @functools.wraps(original)
    def _process_save_for_layer_batch(self, requests, layer_id, group_id=0, layer_idx_in_group=0):
        if _non_leader(self) and _per_rank(self, group_id):
            return original(_AsSaver(self), requests, layer_id, group_id, layer_idx_in_group)
        return original(self, requests, layer_id, group_id, layer_idx_in_group)

    return _process_save_for_layer_batch


def make_alloc(original):
    @functools.wraps(original)
    def _alloc_gvas_for_save(self, requests):
        if _non_leader(self) and any(_per_rank(self, g) for g in range(self.num_kv_cache_groups)):
            return original(_AsSaver(self), requests)
        return original(self, requests)

    return _alloc_gvas_for_save


def make_build_shared(original):
    shared_cls = importlib.import_module(f"{STORE}.config_data").SharedBlockData
    task_cls = original.__globals__["LayerTransferTask"]

    @functools.wraps(original)
    def _build_shared_save_data(self):
        original(self)
        final = self.layer_save_tasks[self.num_layers - 1]
        if any(t.shared_block_data is not None for t in final):
            return
        keys: dict[str, None] = {}
        group_id = None
        for tasks in self.layer_save_tasks:
            for task in tasks:
                if task.shared_block_data is not None and task.shared_block_data.save_keys:
                    keys.update(dict.fromkeys(task.shared_block_data.save_keys))
                    group_id = task.group_id
        if not keys:
            return
        import numpy as np

        empty = np.zeros(0, dtype=np.int64)
        finish = shared_cls(empty, empty, [], [], save_keys=list(keys))
        last = self.num_layers - 1
        final.append(task_cls(layer_id=last, block_ranges=[], shared_block_data=finish, group_id=group_id))

    return _build_shared_save_data


def make_step_end(original):
    task_cls = original.__globals__["LayerTransferTask"]

    @functools.wraps(original)
    def _build_shared_save_data(self):
        original(self)
        last = self.num_layers - 1
        if self.layer_save_tasks[last]:
            return  # the thread sets the final layer's event after the rank's earlier copies
        queued = [t for tasks in self.layer_save_tasks[:last] for t in tasks if t.shared_block_data is not None]
        if queued:
            self.layer_save_tasks[last].append(task_cls(layer_id=last, block_ranges=[], group_id=queued[-1].group_id))

    return _build_shared_save_data


# ---------------------------------------------------------------------------------- scheduler half
def make_hit_keys(original):
    @functools.wraps(original)
    def _make_layerwise_gva_keys_for_hit_check(self, group_id, block_hash_hex):
        if self.put_step > 1 and group_id in self.mamba_group_ids:
            return [rank_key(self.model_name, group_id, block_hash_hex, r) for r in range(self.tp_size)]
        return original(self, group_id, block_hash_hex)

    return _make_layerwise_gva_keys_for_hit_check


# ----------------------------------------------------------------------------- checks on targets
def _upstream_keys_per_rank(_original) -> str | None:
    worker = importlib.import_module(f"{STORE}.pool_worker").KVPoolWorker
    if "group_uses_align_state" in _source(worker._make_layerwise_gva_key):
        return "KVPoolWorker._make_layerwise_gva_key keys align-state groups itself"
    return None


def _finish_upstream(original) -> str | None:
    if "write_finish_keys" in _source(original):
        return "vllm-ascend finishes a step's keys with its last save task on every rank (write_finish_keys)"
    return _upstream_keys_per_rank(original)


def _drains_sends_030(original) -> str | None:
    if "unfinished_tasks" in _source(original):
        return "vllm-ascend's final-layer save wait drains the sending queue (a rank's last copies end its step)"
    return None


def _worker_ok(params, needs=(), globals_=()):
    check = _expects(params, needs=needs, globals_=globals_)

    def checked(original) -> str | None:
        problem = check(original)
        if problem:
            return problem
        worker = original.__globals__.get("KVPoolWorker")
        if worker is None or "group_uses_align_state" not in _source(worker._init_metadata):
            return "KVPoolWorker no longer records group_uses_align_state"
        return None

    return checked


def _scheduler_ok(original) -> str | None:
    problem = _expects(["self", "group_id", "block_hash_hex"], needs=("put_step",))(original)
    if problem:
        return problem
    scheduler = original.__globals__.get("KVPoolScheduler")
    if scheduler is None or "mamba_group_ids" not in _source(scheduler.__init__):
        return "KVPoolScheduler no longer records mamba_group_ids"
    return None



def _keys_per_rank_030(original) -> str | None:
    """vllm-ascend 0.30.0rc2 (which reworked this group's targets: the hit check, keys and sending
    thread) keys, saves and hit-checks align-state groups per TP rank itself."""
    worker = _source(importlib.import_module(f"{STORE}.pool_worker").KVPoolWorker)
    if "self.tp_size if group_id in self.num_speculative_blocks_by_group" in _source(original) and (
        "or self.group_uses_align_state[group_id]" in worker
    ):
        return (
            "vllm-ascend saves every rank's slice of an align-state (GDN) group and its hit check asks all "
            "tp_size keys of such a group's block"
        )
    return None


GROUP = Group(
    "gdn_tp_keys",
    V025_026,
    risk=RISK,
    why="GDN (align-state) groups are keyed, saved and loaded per TP rank in the layerwise pool",
    fixed_upstream=_upstream_keys_per_rank,
    # vllm-ascend 0.30.0rc2: fixed there (gdn_tp_keys_030 reads it; tests/standins/test_rank_processes.py
    # test_layout_saves_and_hits runs TP 4 / 8 over 2 KV heads on v0300 with the library off)
    ported_to=((V029_030, "member gdn_tp_keys_030 (vllm-ascend keys GDN state per TP rank itself)"),),
)


_SAVE_NEEDS = ("self.put_step", "_make_layerwise_gva_key", "_allocated_gvas")

SPECS = (
    GROUP.spec(
        "gdn_tp_key",
        f"{STORE}.pool_worker:KVPoolWorker._make_layerwise_gva_key",
        make_key,
        precondition=_worker_ok(["self", "group_id", "block_hash_hex"], needs=("head_or_tp_rank",)),
    ),
    GROUP.spec(
        "gdn_tp_save",
        f"{STORE}.pool_worker:KVPoolWorker._process_save_for_layer_batch",
        make_process_save,
        precondition=_worker_ok(["self", "requests", "layer_id", "group_id", "layer_idx_in_group"], needs=("self.put_step",)),
    ),
    GROUP.spec(
        "gdn_tp_alloc",
        f"{STORE}.pool_worker:KVPoolWorker._alloc_gvas_for_save",
        make_alloc,
        precondition=_worker_ok(["self", "requests"], needs=(*_SAVE_NEEDS, "batch_alloc", "save_keys")),
        after=("mamba_pool_no_null_keys",),  # mamba_pool_hit's filter of null blocks wraps it first
    ),
    GROUP.spec(
        "gdn_tp_finish",
        f"{STORE}.pool_worker:KVPoolWorker._build_shared_save_data",
        make_build_shared,
        precondition=_worker_ok(["self"], needs=("layer_save_tasks", "shared_block_data"), globals_=("LayerTransferTask",)),
        fixed_upstream=_finish_upstream,
    ),
    GROUP.vouched(
        "gdn_tp_keys_030",
        f"{STORE}.pool_scheduler:KVPoolScheduler._make_layerwise_hit_check_keys",
        _keys_per_rank_030,
        ranges=V029_030,
        what="vllm-ascend 0.30.0rc2's per-TP-rank keys of align-state groups",
    ),
    GROUP.spec(
        "gdn_tp_hit_check",
        f"{STORE}.pool_scheduler:KVPoolScheduler._make_layerwise_gva_keys_for_hit_check",
        make_hit_keys,
        precondition=_scheduler_ok,
    ),
)


STEP_END_GROUP = Group(
    "gdn_tp_step_end",
    ASCEND_026,
    risk="at TP > KV heads a non-leader rank's step ends before its GDN copies: its sending thread stops on 'save failed'",
    why="a rank's step ends after its queued GDN save copies (an empty final-layer task behind them)",
    # 0.25.1rc1: gdn_tp_finish queues the final-layer task (it finishes the keys there)
    ported_to=(
        (V025, "member gdn_tp_finish of group gdn_tp_keys (a final-layer task behind the rank's copies)"),
        (V029_030, "member gdn_tp_step_end_030 (vllm-ascend drains the sending queue at the final layer)"),
    ),
)

STEP_END_SPECS = (
    STEP_END_GROUP.spec(
        "gdn_tp_step_end",
        f"{STORE}.pool_worker:KVPoolWorker._build_shared_save_data",
        make_step_end,
        precondition=_worker_ok(["self"], needs=("layer_save_tasks", "shared_block_data"), globals_=("LayerTransferTask",)),
        after=("gdn_tp_finish",),
    ),
    STEP_END_GROUP.vouched(
        "gdn_tp_step_end_030",
        f"{STORE}.pool_worker:KVPoolWorker._wait_for_final_layer_save",
        _drains_sends_030,
        ranges=V029_030,
        what="vllm-ascend 0.30.0rc2's drain of the sending queue at the final layer",
        after=("mamba_lifetime_030", "send_stuck_030"),
    ),
)
