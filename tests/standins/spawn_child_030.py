"""Body of a spawned child (vllm-ascend 0.30): the patches arrive only through vLLM's plugins."""

import importlib.util
import json
import sys
from pathlib import Path


def main(queue) -> None:
    path = Path(__file__).resolve().parents[2] / "ascend_layerwise_patch" / "cpu_standins.py"
    spec = importlib.util.spec_from_file_location("_alp_standins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm_ascend._310p.ops.fla.gdn_310 as g310

    core = vars(g310.AscendGatedDeltaNetAttention310)["_forward_core"]
    queue.put(
        json.dumps(
            {
                "loaded_package": "ascend_layerwise_patch" in sys.modules,
                "g310": getattr(core, "__ascend_layerwise_patch__", None),
            }
        )
    )
