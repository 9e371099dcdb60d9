"""MTP speculative decoding with the layerwise pool: the draft layer's own place, and a step the
drafter skips (groups ``mtp_layer`` and ``mtp_step_end``).

Target   vllm_ascend...ascend_store.pool_worker: KVPoolWorker._init_layerwise_config (``mtp_layer``:
         the map of each physical layer to the (group, layer-in-group) slots the pool saves and loads
         with it, and the per-layer task lists); ...ascend_store.ascend_store_connector:
         AscendStoreConnector.wait_for_save (``mtp_step_end``: the step's end, after the drafter --
         vLLM's ``finalize_kv_connector`` under speculative decoding), .save_kv_layer and
         .wait_for_layer_load (``mtp_step_end``: the MTP layer's load, before the drafter).
Versions ``mtp_layer``: vLLM >=0.25,<0.26 with vllm-ascend 0.25.1rc1 (vllm-ascend 0.26.0rc1 and
         0.30.0rc2 map an MTP layer to ``num_hidden_layers + K`` themselves: members mtp_layer_026 /
         mtp_layer_030 read it). ``mtp_step_end``: every pair (vllm-ascend 0.25.1rc1, 0.26.0rc1,
         0.30.0rc2 as member mtp_step_end_030).
Why      Under MTP (Qwen3.5's ``qwen3_5_mtp``, Qwen3-Next's ``qwen3_next_mtp``) the draft model's
         attention layer ``mtp.layers.0.self_attn.attn`` sits in the target's attention KV cache group,
         and the pool keeps its KV in that group's keys.
         ``mtp_layer``: 0.25.1rc1's ``_extract_physical_layer_index`` matches ``layers\\.(\\d+)`` first,
         so the MTP layer is physical layer 0: its KV is saved with layer 0's, when the target's first
         layer runs -- before the drafter (after the target's last layer and sampling) wrote this
         step's MTP KV. Every key holds stale MTP KV, every pool hit loads it, and the draft attends
         over it for the rest of the request: tokens stay right (the target verifies), acceptance is
         lost. Pool harness (tests/standins/test_mtp_layer.py, MTP 3): group off, B's MTP layer reads
         its 3 hit blocks wrong and 0 of 30 draft tokens are accepted where the run without the pool
         accepts 5 of 20 (drafts scheduled and verified as speculative tokens); on, 0 wrong and 5 of 20.
         ``mtp_step_end``: the runners skip the drafter in a step whose batch does not fit it (a
         sequence reaching the model length: vLLM's ``input_fits_in_drafter``, vllm-ascend 0.30's
         ``_skip_drafting``). The worker counts the MTP layer as the step's last, so that step never
         reaches its final-layer save: the end-of-step wait and the clearing of the layer save events
         never run, and the next step's first save finds its event still set -- the layer sending
         thread stops on its "save failed" assertion (0.25: logged, that save lost; 0.26 / 0.30: the
         worker raises and the engine stops). The same holds in every step where the drafter runs
         as a replayed graph (no Python wrapper, so no connector hook around its MTP layer), and
         there the MTP layer's load was never waited for before the draft read it: on 0.25.1rc1,
         whose layer loads are submitted by their own wait, the draft reads the hit's MTP blocks
         before their load (harness: 0 of 3 right, 0 draft tokens accepted; tokens right).
How      ``mtp_layer``: after the original builds the map, each MTP slot (a layer named ``mtp.K`` /
         ``mtp.layers.K``) moves from the physical layer upstream gave it to ``num_hidden_layers + K``,
         and the worker's layer count and task lists grow to cover it: the MTP layer's first hook call
         of a step (the drafter's first pass; later passes find ``current_layer`` past the last layer,
         as upstream ignores them) loads and saves it, and is the step's final layer. Keys, allocation
         sizes and the slot layout inside a key are upstream's (the MTP slot keeps its place in its
         group): instances with and without the patch read each other's keys; only the MTP slot's
         bytes differ (right with the patch).
         ``mtp_step_end``: once the target's last layer is saved, the connector waits for the MTP
         layer's load (the draft reads it next, hooks or not) and its own wait for that layer does
         not wait again; at the step's end, when no MTP hook came, the connector runs the MTP layer's
         save itself, after the draft wrote its KV (``steps_without_draft`` counts those steps). Their keys are finished as
         every step's are; the MTP slot holds what the instance's own cache holds -- no draft KV for
         that step's tokens, which the instance's own later drafts read too: acceptance only.
Removal  ``mtp_layer``: when 0.25's own ``_extract_physical_layer_index`` maps ``mtp.layers.0`` past the
         target's layers (detected). ``mtp_step_end``: when the connector's ``wait_for_save`` finishes
         the step's remaining layers itself (detected: it names ``current_layer`` and ``save_kv_layer``).
"""

