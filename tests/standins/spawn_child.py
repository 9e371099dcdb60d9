"""Body of a child started with the ``spawn`` method: it gets the patches only via vLLM's plugins."""

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
    loaded_before = "ascend_layerwise_patch" in sys.modules
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm_ascend.attention.utils as utils

    queue.put(
        json.dumps(
            {
                "loaded_before": loaded_before,
                "loaded_package": "ascend_layerwise_patch" in sys.modules,
                "wait": getattr(utils.wait_for_kv_layer_from_connector, "__ascend_layerwise_patch__", None),
            }
        )
    )
