"""GDN layers join layerwise transfer: wait -> fence -> compute -> save, per layer, in order.

The layers are real ``AscendGatedDeltaNetAttention`` objects running the patched, real
``_forward_core``. What cannot run on a CPU is the NPU itself, so two things stand in for it:
- the compute-start fence's NPU event (``torch.npu.Event``, a mock under the stand-ins) logs
  ``fence`` when recorded;
- the layer's on-device state (``self.kv_cache``) logs ``compute`` when the original first reads it.
  In the decode/prefill paths the next thing the original does is launch NPU custom ops and
  triton-ascend kernels, which cannot run here, so the state stand-in then raises
  ``NPUComputeUnavailable`` and the test performs the layer's save the way the original's last line
  does (``maybe_save_kv_layer_to_connector("", [])`` through ``vllm_ascend.ops.gdn``'s own copy).
  The profile-run path (no attention metadata) runs the original to its end for real.
The full-attention layer goes through vLLM's real ``maybe_transfer_kv_layer`` decorator.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import ascend_layerwise_patch as alp

pytestmark = pytest.mark.pairs("v0251", "v0260")


class NPUComputeUnavailable(Exception):
    pass


class DeviceState:
    """Stands in for a GDN layer's NPU conv/SSM state tensors."""

    def __init__(self, log, prefix):
        self.log, self.prefix = log, prefix

    def __getitem__(self, index):
        self.log.append(("compute", self.prefix))
        raise NPUComputeUnavailable(self.prefix)


@pytest.fixture(scope="module")
def stack():
    importlib.import_module("vllm_ascend.ops")
    gdn = importlib.import_module("vllm_ascend.ops.gdn")
    fence = importlib.import_module("vllm_ascend.memcache_comm_fence")
    from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    import counting_connector

    connector, config, restore = counting_connector.install()
    log = connector.calls  # one ordered log: the connector appends wait/save, the stand-ins the rest

    class FenceEvent:
        def record(self, stream=None):
            log.append(("fence", ""))

        def synchronize(self):
            pass

    saved_event = torch.npu.Event
    torch.npu.Event = FenceEvent
    fence.reset_attention_compute_start_gate()

    layers = []
    for i in range(3):
        layer = gdn.AscendGatedDeltaNetAttention.__new__(gdn.AscendGatedDeltaNetAttention)
        torch.nn.Module.__init__(layer)
        layer.prefix = f"model.layers.{i}.linear_attn"
        layer.kv_cache = DeviceState(log, layer.prefix)
        layers.append(layer)

    attn_name = "model.layers.3.self_attn.attn"

    class FullAttention(torch.nn.Module):
        kv_cache = torch.zeros(1)

    config.compilation_config.static_forward_context[attn_name] = FullAttention()

    @maybe_transfer_kv_layer
    def full_attention(query, layer_name):
        fence.record_attention_compute_start()  # as vllm-ascend's attention backend does
        log.append(("compute", layer_name))
        return query

    def metadata():
        md = {layer.prefix: GDNAttentionMetadata(0, 0, 1, 1, 0, 0, 1) for layer in layers}
        md[attn_name] = object()
        return md

    def step():
        log.clear()
        connector.start_load_kv(None)  # a new step: the layer counter starts at 0
        from vllm.forward_context import set_forward_context

        with set_forward_context(metadata(), config, slot_mapping={}):
            for layer in layers:
                t = torch.zeros(1, 1)
                with pytest.raises(NPUComputeUnavailable):
                    layer._forward_core(t, t, t, t)
                gdn.maybe_save_kv_layer_to_connector("", [])  # the original's own last line
            full_attention(torch.zeros(1), attn_name)
        return list(log)

    yield gdn, layers, connector, config, step, attn_name
    torch.npu.Event = saved_event
    restore()


def expected_sequence(layers, attn_name):
    out = []
    for layer in layers:
        out += [("wait", layer.prefix), ("fence", ""), ("compute", layer.prefix), ("save", "")]
    out += [("wait", attn_name), ("fence", ""), ("compute", attn_name), ("save", attn_name)]
    return out


def test_patched_core_is_installed_on_both_classes(stack):
    gdn = stack[0]
    importlib.import_module("vllm_ascend.patch.worker.patch_qwen3_5")
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    core = vars(gdn.AscendGatedDeltaNetAttention)["_forward_core"]
    assert core.__ascend_layerwise_patch__ == "gdn_layerwise"
    assert vars(QwenGatedDeltaNetAttention)["_forward_core"] is core


def test_hybrid_step_waits_fences_computes_saves_in_order(stack):
    gdn, layers, connector, _config, step, attn_name = stack
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    connector.bind_connector_metadata(KVConnectorMetadata())
    try:
        log = step()
    finally:
        connector.clear_connector_metadata()
    assert log == expected_sequence(layers, attn_name)


def test_dummy_step_without_metadata_only_fences(stack):
    """No connector metadata: the guard keeps every connector call out; the fence still opens."""
    gdn, layers, connector, _config, step, attn_name = stack
    connector.clear_connector_metadata()
    log = step()
    assert [kind for kind, _ in log if kind in ("wait", "save")] == []
    assert connector.current_layer == 0


def test_profile_run_runs_the_original_to_its_end(stack):
    gdn, layers, connector, config, _step, _attn = stack
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.forward_context import set_forward_context

    connector.bind_connector_metadata(KVConnectorMetadata())
    connector.calls.clear()
    try:
        with set_forward_context(None, config):
            t = torch.zeros(1, 1)
            assert layers[0]._forward_core(t, t, t, t) is None
    finally:
        connector.clear_connector_metadata()
    assert connector.calls == [("fence", "")]  # no metadata: no wait, no state read, no save


@pytest.mark.control("the library reverted inside the test: upstream's GDN layer never waits (the defect, as released)")
def test_without_the_patch_gdn_layers_never_wait(stack):
    """On the unpatched 0.25.1rc1 code the GDN layers compute with no wait and no fence first."""
    gdn, layers, connector, _config, step, attn_name = stack
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    alp.revert()
    try:
        connector.bind_connector_metadata(KVConnectorMetadata())
        log = step()
    finally:
        connector.clear_connector_metadata()
        alp.activate()
    assert log != expected_sequence(layers, attn_name)
    assert log[:2] == [("compute", layers[0].prefix), ("save", "")]


@pytest.mark.control("plain serving without a connector: neither upstream nor the patched layer calls the connector")
def test_no_connector_no_wait_no_fence(stack):
    """Plain serving: no transfer group, so the entry adds neither call (and no lock)."""
    gdn, layers, connector, config, _step, _attn = stack
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.forward_context import set_forward_context

    connector.calls.clear()
    kv_transfer_state._KV_CONNECTOR_AGENT = None
    try:
        with set_forward_context(None, config):
            t = torch.zeros(1, 1)
            assert layers[0]._forward_core(t, t, t, t) is None
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = connector
    assert connector.calls == []