from __future__ import annotations

import functools
import re

from .._checks import Counts, Group, lookup, source
from .._checks import param_names as _params
from .._ranges import ASCEND_026, V025, V025_026, V029_030
from .._targets import STORE

WORKER = f"{STORE}.pool_worker:KVPoolWorker"
CONNECTOR = f"{STORE}.ascend_store_connector:AscendStoreConnector"
#: an MTP draft layer's name: ``mtp.K.`` or ``mtp.layers.K.`` (Qwen3-Next / Qwen3.5 MTP modules)
MTP_NAME = re.compile(r"(?:^|\.)mtp(?:\.layers)?\.(\d+)(?:\.|$)")

_COUNTS = Counts("mtp_layers_moved", "steps_without_draft")


def _probe_index(extract) -> int:
    """What ``_extract_physical_layer_index`` gives Qwen3.5's MTP layer in a 4-layer model."""
    from types import SimpleNamespace

    probe = SimpleNamespace(hf_config=SimpleNamespace(num_hidden_layers=4), num_layers=4)
    return extract(probe, "mtp.layers.0.self_attn.attn")


def _mtp_mapped_after_target(extract) -> str | None:
    try:
        index = _probe_index(extract)
    except Exception:  # noqa: BLE001 - a probe the method no longer runs on: not known to be fixed
        return None
    if index >= 4:
        return f"the pool worker maps the MTP layer after the target's layers itself (probe: physical layer {index} of a 4-layer model)"
    return None


def _fixed_upstream(_original) -> str | None:
    return _mtp_mapped_after_target(lookup(WORKER)._extract_physical_layer_index)


def _precondition(original) -> str | None:
    if _params(original) != ["self"]:
        return f"KVPoolWorker._init_layerwise_config parameters are {_params(original)}"
    text = source(original)
    for needed in ("physical_layer_to_group_layers", "layer_save_tasks", "layer_load_tasks", "_extract_physical_layer_index"):
        if text and needed not in text:
            return f"KVPoolWorker._init_layerwise_config no longer uses {needed}"
    worker = lookup(WORKER)
    for name in ("_extract_physical_layer_index", "save_kv_layer", "wait_for_layer_load", "wait_for_save"):
        if not callable(getattr(worker, name, None)):
            return f"KVPoolWorker.{name} is gone"
    save = source(worker.save_kv_layer)
    if save and ("self.current_layer >= self.num_layers" not in save or "self.num_layers - 1" not in save):
        return "KVPoolWorker.save_kv_layer no longer counts layers up to num_layers (the MTP layer's place is unknown)"
    return None


def _slots(worker) -> list[tuple[int, int, int, str]]:
    """Each MTP slot of the worker's map, as upstream numbered it: (group, layer in group, upstream's
    physical layer, name); upstream numbers a group's physical layers in the order its names first
    give them (``_init_layerwise_config``)."""
    hidden = _hidden(worker) or worker.num_layers
    slots = []
    for group_id, group in enumerate(worker.kv_cache_config.kv_cache_groups):
        order: dict[int, int] = {}
        for name in group.layer_names:
            physical = worker._extract_physical_layer_index(name)
            if physical >= hidden:
                continue
            order.setdefault(physical, len(order))
            if MTP_NAME.search(name):
                slots.append((group_id, order[physical], physical, name))
    return slots


