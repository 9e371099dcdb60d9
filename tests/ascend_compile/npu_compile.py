"""Compile Triton kernels for Atlas A2 / A3 with triton-ascend + bishengir on a CPU, up to CANN.

triton-ascend lowers a kernel ttir -> linalg (``triton-adapter-opt``) -> HFusion + HIVM
(``bishengir-compile``, which plans the unified buffer) -> ``hivmc`` (CANN's backend, absent here).
A compile whose only error is ``External hivmc run fails`` has passed every stage before CANN:
:func:`compile_launch` reports it as compiled and reads the planned UB from the module bishengir
leaves after memory planning (``--save-temps``: ``module.hivm.opt.mlir``). Anything earlier is a
failure, reported with the stage and the compiler's message.

triton-ascend 3.2.0's ``triton-adapter-opt`` is not deterministic: on the same input it now and
then crashes (LLVM's "Stack dump:"), sometimes on a signal with nothing to say, sometimes on an
assertion ("Malformed type storage object", measured 5 of 600 runs of one variant's ttir). It
depends on the address layout: with ASLR off (``setarch -R``) the same input ran 300 times without
a crash; with ``--mlir-disable-threading`` it still crashed (3 of 400). So one crash is not a
verdict on the kernel. :func:`compile_launch` compiles again after a crash, up to
``MAX_COMPILES`` in all, and a failure stands only when it reproduces: two compiles in a row that
crash with the same :attr:`Result.signature` (the negative control's ``Assertion `idx < size()'
failed`` does, every time). Crashes that did not reproduce are kept in ``Result.flaky`` and
``Compiler.flaky``, so the suite can bound how often the compiler misbehaves.

Only hardware is stood in: the Triton driver (device, stream, target, core counts) and the C
extension over CANN that the backend asks for the arch. Nothing is launched: the first error
comes from the compiler, before any launch could happen.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
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
MAX_COMPILES = 4


@dataclass
class Result:
    target: str
    compiled: bool  # every stage before CANN's backend passed
    stage: str  # the stage that failed (ConvertLinalgRToBinary when CANN's backend is all that failed)
    message: str
    ub_bytes: int | None = None  # planned: max(offset + size) over the UB buffers
    ub_capacity: int | None = None
    flaky: list[str] = field(default_factory=list)  # signatures of crashes that did not reproduce
    reproduced: bool = False  # a crash, and the compile before it crashed the same way

    @property
    def crashed(self) -> bool:
        """The compiler crashed (LLVM's crash handler ran), rather than reporting an error."""
        return not self.compiled and "Stack dump:" in self.message

    @property
    def signature(self) -> str:
        """How the compile ended: the stage and the compiler's first assertion or error line (a
        crash with neither is a signal)."""
        if self.compiled:
            return "compiled"
        head = self.message.split("Stack dump:", 1)[0]
        said = [line.strip() for line in head.splitlines() if "Assertion" in line or ": error: " in line]
        return f"{self.stage}: {said[0] if said else 'died on a signal'}"

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
        self.flaky: list[str] = []  # every crash that did not reproduce, over the process

    def compile_launch(self, target: str, launch) -> Result:
        """Run ``launch()`` (a kernel launch) for ``target`` (an arch); report how far it compiled.
        After a crash it compiles again (module doc) until the crash reproduces, the compile ends
        without one, or ``MAX_COMPILES`` is reached."""
        flaky = []
        result = self._compile_once(target, launch)
        for _ in range(MAX_COMPILES - 1):
            if not result.crashed:
                break
            again = self._compile_once(target, launch)
            if again.crashed and again.signature == result.signature:
                again.reproduced = True  # the verdict stands
                result = again
                break
            flaky.append(result.signature)
            result = again
        result.flaky = flaky
        self.flaky += flaky
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
