"""For vLLM's model-inspection subprocess started by the pool harness: the CPU stand-ins first."""

from ascend_layerwise_patch import cpu_standins

cpu_standins.install()