def moved_mtp(original):
    """``_init_layerwise_config`` that gives each MTP slot its own physical layer after the target's."""

    @functools.wraps(original)
    def _init_layerwise_config(self):
        original(self)
        if self.kv_cache_config is None or self.num_kv_cache_groups <= 1:
            return  # one group: upstream counts the MTP layer in num_layers itself (register_kv_caches)
        hidden = _hidden(self) or self.num_layers
        if self.num_layers != hidden:  # a pipeline stage: the MTP layer is the last stage's
            return
        mapping = self.physical_layer_to_group_layers
        moved = {}
        for group_id, slot, physical, name in _slots(self):
            target = hidden + int(MTP_NAME.search(name).group(1))
            entries = mapping.get(physical, [])
            if (group_id, slot) not in entries:
                continue
            others = [n for n in self.kv_cache_config.kv_cache_groups[group_id].layer_names if n != name]
            if any(self._extract_physical_layer_index(n) == physical for n in others):
                from ...host import logger

                logger().warning(
                    "ascend_layerwise_patch: MTP layer %s shares physical layer %d with a target layer of its group: "
                    "left where vllm-ascend put it (its pool KV is saved before the drafter writes it)",
                    name,
                    physical,
                )
                continue
            entries.remove((group_id, slot))  # an emptied entry stays: [] (never the (0, layer) default)
            mapping.setdefault(target, []).append((group_id, slot))
            moved[target] = name
        if not moved:
            return
        count = max(moved) + 1
        self.layer_load_tasks.extend([] for _ in range(count - self.num_layers))
        self.layer_save_tasks.extend([] for _ in range(count - self.num_layers))
        self.num_layers = count
        _COUNTS.add("mtp_layers_moved", len(moved))

    return _init_layerwise_config


#: the connector attribute marking the MTP layer's load as waited for early: (step's metadata id, layer)
EARLY = "_alp_mtp_load_waited"


def _save_role(connector) -> bool:
    return connector.use_layerwise and connector.kv_role != "kv_consumer"


def _waited_early(connector, worker) -> bool:
    """Pops the mark: True when this step's MTP layer load at ``worker.current_layer`` was waited for."""
    mark = connector.__dict__.pop(EARLY, None)
    return mark is not None and mark == (id(connector._get_connector_metadata()), worker.current_layer)


def load_before_draft(original):
    """The connector's ``save_kv_layer`` that, once the target's last layer is saved, waits for the MTP
    layer's load: the draft reads the hit's MTP KV next, whether its own hooks run or not (a draft
    replayed as a graph runs none)."""

    @functools.wraps(original)
    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        original(self, layer_name, kv_layer, attn_metadata, **kwargs)
        worker = getattr(self, "connector_worker", None)
        if worker is not None and _save_role(self) and target_done(worker):
            worker.wait_for_layer_load()
            self.__dict__[EARLY] = (id(self._get_connector_metadata()), worker.current_layer)

    return save_kv_layer


def skip_waited_load(original):
    """The connector's ``wait_for_layer_load`` that does not wait again for a load waited for early."""

    @functools.wraps(original)
    def wait_for_layer_load(self, layer_name):
        worker = getattr(self, "connector_worker", None)
        if worker is not None and EARLY in self.__dict__ and _waited_early(self, worker):
            return None
        return original(self, layer_name)

    return wait_for_layer_load


def finish_undrafted_step(original):
    """The connector's ``wait_for_save`` (the step's end, after the drafter) that first runs the MTP
    layer's hooks of a step whose drafter never came."""

    @functools.wraps(original)
    def wait_for_save(self):
        worker = getattr(self, "connector_worker", None)
        if worker is not None and _save_role(self) and undrafted(worker):
            _COUNTS.add("steps_without_draft")
            metadata = self._get_connector_metadata()
            while worker.current_layer < worker.num_layers:
                if not _waited_early(self, worker):
                    worker.wait_for_layer_load()
                worker.save_kv_layer(metadata)
        self.__dict__.pop(EARLY, None)
        return original(self)

    return wait_for_save


def target_done(worker) -> bool:
    """The target's last layer has just been saved; the MTP layer(s) have not run."""
    return undrafted(worker) and worker.current_layer == _hidden(worker)


def _hidden(worker):
    return getattr(getattr(worker, "hf_config", None), "num_hidden_layers", None)


def undrafted(worker) -> bool:
    """The step's forward passed the target's last layer and not the worker's last one: the MTP
    layer(s) the worker counts after the target's have not run (yet, or at all this step)."""
    hidden = _hidden(worker)
    return isinstance(hidden, int) and hidden <= worker.current_layer < worker.num_layers


counters = _COUNTS.snapshot


#: the connector methods the group wraps, with the parameters it calls them with
CONNECTOR_PARAMS = {
    "wait_for_save": ["self"],
    "save_kv_layer": ["self", "layer_name", "kv_layer", "attn_metadata", "kwargs"],
    "wait_for_layer_load": ["self", "layer_name"],
}


