"""GDN layers join layerwise transfer: wait -> fence -> compute -> save, per layer, in order.

Each scenario is one test, run on every release line it applies to (``Release``: the pairs, and the
GDN layers that show it there). On vllm-ascend 0.25 / 0.26 the main GDN layer never waits for its
layerwise load (``gdn_layerwise``); a full-attention layer follows the GDN ones, through vLLM's real
``maybe_transfer_kv_layer`` decorator. On vllm-ascend 0.30.0rc2 (issue 25) the main GDN layer waits
itself (gdn_layerwise is skipped as fixed upstream: a control there), and the 310P GDN layer still
computes on state its layerwise load may still be writing (``gdn_layerwise_310p``).

The layers are real objects of the release's classes running the patched, real ``_forward_core``
against a real KVConnectorBase_V1 that logs waits and saves (counting_connector.py). What cannot run
on a CPU is the NPU itself, so two things stand in for it:
- the compute-start fence's NPU event (``torch.npu.Event``, a mock under the stand-ins) logs
  ``fence`` when recorded;
- the layer's on-device state (``self.kv_cache``) logs ``compute`` when the original first reads it.
  In the decode/prefill paths the next thing the original does is launch NPU custom ops and
  triton-ascend kernels, which cannot run here, so the state stand-in then raises
  ``NPUComputeUnavailable`` and the test performs the layer's save the way the original's last line
  does (``maybe_save_kv_layer_to_connector("", [])`` through the layer module's own copy).
  The profile-run path (no attention metadata) runs the original to its end for real.
A GDN layer that reads its state before the connector's ``wait_for_layer_load`` for it returned reads a
state the pool may not have written yet: counted as a wrong read.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import NamedTuple

import pytest
import torch

import ascend_layerwise_patch as alp
from support import on

GDN = "vllm_ascend.ops.gdn"
GDN310 = "vllm_ascend._310p.ops.fla.gdn_310"
#: the full-attention layer after the GDN ones (0.25 / 0.26)
ATTN = "model.layers.3.self_attn.attn"


class Release(NamedTuple):
    """A release line and the GDN layers its scenarios run: three layers of each kind."""

    name: str
    pairs: tuple[str, ...]
    #: layer kind -> (its module, its class, the index of its first layer)
    layers: dict[str, tuple[str, str, int]]
    #: the module of the compute-start fence the layers record (the stand-in NPU event logs it)
    fence: str
    #: the step's GDN attention metadata: its counts that are not 0 (every required field is 0 but these)
    step: dict[str, int]
    #: a full-attention layer after the GDN ones, through vLLM's real ``maybe_transfer_kv_layer``
    full_attention: bool = False
    #: the layer classes leave vLLM's abstract ``get_state_shape`` to their subclasses: the layers are
    #: of a subclass that defines it
    abstract_state_shape: bool = False
    #: the layer kinds that wait and fence themselves upstream (their patch is skipped as fixed upstream)
    waits_upstream: frozenset = frozenset()


#: vllm-ascend 0.25.1rc1 / 0.26.0rc1 (vllm-ascend's ops.gdn does not import on vLLM 0.25.0: not v0250)
BASE = Release(
    "0.25-0.26",
    ("v0251", "v0260"),
    {"main": (GDN, "AscendGatedDeltaNetAttention", 0)},
    fence="vllm_ascend.memcache_comm_fence",
    step={"num_decodes": 1, "num_decode_tokens": 1, "num_actual_tokens": 1},  # a one-token decode
    full_attention=True,
)
#: vllm-ascend 0.30.0rc2 (issue 25), on vLLM 0.30.0 and 0.29.0: the main GDN layer waits itself
V030 = Release(
    "0.30",
    ("v0300", "v0290"),
    {"main": (GDN, "AscendGatedDeltaNetAttention", 10), "310p": (GDN310, "AscendGatedDeltaNetAttention310", 0)},
    fence="vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.attention_fence",
    step={"num_prefills": 1, "num_actual_tokens": 1},  # a one-token prefill
    abstract_state_shape=True,  # the 310P class does
    waits_upstream=frozenset({"main"}),
)


class NPUComputeUnavailable(Exception):
    pass


class DeviceState:
    """Stands in for a GDN layer's NPU conv/SSM state tensors."""

    def __init__(self, log, prefix):
        self.log, self.prefix = log, prefix

    def __getitem__(self, index):
        self.log.append(("compute", self.prefix))
        raise NPUComputeUnavailable(self.prefix)


