"""The postprocess kernel compiled for Atlas A2 and A3 by triton-ascend + bishengir, up to CANN.

Every launch variant the project's launcher (``PostprocessKernel``) produces on an NPU is compiled
for both targets: each constexpr / ``None`` combination, and the integer specialisations Triton
makes (``== 1``: a constant; ``% 16 == 0``: divisibility) of ``num_reqs`` and
``block_table_stride_req`` as vLLM 0.25's callers pass them. A variant passes when the only error
is CANN's missing backend and bishengir's memory plan uses at most ``UB_LIMIT`` of the unified
buffer. The negative control -- the same kernel with the int64-address tensor cast to a pointer
inside the copy loop, as vLLM 0.25's copy loop does -- must fail before that.

Runs in its own venv (scripts/env.sh ascendc: triton-ascend replaces upstream triton); one
process, every variant compiled once per target (about 1 s each).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
import types
from pathlib import Path

import pytest
import triton.language as tl
from npu_compile import TARGETS, Compiler

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "ascend_layerwise_patch" / "kernels"
UB_LIMIT = 0.80
CRASH_BUDGET = 3  # of about 100 compiles


def load_kernel_module(name: str):
    """The kernel's launcher by path, fresh under ``name`` (the library's __init__ would need wrapt
    and packaging): a package object of its own for kernels/, the launcher imported from it."""
    for loaded in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[loaded]  # fresh modules: a kernel compiled by an earlier test is not reused
    package = types.ModuleType(name)
    package.__path__ = [str(KERNELS)]
    sys.modules[name] = package
    return importlib.import_module(f"{name}.postprocess_launch")


class Tensor:
    """What the launcher and Triton's JIT read of a tensor argument: dtype, address, device."""

    device = "npu:0"

    def __init__(self, dtype: str):
        self.dtype = dtype

    def data_ptr(self):
        return 1 << 20  # allocator-aligned, as every real tensor is


I32, I64 = "int32", "int64"


def launch_args(*, dim_first, idx_mapping, precomputed, out, num_reqs, stride):
    """The 23 parameters as vLLM 0.25 passes them (None where a caller passes None)."""
    return (
        [Tensor(I32), Tensor(I32), None if precomputed else Tensor(I32), Tensor(I32),
         None if precomputed else Tensor(I32), Tensor(I64), stride, Tensor(I64), Tensor(I64), Tensor(I32),
         Tensor(I64), Tensor(I32), Tensor(I32), Tensor(I32), Tensor(I64), Tensor(I32) if out else None,
         Tensor(I32) if idx_mapping else None, num_reqs],
        dict(block_size=1024, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=dim_first, HAS_IDX_MAPPING=idx_mapping,
             PRECOMPUTED_NEW_COMPUTED=precomputed),
    )


#: vLLM 0.25's callers: V1 run_fused_postprocess (also the spec-decode path's,
#: postprocess_mamba_align_gpu, with the same arguments) and V2 run_fused_postprocess_align as
#: this library replaces it (an out buffer; vLLM's own passes None, covered by the combinations).
CALLERS = {"V1": dict(idx_mapping=False, precomputed=False, out=True),
           "V2": dict(idx_mapping=True, precomputed=True, out=True)}


def variants():
    """{name: launch kwargs}, deduplicated: every flag / None combination, then the callers'
    integer specialisations (num_reqs 1 / 32 / 37, block-table stride 1 / 48 / 37)."""
    found = {}
    for dim_first, idx, pre, out in itertools.product((False, True), repeat=4):
        found[(dim_first, idx, pre, out, 37, 37)] = None
    ints = itertools.product((1, 32, 37), (1, 48, 37))  # num_reqs, stride: == 1, % 16 == 0, other
    for (caller, kw), dim_first, (n, stride) in itertools.product(CALLERS.items(), (False, True), ints):
        found.setdefault((dim_first, kw["idx_mapping"], kw["precomputed"], kw["out"], n, stride), caller)
    named = {}
    for (dim_first, idx, pre, out, n, stride), caller in found.items():
        name = (f"{caller or 'flags'}-{'DS' if dim_first else 'SD'}-idx{int(idx)}-pre{int(pre)}-out{int(out)}"
                f"-n{n}-s{stride}")
        named[name] = dict(dim_first=dim_first, idx_mapping=idx, precomputed=pre, out=out, num_reqs=n, stride=stride)
    return named


VARIANTS = variants()


@pytest.fixture(scope="session")
def compiler():
    return Compiler()


@pytest.fixture(scope="session")
def kernel():
    return load_kernel_module("alp_postprocess_npu").PostprocessKernel()


