"""vllm-ascend 0.30.0rc2: the 310P GDN layer still computes on state its layerwise load may still be
writing (issue 25); the main GDN layer waits itself (gdn_layerwise is skipped as fixed upstream).

Same method as test_gdn_layerwise.py (0.25 / 0.26): real layers of vllm-ascend 0.30's classes run
their real ``_forward_core`` against a real KVConnectorBase_V1 that logs waits and saves; the
layer's on-device state logs ``compute`` on its first read (then raises: the NPU kernels that follow
cannot run here) and the test performs the layer's save as the original's last line does. A GDN
layer that reads its state before the connector's ``wait_for_layer_load`` for it returned reads a
state the pool may not have written yet: counted as a wrong read.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import ascend_layerwise_patch as alp

pytestmark = pytest.mark.pairs("v0300", "v0290")

FENCE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.attention_fence"


class NPUComputeUnavailable(Exception):
    pass


class DeviceState:
    def __init__(self, log, prefix):
        self.log, self.prefix = log, prefix

    def __getitem__(self, index):
        self.log.append(("compute", self.prefix))
        raise NPUComputeUnavailable(self.prefix)


def _metadata():
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    required = {
        f.name: 0
        for f in dataclasses.fields(GDNAttentionMetadata)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    return GDNAttentionMetadata(**{**required, "num_prefills": 1, "num_actual_tokens": 1})


@pytest.fixture(scope="module")
def stack():
    importlib.import_module("vllm_ascend.ops")
    gdn = importlib.import_module("vllm_ascend.ops.gdn")
    g310 = importlib.import_module("vllm_ascend._310p.ops.fla.gdn_310")
    fence = importlib.import_module(FENCE)

    import counting_connector

    connector, config, restore = counting_connector.install()
    log = connector.calls

    class FenceEvent:
        def record(self, stream=None):
            log.append(("fence", ""))

        def synchronize(self):
            pass

    saved_event = torch.npu.Event
    torch.npu.Event = FenceEvent
    fence.reset_attention_compute_start_gate()

    def layers_of(cls, first):
        # vllm-ascend 0.30's 310P class leaves vLLM's abstract get_state_shape to its subclasses
        cls = type(cls.__name__, (cls,), {"get_state_shape": lambda self: ()})
        out = []
        for i in range(first, first + 3):
            layer = cls.__new__(cls)
            torch.nn.Module.__init__(layer)
            layer.prefix = f"model.layers.{i}.linear_attn"
            layer.kv_cache = DeviceState(log, layer.prefix)
            out.append(layer)
        return out

    layers = {"310p": (layers_of(g310.AscendGatedDeltaNetAttention310, 0), g310), "main": (layers_of(gdn.AscendGatedDeltaNetAttention, 10), gdn)}

    def step(kind):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
        from vllm.forward_context import set_forward_context

        chosen, module = layers[kind]
        log.clear()
        connector.start_load_kv(None)
        connector.bind_connector_metadata(KVConnectorMetadata())
        try:
            with set_forward_context({layer.prefix: _metadata() for layer in chosen}, config, slot_mapping={}):
                for layer in chosen:
                    t = torch.zeros(1, 1)
                    with pytest.raises(NPUComputeUnavailable):
                        layer._forward_core(t, t, t, t)
                    module.maybe_save_kv_layer_to_connector("", [])  # the original's own last line
        finally:
            connector.clear_connector_metadata()
        return list(log), chosen

    yield step
    torch.npu.Event = saved_event
    restore()


def wrong_reads(log, layers) -> int:
    """Layers whose state was read before their load was waited for (or never waited for)."""
    wrong = 0
    for layer in layers:
        compute = log.index(("compute", layer.prefix))
        waited = [i for i, entry in enumerate(log) if entry == ("wait", layer.prefix)]
        wrong += not waited or waited[0] > compute
    return wrong


def ordered(layers):
    return [e for layer in layers for e in (("wait", layer.prefix), ("fence", ""), ("compute", layer.prefix), ("save", ""))]


@pytest.mark.control("the library reverted inside the test: the 310P defect and the main layer's upstream fix, as released")
@pytest.mark.parametrize("kind", ["310p", "main"])
def test_library_off_310p_layers_read_state_before_their_load(stack, kind):
    alp.revert()
    try:
        log, layers = stack(kind)
    finally:
        alp.activate()
    if kind == "310p":  # issue 25: 0.30's 310P layer saves but never waits
        assert wrong_reads(log, layers) == 3, log
        assert ("wait", layers[0].prefix) not in log
    else:  # control: 0.30's main GDN layer waits and fences itself (gdn_layerwise: fixed upstream)
        assert wrong_reads(log, layers) == 0 and log == ordered(layers), log


@pytest.mark.parametrize(
    "kind", ["310p", pytest.param("main", marks=pytest.mark.control("0.30's main GDN layer is fixed upstream (gdn_layerwise skipped there)"))]
)
def test_library_on_every_gdn_layer_waits_fences_computes_saves(stack, kind):
    log, layers = stack(kind)
    assert wrong_reads(log, layers) == 0 and log == ordered(layers), log


def test_gdn_layerwise_310p_applies_and_the_main_layer_is_fixed_upstream():
    states = {s.name: s.state for s in alp.status()}
    assert states["gdn_layerwise_310p"] == "applied" and states["gdn_layerwise"] == "skipped", states
