"""Real vLLM + vllm-ascend with the NPU runtime stood in; the library activated before vLLM loads."""

from ascend_layerwise_patch import cpu_standins

cpu_standins.install()

import ascend_layerwise_patch  # noqa: E402,F401  (activates: post-import hooks only)