def compile_variant(compiler, kernel, target, spec):
    args, kwargs = launch_args(**spec)
    n = spec["num_reqs"]
    return compiler.compile_launch(target, lambda: kernel[(n, 72)](*args, **kwargs))


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_compiles_within_ub(compiler, kernel, target, variant, record_property):
    result = compile_variant(compiler, kernel, TARGETS[target], VARIANTS[variant])
    for crash in result.flaky:
        print(f"{variant} on {target}: the compiler crashed and did not when compiled again: {crash}")
    assert result.compiled, f"{variant} on {target}: fails in {result.stage}:\n{result.message[:3000]}"
    assert result.ub_bytes is not None, "compiled, but bishengir left no memory plan (module.hivm.opt.mlir)"
    record_property("ub_bytes", result.ub_bytes)
    print(f"UB {target} {variant}: {result.ub_bytes} B of {result.ub_capacity} ({result.ub_percent:.1f}%)")
    assert result.ub_bytes <= UB_LIMIT * result.ub_capacity, (
        f"{variant} on {target}: plans {result.ub_bytes} B of UB, {result.ub_percent:.1f}% > {UB_LIMIT:.0%}"
    )


# ----------------------------------------------------------------------------- negative control


def _copy_bytes_cast_in_loop(src_addr, dst_addr, nbytes, COPY_BYTES: tl.constexpr, SLOW_BYTES: tl.constexpr):
    """The copy with vLLM 0.25's habit: a tensor of int64 addresses cast to a pointer in the loop."""
    lanes = tl.arange(0, COPY_BYTES)
    for i in range(0, nbytes, COPY_BYTES):
        mask = i + lanes < nbytes
        src = (src_addr + i + lanes).to(tl.pointer_type(tl.uint8))
        dst = (dst_addr + i + lanes).to(tl.pointer_type(tl.uint8))
        tl.store(dst, tl.load(src, mask=mask), mask=mask)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_negative_control_cast_in_loop_fails(compiler, target):
    module = load_kernel_module("alp_postprocess_cast_in_loop")
    module.kernel._copy_bytes = _copy_bytes_cast_in_loop  # before compiled(): the kernel's copies use it
    spec = VARIANTS["V1-SD-idx0-pre0-out1-n37-s48"]
    result = compile_variant(compiler, module.PostprocessKernel(), TARGETS[target], spec)
    assert not result.compiled, "the in-loop cast of an address tensor compiled: the suite could not fail"
    assert result.stage == "ConvertTritonIRToLinalgIR", f"failed in {result.stage}, not in triton-adapter-opt"
    assert result.reproduced, f"the control's crash did not reproduce: {result.signature}; {result.flaky}"
    assert "Assertion `idx < size()' failed" in result.signature, result.signature


def test_compiler_crashes_are_rare(compiler):
    """Crashes that did not reproduce, over every compile above (they run first, in file order):
    measured about 1 in 200-500 compiles, so a handful per suite means the compiler or its inputs
    changed."""
    assert compiler.count > 0, "nothing was compiled before this test"
    assert len(compiler.flaky) <= CRASH_BUDGET, (
        f"{len(compiler.flaky)} compiler crashes that did not reproduce in {compiler.count} compiles: "
        + "; ".join(compiler.flaky)
    )


# ----------------------------------------------------------------------------- the crash policy


@pytest.mark.parametrize(
    "ends, compiled, reproduced, flaky",
    [
        (["ok"], True, False, 0),
        (["A", "ok"], True, False, 1),  # a crash that does not come back: compiled
        (["A", "A"], False, True, 0),  # the same crash twice: a verdict
        (["A", "B", "B"], False, True, 1),
        (["A", "B", "C", "D"], False, False, 3),  # never the same twice: fails, not reproduced
        (["error"], False, False, 0),  # an error without a crash is never compiled again
    ],
)
def test_crash_policy(ends, compiled, reproduced, flaky):
    """compile_launch's policy on scripted compiler outcomes: "ok" compiled, "error" a diagnosed
    error, any other letter a crash with that assertion."""
    from npu_compile import Result

    def outcome(end):
        if end == "ok":
            return Result("t", True, "ConvertLinalgRToBinary", "External hivmc run fails")
        if end == "error":
            return Result("t", False, "ConvertTritonIRToLinalgIR", "x.mlir:1:1: error: bad")
        return Result("t", False, "ConvertTritonIRToLinalgIR", f"opt: Assertion `{end}' failed.\nStack dump:\n")

    policy = Compiler.__new__(Compiler)  # the policy alone: no compiler set up, nothing launched
    policy.flaky, script = [], iter(ends)
    policy._compile_once = lambda target, launch: outcome(next(script))
    result = policy.compile_launch("t", None)
    assert next(script, None) is None, "compiled fewer times than the script has outcomes"
    assert (result.compiled, result.reproduced, len(result.flaky)) == (compiled, reproduced, flaky)
    assert policy.flaky == result.flaky
