"""CPU stand-ins for the Ascend NPU runtime, so vllm-ascend's Python code imports on a CPU box.

These stand in for *hardware* (torch_npu, the CANN ``acl`` bindings, triton-ascend's NPU driver
query, Mooncake's transfer engine) and never for the code this library patches: vLLM and
vllm-ascend are imported for real. It is what ``ascend-layerwise-patch check --cpu`` and the test
suite use, on the model of vllm-ascend's own ``tests/ut/conftest.py``.

Must run before ``import vllm`` (vllm-ascend's platform entry point loads on that import).
Known side effect: the ``triton.runtime`` stand-in leaves real Triton unusable in this process,
so Triton kernels are never launched where these are installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from unittest.mock import MagicMock

_INSTALLED_FLAG = "_ascend_layerwise_patch_cpu_standins"


def _module(name: str, *, package: bool = False, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        module.__path__ = []
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


class _MockModule(types.ModuleType):
    """A module whose every public attribute is a MagicMock (created on first access)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _MockPackageFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``root`` and every ``root.*`` submodule as a :class:`_MockModule`."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name == self.root or name.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _MockModule(spec.name)
        module.__version__ = "0.0.0+cpustandin"  # transformers parses it; 0.0.0 selects its PIL paths
        return module

    def exec_module(self, module):
        pass


def _torchvision_unusable() -> bool:
    """PyPI's torchvision is CUDA-linked and fails beside a CPU torch; the test venvs omit it.

    vLLM's Qwen3-VL / Qwen3.5 model modules import transformers' Qwen2-VL image processor,
    which imports ``torchvision.transforms.v2`` unconditionally.
    """
    if importlib.util.find_spec("torchvision") is None:
        return True
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - 'operator torchvision::nms does not exist' and friends
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return True
    return False


def installed() -> bool:
    return bool(getattr(sys, _INSTALLED_FLAG, False))


def install() -> None:
    """Put the NPU runtime stand-ins in place (idempotent). Call before importing vLLM."""
    if installed():
        return
    if "vllm" in sys.modules:
        raise RuntimeError("install the CPU stand-ins before vLLM is imported")
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

    # triton-ascend: vllm-ascend reads the NPU's core counts through the active driver.
    runtime = MagicMock(name="triton.runtime")
    runtime.driver.active.utils.get_device_properties.return_value = {"num_aic": 8, "num_vectorcore": 8}
    sys.modules["triton.runtime"] = runtime

    # torch_npu: a package whose device API is a mock; format casts are identities.
    torch_npu = _module("torch_npu", package=True)
    for attr in ("npu", "profiler", "_C", "_inductor", "npu_fusion_attention"):
        setattr(torch_npu, attr, MagicMock(name=f"torch_npu.{attr}"))
    torch_npu.npu_format_cast = lambda weight, fmt: weight
    torch_npu.npu.current_device = MagicMock(return_value=0)
    torch_npu._C._NPUTaskGroupHandle = MagicMock
    # torch_npu's own dtypes, read at import time by vllm-ascend 0.30's quantization utils
    import torch

    for dtype in ("float4_e2m1fn_x2", "float8_e8m0fnu", "hifloat8"):
        setattr(torch_npu, dtype, getattr(torch, dtype, None) or MagicMock(name=f"torch_npu.{dtype}"))
    sys.modules["torch_npu"] = torch_npu
    sys.modules["torch_npu.npu"] = torch_npu.npu
    sys.modules["torch_npu._C"] = torch_npu._C
    sys.modules["torch_npu._C._distributed_c10d"] = torch_npu._C._distributed_c10d
    sys.modules["torch_npu._inductor"] = torch_npu._inductor
    sys.modules["torch_npu.profiler"] = torch_npu.profiler

    # CANN's Python bindings.
    acl_rt = _module("acl.rt", memcpy=MagicMock(name="acl.rt.memcpy"))
    sys.modules["acl"] = _module("acl", package=True, rt=acl_rt)
    sys.modules["acl.rt"] = acl_rt

    # Mooncake's transfer engine (a C++ extension on NPU nodes).
    sys.modules.setdefault("mooncake", _module("mooncake", package=True))
    sys.modules["mooncake.engine"] = _module("mooncake.engine", TransferEngine=MagicMock(name="TransferEngine"))

    # torch_npu's ATB op plugin and its tensor-sharing reductions (vllm-ascend 0.30's worker imports them)
    for sub in ("torch_npu.op_plugin", "torch_npu.multiprocessing"):
        sys.meta_path.insert(0, _MockPackageFinder(sub))

    # fla_npu: the Ascend C kernels of flash-linear-attention (vllm-ascend 0.30's ops.gdn imports them)
    if importlib.util.find_spec("fla_npu") is None:
        sys.meta_path.insert(0, _MockPackageFinder("fla_npu"))

    if _torchvision_unusable():
        sys.meta_path.insert(0, _MockPackageFinder("torchvision"))

    import torch

    try:
        torch.utils.rename_privateuse1_backend("npu")
    except RuntimeError:
        pass
    torch.npu = MagicMock(name="torch.npu")
    torch.npu.Stream = MagicMock
    torch.version.cann = None
    torch.distributed.is_hccl_available = MagicMock(return_value=True)
    setattr(sys, _INSTALLED_FLAG, True)
