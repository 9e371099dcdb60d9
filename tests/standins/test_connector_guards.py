"""Connector guards, through vLLM's real KV-transfer plumbing and every copy vllm-ascend made.

A real ``KVConnectorBase_V1`` subclass is installed as the process's transfer group (the same
module global ``ensure_kv_transfer_initialized`` sets); the forward context is vLLM's own. The
connector counts layers the way AscendStore's pool worker does (``current_layer`` advances on
every wait and save), which is what a dummy run must not disturb.
"""

from __future__ import annotations

import importlib

import pytest

import ascend_layerwise_patch as alp

pytestmark = pytest.mark.pairs("v0251", "v0260")

# (module, names it copied from vllm_ascend.attention.utils)
COPIES = {
    "vllm_ascend.attention.utils": ("wait_for_kv_layer_from_connector", "maybe_save_kv_layer_to_connector"),
    "vllm_ascend.ops.gdn": ("maybe_save_kv_layer_to_connector",),
    "vllm_ascend.attention.mla_v1": ("wait_for_kv_layer_from_connector", "maybe_save_kv_layer_to_connector"),
    "vllm_ascend.attention.sfa_v1": ("wait_for_kv_layer_from_connector", "maybe_save_kv_layer_to_connector"),
    "vllm_ascend.attention.dsa_v1": ("wait_for_kv_layer_from_connector", "maybe_save_kv_layer_to_connector"),
    "vllm_ascend.attention.context_parallel.dsa_cp": (
        "wait_for_kv_layer_from_connector",
        "maybe_save_kv_layer_to_connector",
    ),
    "vllm_ascend._310p.ops.fla.gdn_310": ("maybe_save_kv_layer_to_connector",),
}


@pytest.fixture(scope="module")
def plumbing():
    importlib.import_module("vllm_ascend.ops")  # as the NPU platform does first (vllm-ascend import cycle)
    modules = {name: importlib.import_module(name) for name in COPIES}
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.forward_context import set_forward_context

    import counting_connector

    connector, config, restore = counting_connector.install()
    yield modules, connector, config, set_forward_context, KVConnectorMetadata
    restore()


def one_step(modules, connector, config, set_forward_context, layers=4):
    """Every layer of a step, through every copy: wait (where the module has it), then save."""
    connector.calls.clear()
    connector.start_load_kv(None)
    attn_metadata = {f"model.layers.{i}": object() for i in range(layers)}
    with set_forward_context(attn_metadata, config):
        for i in range(layers):
            for module_name, names in COPIES.items():
                module = modules[module_name]
                layer = f"model.layers.{i}@{module_name}"
                if "wait_for_kv_layer_from_connector" in names:
                    module.wait_for_kv_layer_from_connector(layer)
                module.maybe_save_kv_layer_to_connector(layer, [])
    return list(connector.calls)


def test_every_copy_is_the_guarded_helper(plumbing):
    modules = plumbing[0]
    for module_name, names in COPIES.items():
        for name in names:
            assert getattr(getattr(modules[module_name], name), "__ascend_layerwise_patch__", None) in (
                "guard_wait",
                "guard_save",
            ), f"{module_name}.{name} is not the guarded helper"


def test_dummy_step_without_metadata_makes_no_connector_call(plumbing):
    modules, connector, config, set_fc, _ = plumbing
    connector.clear_connector_metadata()
    assert not connector.has_connector_metadata()
    calls = one_step(modules, connector, config, set_fc)
    assert calls == [] and connector.current_layer == 0


@pytest.mark.control("a step with connector metadata: the helpers wait and save with or without the guard")
def test_step_with_metadata_waits_and_saves_each_layer_once(plumbing):
    modules, connector, config, set_fc, Meta = plumbing
    connector.bind_connector_metadata(Meta())
    try:
        calls = one_step(modules, connector, config, set_fc)
    finally:
        connector.clear_connector_metadata()
    expected = []
    for i in range(4):
        for module_name, names in COPIES.items():
            layer = f"model.layers.{i}@{module_name}"
            if "wait_for_kv_layer_from_connector" in names:
                expected.append(("wait", layer))
            expected.append(("save", layer))
    assert calls == expected
    assert connector.current_layer == len(expected)


@pytest.mark.control("no attention metadata: vllm-ascend's helpers return early with or without the guard")
def test_profile_run_with_no_attention_metadata_stays_silent(plumbing):
    modules, connector, config, set_fc, Meta = plumbing
    connector.bind_connector_metadata(Meta())
    connector.calls.clear()
    try:
        with set_fc(None, config):
            modules["vllm_ascend.attention.utils"].wait_for_kv_layer_from_connector("x")
            modules["vllm_ascend.attention.utils"].maybe_save_kv_layer_to_connector("x", [])
    finally:
        connector.clear_connector_metadata()
    assert connector.calls == []


@pytest.mark.control("the library reverted in the test: it pins the defect of the unpatched helpers in both modes")
def test_without_the_patch_the_dummy_step_moves_the_counter(plumbing):
    """The defect itself, on the unpatched 0.25.1rc1 helpers: this is what the guard prevents."""
    modules, connector, config, set_fc, _ = plumbing
    alp.revert()
    try:
        assert getattr(modules["vllm_ascend.ops.gdn"].maybe_save_kv_layer_to_connector, "__ascend_layerwise_patch__", None) is None
        connector.clear_connector_metadata()
        calls = one_step(modules, connector, config, set_fc)
    finally:
        alp.activate()
    assert connector.current_layer == len(calls) > 0