class Stack(NamedTuple):
    #: ``step(kind, bind=True)``: one forward step of that kind's three GDN layers (then the
    #: full-attention layer, if the release has one); returns (the ordered log, the layers)
    step: object
    connector: object
    config: object
    #: layer kind -> its three layers
    layers: dict


def _metadata(release: Release):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    required = {
        f.name: 0
        for f in dataclasses.fields(GDNAttentionMetadata)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    return GDNAttentionMetadata(**{**required, **release.step})


def _build(release: Release, undo: list) -> Stack:
    importlib.import_module("vllm_ascend.ops")
    modules = {kind: importlib.import_module(module) for kind, (module, _cls, _first) in release.layers.items()}
    fence = importlib.import_module(release.fence)
    if release.full_attention:
        from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer

    import counting_connector

    connector, config, restore = counting_connector.install()
    undo.append(restore)
    log = connector.calls  # one ordered log: the connector appends wait/save, the stand-ins the rest

    class FenceEvent:
        def record(self, stream=None):
            log.append(("fence", ""))

        def synchronize(self):
            pass

    saved_event = torch.npu.Event
    torch.npu.Event = FenceEvent
    undo.append(lambda: setattr(torch.npu, "Event", saved_event))
    fence.reset_attention_compute_start_gate()

    def layers_of(kind):
        _module, name, first = release.layers[kind]
        cls = getattr(modules[kind], name)
        if release.abstract_state_shape:
            cls = type(cls.__name__, (cls,), {"get_state_shape": lambda self: ()})
        out = []
        for i in range(first, first + 3):
            layer = cls.__new__(cls)
            torch.nn.Module.__init__(layer)
            layer.prefix = f"model.layers.{i}.linear_attn"
            layer.kv_cache = DeviceState(log, layer.prefix)
            out.append(layer)
        return out

    layers = {kind: layers_of(kind) for kind in release.layers}

    if release.full_attention:

        class FullAttention(torch.nn.Module):
            kv_cache = torch.zeros(1)

        config.compilation_config.static_forward_context[ATTN] = FullAttention()

        @maybe_transfer_kv_layer
        def full_attention(query, layer_name):
            fence.record_attention_compute_start()  # as vllm-ascend's attention backend does
            log.append(("compute", layer_name))
            return query

    def step(kind, *, bind=True):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
        from vllm.forward_context import set_forward_context

        chosen, module = layers[kind], modules[kind]
        metadata = {layer.prefix: _metadata(release) for layer in chosen}
        if release.full_attention:
            metadata[ATTN] = object()
        log.clear()
        connector.start_load_kv(None)  # a new step: the layer counter starts at 0
        if bind:
            connector.bind_connector_metadata(KVConnectorMetadata())
        try:
            with set_forward_context(metadata, config, slot_mapping={}):
                for layer in chosen:
                    t = torch.zeros(1, 1)
                    with pytest.raises(NPUComputeUnavailable):
                        layer._forward_core(t, t, t, t)
                    module.maybe_save_kv_layer_to_connector("", [])  # the original's own last line
                if release.full_attention:
                    full_attention(torch.zeros(1), ATTN)
        finally:
            if bind:
                connector.clear_connector_metadata()
        return list(log), chosen

    return Stack(step, connector, config, layers)


@pytest.fixture(scope="module")
def stacks():
    """``stacks(release)``: that release's layers and connector, built on first use (the pairs marks
    run one release line per pytest process)."""
    built: dict[str, Stack] = {}
    undo: list = []

    def get(release: Release) -> Stack:
        if release.name not in built:
            built[release.name] = _build(release, undo)
        return built[release.name]

    yield get
    for fn in reversed(undo):
        fn()


def ordered(release: Release, layers) -> list[tuple[str, str]]:
    """Every GDN layer waits, fences, computes, saves, in order (then the full-attention layer)."""
    out = [e for layer in layers for e in (("wait", layer.prefix), ("fence", ""), ("compute", layer.prefix), ("save", ""))]
    if release.full_attention:
        out += [("wait", ATTN), ("fence", ""), ("compute", ATTN), ("save", ATTN)]
    return out


def wrong_reads(log, layers) -> int:
    """Layers whose state was read before their load was waited for (or never waited for)."""
    wrong = 0
    for layer in layers:
        compute = log.index(("compute", layer.prefix))
        waited = [i for i, entry in enumerate(log) if entry == ("wait", layer.prefix)]
        wrong += not waited or waited[0] > compute
    return wrong


@pytest.mark.pairs(*BASE.pairs)
def test_patched_core_is_installed_on_both_classes(stacks):
    stacks(BASE)
    gdn = importlib.import_module(GDN)
    importlib.import_module("vllm_ascend.patch.worker.patch_qwen3_5")
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    core = vars(gdn.AscendGatedDeltaNetAttention)["_forward_core"]
    assert core.__ascend_layerwise_patch__ == "gdn_layerwise"
    assert vars(QwenGatedDeltaNetAttention)["_forward_core"] is core


@pytest.mark.parametrize(
    "release,kind",
    [
        on(BASE, "main", name="main"),
        on(V030, "310p", name="310p"),
        on(V030, "main", name="main", control="0.30's main GDN layer is fixed upstream (gdn_layerwise skipped there)"),
    ],
)
def test_library_on_every_gdn_layer_waits_fences_computes_saves(stacks, release, kind):
    log, layers = stacks(release).step(kind)
    assert wrong_reads(log, layers) == 0 and log == ordered(release, layers), log


@pytest.mark.pairs(*BASE.pairs)
def test_dummy_step_without_metadata_only_fences(stacks):
    """No connector metadata: the guard keeps every connector call out; the fence still opens."""
    stack = stacks(BASE)
    stack.connector.clear_connector_metadata()
    log, _layers = stack.step("main", bind=False)
    assert [kind for kind, _ in log if kind in ("wait", "save")] == []
    assert stack.connector.current_layer == 0


@pytest.mark.pairs(*BASE.pairs)
def test_profile_run_runs_the_original_to_its_end(stacks):
    stack = stacks(BASE)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.forward_context import set_forward_context

    connector = stack.connector
    connector.bind_connector_metadata(KVConnectorMetadata())
    connector.calls.clear()
    try:
        with set_forward_context(None, stack.config):
            t = torch.zeros(1, 1)
            assert stack.layers["main"][0]._forward_core(t, t, t, t) is None
    finally:
        connector.clear_connector_metadata()
    assert connector.calls == [("fence", "")]  # no metadata: no wait, no state read, no save


#: the library-off scenario's controls
RELEASED = "the library reverted inside the test: "


@pytest.mark.parametrize(
    "release,kind",
    [
        on(BASE, "main", name="main", control=RELEASED + "upstream's GDN layer never waits (the defect, as released)"),
        *(
            on(V030, kind, name=kind, control=RELEASED + "the 310P defect and the main layer's upstream fix, as released")
            for kind in ("310p", "main")
        ),
    ],
)
def test_library_off_gdn_layers_read_state_before_their_load(stacks, release, kind):
    """Upstream's layers as released: they compute with no wait and no fence first (on 0.30 the
    310P layer; its main layer waits and fences itself: the control)."""
    alp.revert()
    try:
        log, layers = stacks(release).step(kind)
    finally:
        alp.activate()
    if kind in release.waits_upstream:  # control: 0.30's main GDN layer waits and fences itself
        assert wrong_reads(log, layers) == 0 and log == ordered(release, layers), log
    else:  # the defect (0.30's 310P layer: issue 25): the layer saves but never waits
        assert wrong_reads(log, layers) == len(layers), log
        assert ("wait", layers[0].prefix) not in log
        assert log != ordered(release, layers)
        assert log[:2] == [("compute", layers[0].prefix), ("save", "")], log


@pytest.mark.pairs(*BASE.pairs)
@pytest.mark.control("plain serving without a connector: neither upstream nor the patched layer calls the connector")
def test_no_connector_no_wait_no_fence(stacks):
    """Plain serving: no transfer group, so the entry adds neither call (and no lock)."""
    stack = stacks(BASE)
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.forward_context import set_forward_context

    connector = stack.connector
    connector.calls.clear()
    kv_transfer_state._KV_CONNECTOR_AGENT = None
    try:
        with set_forward_context(None, stack.config):
            t = torch.zeros(1, 1)
            assert stack.layers["main"][0]._forward_core(t, t, t, t) is None
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = connector
    assert connector.calls == []


@pytest.mark.pairs(*V030.pairs)
def test_gdn_layerwise_310p_applies_and_the_main_layer_is_fixed_upstream():
    states = {s.name: s.state for s in alp.status()}
    assert states["gdn_layerwise_310p"] == "applied" and states["gdn_layerwise"] == "skipped", states
