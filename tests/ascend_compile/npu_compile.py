"""Compile Triton kernels for Atlas A2 / A3 with triton-ascend + bishengir on a CPU, up to CANN.

triton-ascend lowers a kernel ttir -> linalg (``triton-adapter-opt``) -> HFusion + HIVM
(``bishengir-compile``, which plans the unified buffer) -> ``hivmc`` (CANN's backend, absent here).
A compile whose only error is ``External hivmc run fails`` has passed every stage before CANN:
:func:`compile_launch` reports it as compiled and reads the planned UB from the module bishengir
leaves after memory planning (``--save-temps``: ``module.hivm.opt.mlir``). Anything earlier is a
failure, reported with the stage and the compiler's message.

triton-ascend 3.2.0's ``triton-adapter-opt`` now and then dies on a signal with no diagnostic:
LLVM's crash handler prints "Stack dump:", but there is no assertion and no ``error:`` line. The
input is the same every time; measured: 1 of 480 compiles of this suite's variants, each time a
different variant, and each one compiled when run again (104 reruns of one that crashed). Such a
crash is not a verdict on the kernel, so :func:`compile_launch` compiles again, up to
``SIGNAL_RETRIES`` times, and counts each retry in ``Result.crashes``. A failing assertion (the
negative control's ``Assertion `idx < size()' failed``) or an ``error:`` is never retried.

Only hardware is stood in: the Triton driver (device, stream, target, core counts) and the C
extension over CANN that the backend asks for the arch. Nothing is launched: the first error
comes from the compiler, before any launch could happen.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

TARGETS = {"A2": "Ascend910B3", "A3": "Ascend910_9392"}
VECTOR_CORES = {"Ascend910B3": 40, "Ascend910_9392": 48}
CANN_MISSING = "External hivmc run fails"
# `%c2560_i64) : memref<16384xi8, ... #hivm.address_space<ub>>`: offset, shape, element type
_UB_BUFFER = re.compile(
    r"pointer_cast\(%c(\d+)(?:_i64)?\)\s*:\s*memref<((?:\d+x)*)([a-z]+)(\d+)[^>]*address_space<ub>>"
)
_UB_SIZE = re.compile(r'"UB_SIZE",\s*(\d+)\s*:\s*i32')
SIGNAL_RETRIES = 2


@dataclass
class Result:
    target: str
    compiled: bool  # every stage before CANN's backend passed
    stage: str  # the stage that failed (ConvertLinalgRToBinary when CANN's backend is all that failed)
    message: str
    ub_bytes: int | None = None  # planned: max(offset + size) over the UB buffers
    ub_capacity: int | None = None
    crashes: int = 0  # signal crashes of the compiler that were compiled again (see the module doc)

    @property
    def died_on_signal(self) -> bool:
        """The compiler crashed with nothing to say: no assertion, no ``error:`` line."""
        head = self.message.split("Stack dump:", 1)
        return len(head) == 2 and "Assertion" not in head[0] and ": error: " not in head[0]

    @property
    def ub_percent(self) -> float:
        return 100.0 * self.ub_bytes / self.ub_capacity


def ub_plan(mlir: str) -> tuple[int, int]:
    """(planned bytes, capacity bytes) of a bishengir module after memory planning."""
    planned = 0
    for offset, dims, kind, bits in _UB_BUFFER.findall(mlir):
        count = 1
        for d in dims.split("x")[:-1]:
            count *= int(d)
        planned = max(planned, int(offset) + count * max(int(bits), 8) // 8)
    capacity = _UB_SIZE.search(mlir)
    if capacity is None or planned == 0:
        raise ValueError("no UB_SIZE attribute or no UB buffer in the planned module")
    return planned, int(capacity.group(1)) // 8


class _Utils:
    """Stands in for triton-ascend's ``NPUUtils`` (a C extension over CANN)."""

    arch = "Ascend910B3"

    def get_arch(self):
        return _Utils.arch

    def get_aicore_num(self):
        return VECTOR_CORES[_Utils.arch] // 2

    def get_aivector_core_num(self):
        return VECTOR_CORES[_Utils.arch]

    def get_device_properties(self, device):
        cores = VECTOR_CORES[_Utils.arch]
        return {"max_shared_mem": 1, "num_aicore": cores // 2, "num_vectorcore": cores}


class _Driver:
    """Stands in for triton-ascend's NPU driver: what ``JITFunction.run`` asks before compiling."""

    utils = _Utils()

    def get_current_target(self):
        return GPUTarget("npu", _Utils.arch, 0)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_benchmarker(self):
        raise RuntimeError("nothing runs here: compile only")


class Compiler:
    """Set up once per process: a private Triton cache, bishengir with --save-temps, the stand-ins."""

    def __init__(self, workdir: str | None = None):
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="alp-npu-"))
        os.environ["TRITON_CACHE_DIR"] = str(self.workdir / "cache")
        os.environ["TRITON_ALWAYS_COMPILE"] = "1"
        import ascendnpuir  # noqa: F401 - fails clearly when ascendnpu-ir is not installed

        real = Path(ascendnpuir.__file__).parent / "bin" / "bishengir-compile"
        if not real.exists():
            raise RuntimeError(f"bishengir-compile not found at {real}")
        # triton-ascend runs `bishengir-compile` from PATH (it checks that name); this one keeps temps.
        bindir = self.workdir / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        wrapper = bindir / "bishengir-compile"
        wrapper.write_text(f'#!/bin/sh\nexec "{real}" --save-temps="$ALP_SAVE_TEMPS" "$@"\n')
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
        os.environ["PATH"] = f"{bindir}{os.pathsep}{real.parent}{os.pathsep}{os.environ['PATH']}"
        driver.set_active(_Driver())
        backend = triton.backends.backends["ascend"].compiler
        backend.add_stages.__globals__["NPUUtils"] = _Utils
        self.count = 0

    def compile_launch(self, target: str, launch) -> Result:
        """Run ``launch()`` (a kernel launch) for ``target`` (an arch); report how far it compiled.
        A compiler that died on a signal compiles again (``SIGNAL_RETRIES``; counted in
        ``Result.crashes``)."""
        for crashes in range(SIGNAL_RETRIES + 1):
            result = self._compile_once(target, launch)
            if not result.died_on_signal:
                break
        result.crashes = crashes
        return result

    def _compile_once(self, target: str, launch) -> Result:
        from triton.compiler.errors import CompilationError, MLIRCompilationError

        _Utils.arch = target
        self.count += 1
        temps = self.workdir / f"temps{self.count}"
        temps.mkdir()
        os.environ["ALP_SAVE_TEMPS"] = str(temps)
        try:
            launch()
        except MLIRCompilationError as e:
            stage, message = e.stage_name, str(e)
        except CompilationError as e:  # Triton's front end (Python -> ttir)
            return Result(target, False, "ttir", str(e))
        else:
            return Result(target, False, "launch", "the launch returned: no compiler error, so nothing was checked")
        others = [line for line in message.splitlines() if ": error: " in line and CANN_MISSING not in line]
        compiled = stage == "ConvertLinalgRToBinary" and CANN_MISSING in message and not others
        result = Result(target, compiled, stage, message)
        planned = temps / "module.hivm.opt.mlir"
        if compiled and planned.exists():
            result.ub_bytes, result.ub_capacity = ub_plan(planned.read_text())
        return result