def _check_step_end(_original) -> str | None:
    """One check for every member (a group applies whole): the three connector methods it wraps, the
    worker's layer hooks it calls and their layer count."""
    connector = lookup(CONNECTOR)
    for name, params in CONNECTOR_PARAMS.items():
        if _params(getattr(connector, name)) != params:
            return f"AscendStoreConnector.{name} parameters are {_params(getattr(connector, name))}, expected {params}"
    if not callable(getattr(connector, "_get_connector_metadata", None)):
        return "AscendStoreConnector._get_connector_metadata is gone"
    worker = lookup(WORKER)
    for name, params in (("wait_for_layer_load", ["self"]), ("save_kv_layer", ["self", "connector_metadata"])):
        if _params(getattr(worker, name)) != params:
            return f"KVPoolWorker.{name} parameters are {_params(getattr(worker, name))}, expected {params}"
    save = source(worker.save_kv_layer)
    if save and ("self.current_layer" not in save or "num_layers" not in save):
        return "KVPoolWorker.save_kv_layer no longer counts the step's layers in current_layer / num_layers"
    return None


def _step_end_fixed(_original) -> str | None:
    text = source(lookup(CONNECTOR).wait_for_save)
    if text and "current_layer" in text and "save_kv_layer" in text:
        return "the connector's wait_for_save already finishes the step's remaining layers"
    return None


GROUP = Group(
    "mtp_layer",
    V025,
    risk="under MTP every pool key holds the draft layer's KV from before the drafter wrote it: pool hits lose draft acceptance",
    ported_to=(
        (ASCEND_026, "member mtp_layer_026 (vllm-ascend maps the MTP layer after the target's layers)"),
        (V029_030, "member mtp_layer_030 (vllm-ascend maps the MTP layer after the target's layers)"),
    ),
    fixed_upstream=_fixed_upstream,
)

SPECS = (
    GROUP.spec(
        "mtp_layer",
        f"{WORKER}._init_layerwise_config",
        moved_mtp,
        why="the MTP draft layer is saved and loaded as its own physical layer after the target's last, once the drafter wrote it",
        precondition=_precondition,
        counters=counters,
    ),
    GROUP.vouched(
        "mtp_layer_026",
        f"{WORKER}._extract_physical_layer_index",
        _mtp_mapped_after_target,
        ranges=ASCEND_026,
        what="vllm-ascend 0.26.0rc1's MTP layer index (num_hidden_layers + K)",
    ),
    GROUP.vouched(
        "mtp_layer_030",
        f"{WORKER}._extract_physical_layer_index",
        _mtp_mapped_after_target,
        ranges=V029_030,
        what="vllm-ascend 0.30.0rc2's MTP layer index (num_hidden_layers + K)",
        after=("mtp_layer_026",),  # one target, disjoint ranges: never both in force
    ),
)

STEP_END_GROUP = Group(
    "mtp_step_end",
    V025_026,
    ported_to=((V029_030, "member mtp_step_end_030 (the same wrapper on 0.30's connector)"),),
    risk="a step whose drafter did not run leaves the layer sending thread's events set: its next save stops on 'save failed'",
    why="a step whose drafter did not run still runs the MTP layer's load wait and save at the step's end (the final-layer wait, its keys finished)",
    precondition=_check_step_end,
    fixed_upstream=_step_end_fixed,
    counters=counters,
)

STEP_END_SPECS = (
    STEP_END_GROUP.spec("mtp_step_end", f"{CONNECTOR}.wait_for_save", finish_undrafted_step),
    STEP_END_GROUP.spec("mtp_load_before_draft", f"{CONNECTOR}.save_kv_layer", load_before_draft),
    STEP_END_GROUP.spec("mtp_load_waited", f"{CONNECTOR}.wait_for_layer_load", skip_waited_load),
    STEP_END_GROUP.spec("mtp_step_end_030", f"{CONNECTOR}.wait_for_save", finish_undrafted_step, ranges=V029_030, after=("mtp_step_end",)),
    STEP_END_GROUP.spec(
        "mtp_load_before_draft_030", f"{CONNECTOR}.save_kv_layer", load_before_draft, ranges=V029_030, after=("mtp_load_before_draft",)
    ),
    STEP_END_GROUP.spec(
        "mtp_load_waited_030", f"{CONNECTOR}.wait_for_layer_load", skip_waited_load, ranges=V029_030, after=("mtp_load_waited",)
    ),
)
