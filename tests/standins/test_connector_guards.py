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
    return _one_step_of(COPIES, modules, connector, config, set_forward_context, layers)


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


@pytest.mark.pairs("v0300")
@pytest.mark.control("a vouch: vllm-ascend 0.30's own guards, run with the library reverted in the test")
def test_030_upstream_helpers_skip_a_step_without_metadata():
    """guard_wait / guard_save are fixed upstream on vllm-ascend 0.30.0rc2 (both helpers check
    ``has_connector_metadata()``): with the library reverted, a dummy step (no metadata bound) makes no
    connector call and leaves the layer counter at 0; a real step reaches the connector."""
    importlib.import_module("vllm_ascend.ops")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.forward_context import set_forward_context

    import counting_connector

    alp.REGISTRY.revert()
    modules = {"vllm_ascend.attention.utils": importlib.import_module("vllm_ascend.attention.utils")}
    for module in modules.values():
        for name in COPIES["vllm_ascend.attention.utils"]:
            assert not hasattr(getattr(module, name), "__ascend_layerwise_patch__")
    connector, config, restore = counting_connector.install()
    try:
        copies = {"vllm_ascend.attention.utils": COPIES["vllm_ascend.attention.utils"]}
        connector.clear_connector_metadata()
        assert not connector.has_connector_metadata()
        calls = _one_step_of(copies, modules, connector, config, set_forward_context)
        assert calls == [] and connector.current_layer == 0
        connector.bind_connector_metadata(KVConnectorMetadata())
        calls = _one_step_of(copies, modules, connector, config, set_forward_context)
        assert len(calls) == 2 * 4  # a wait and a save per layer
    finally:
        restore()
        alp.REGISTRY.activate()


def _one_step_of(copies, modules, connector, config, set_forward_context, layers=4):
    """Every layer of a step, through the ``copies`` given: wait (where the module has it), then save."""
    connector.calls.clear()
    connector.start_load_kv(None)
    attn_metadata = {f"model.layers.{i}": object() for i in range(layers)}
    with set_forward_context(attn_metadata, config):
        for i in range(layers):
            for module_name, names in copies.items():
                layer = f"model.layers.{i}@{module_name}"
                if "wait_for_kv_layer_from_connector" in names:
                    modules[module_name].wait_for_kv_layer_from_connector(layer)
                modules[module_name].maybe_save_kv_layer_to_connector(layer, [])
    return list(connector.calls)
