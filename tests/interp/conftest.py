"""Triton kernels under the interpreter, with vLLM's real callers and no NPU stand-ins.

Set before anything imports triton or vLLM:
  TRITON_INTERPRET=1       every @triton.jit runs on the CPU, programs one after another.
  VLLM_PLUGINS=""          vllm-ascend's platform plugin (which needs torch_npu) stays unloaded.
  CUDA_VISIBLE_DEVICES=""  vLLM's triton_utils, finding no active Triton driver, hands out
                           placeholders (plain functions) -- unless the visible-device list is
                           empty, which it takes for a distributed start and keeps real Triton.
                           That lets vLLM 0.25.1's own kernel run here, as a second oracle.
  ASCEND_LAYERWISE_PATCH=0 the registry stays off: these tests install the patch factories'
                           products themselves (the registry is tested in tests/standins).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["VLLM_PLUGINS"] = ""
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["ASCEND_LAYERWISE_PATCH"] = "0"
