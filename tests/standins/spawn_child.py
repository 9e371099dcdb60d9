"""Body of a child started with the ``spawn`` method: it gets the patches only via vLLM's plugins.
``probe`` names what it reads: the connector guard's wait helper (vLLM 0.25 / 0.26) or the 310P GDN
layer (vllm-ascend 0.30, where the guards are fixed upstream)."""

import importlib
import importlib.util
import json
import sys
from pathlib import Path

#: probe -> (module, how to read the target from it)
PROBES = {
    "wait": ("vllm_ascend.attention.utils", lambda module: module.wait_for_kv_layer_from_connector),
    "g310": ("vllm_ascend._310p.ops.fla.gdn_310", lambda module: vars(module.AscendGatedDeltaNetAttention310)["_forward_core"]),
}


def main(queue, probe: str = "wait") -> None:
    path = Path(__file__).resolve().parents[2] / "ascend_layerwise_patch" / "cpu_standins.py"
    spec = importlib.util.spec_from_file_location("_alp_standins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()
    loaded_before = "ascend_layerwise_patch" in sys.modules
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    name, read = PROBES[probe]
    target = read(importlib.import_module(name))

    queue.put(
        json.dumps(
            {
                "loaded_before": loaded_before,
                "loaded_package": "ascend_layerwise_patch" in sys.modules,
                probe: getattr(target, "__ascend_layerwise_patch__", None),
            }
        )
    )
