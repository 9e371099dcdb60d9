"""Postprocess kernel: vLLM 0.25's 23-parameter ``postprocess_mamba_fused_kernel`` on Ascend, race-free.

Target   vllm_ascend.ops.triton.mamba.postprocess:postprocess_mamba_fused_kernel, and the copies
         of it that vllm-ascend's ``patch/worker/patch_mamba_utils`` makes: its own module global
         and ``vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel``;
         vllm.v1.worker.mamba_utils:MambaSpecDecodeGPUContext.run_fused_postprocess_align (V2 caller)
Versions vLLM >=0.25.0,<0.31 but 0.27 / 0.28; vllm-ascend >=0.25.1,<0.31 but 0.27-0.29 (0.30.0rc2: issue 25) (base releases). vLLM 0.24 calls the
         kernel with 20 parameters. vllm-ascend 0.26.0rc1's kernel takes the 23 itself, so there
         ``postprocess_kernel`` is skipped (fixed upstream) and vllm-ascend's kernel stays in place;
         vLLM 0.26.0's V2 caller still passes no out buffer, so ``postprocess_v2_out_buffer`` applies.
Why      vllm-ascend 0.25.1rc1 still ships the 17-parameter kernel of vLLM 0.23 and installs it as
         vLLM's ``postprocess_mamba_fused_kernel``, while both of vLLM 0.25's callers (V1
         ``run_fused_postprocess`` and V2 ``run_fused_postprocess_align``) pass 23: every
         spec-decode step of a GDN hybrid model in align mode fails to launch it. Separately,
         vLLM 0.25's V2 caller passes no out buffer, so the kernel's program for (request, state
         0) writes ``num_accepted = 1`` in place while the programs for the request's other
         states read it to decide their copies: a race between programs (always lost under
         Triton's interpreter, which runs programs in order).
How      ``postprocess_kernel``: installs :class:`~ascend_layerwise_patch.kernels.postprocess_launch.
         PostprocessKernel`, this library's own kernel with the 23-parameter signature (a launcher
         object; see that module for the design and why it suits triton-ascend). Its Triton code
         is compiled on the first launch, so installing it needs neither triton nor a device --
         which is also why ``check --cpu`` (where the NPU stand-ins make real Triton unusable)
         can report it as applied truthfully: what it reports is the object that is installed.
         ``postprocess_v2_out_buffer``: replaces the V2 caller with one that hands the kernel a
         snapshot of ``num_accepted`` to read and the live tensor as the out buffer, so no
         program reads what another writes (vLLM's later fix, the same way). It launches this
         library's kernel directly: vLLM's and vllm-ascend's kernels ignore the out buffer under
         ``HAS_IDX_MAPPING``. One small device copy (``max_num_reqs`` int32) per V2 step.
         Both are one group: they apply together or not at all.
Removal  When vllm-ascend's kernel takes the 23 parameters (detected: ``postprocess_kernel`` then
         skips itself -- the case from vllm-ascend 0.26.0rc1 on) and vLLM's V2 caller passes an out
         buffer (detected from the names it uses: ``postprocess_v2_out_buffer`` then skips itself).
"""

from __future__ import annotations

import functools

from ...kernels.postprocess import PARAMS  # plain data: the kernel module imports no triton
from .._checks import Group
from .._ranges import SUPPORTED

ASCEND_KERNEL = "vllm_ascend.ops.triton.mamba.postprocess:postprocess_mamba_fused_kernel"
V2_CALLER = "vllm.v1.worker.mamba_utils:MambaSpecDecodeGPUContext.run_fused_postprocess_align"

#: what vLLM 0.25 added to the kernel's parameters (ours takes all of kernels.postprocess.PARAMS)
NEW_IN_VLLM_025 = (
    "state_dim_row_count_ptr",
    "state_dim_row_stride_ptr",
    "idx_mapping_ptr",
    "CONV_STATE_DIM_FIRST",
    "HAS_IDX_MAPPING",
    "PRECOMPUTED_NEW_COMPUTED",
)
#: vllm-ascend 0.25.1rc1's kernel: vLLM 0.25's list without those six (vLLM 0.23's, 17 names).
OLD_PARAMS = [p for p in PARAMS if p not in NEW_IN_VLLM_025]
V2_PARAMS = [
    "self",
    "num_reqs",
    "num_accepted_tokens_gpu",
    "state_idx_gpu",
    "new_num_computed_tokens_gpu",
    "idx_mapping",
]
#: what the replacement V2 caller reads from the context (vLLM 0.25's MambaSpecDecodeGPUContext)
V2_CONTEXT_FIELDS = (
    "is_initialized",
    "num_layers",
    "num_state_types",
    "block_table_ptrs",
    "block_table_stride_req",
    "state_base_addrs",
    "state_block_strides",
    "state_elem_sizes",
    "state_inner_sizes",
    "state_conv_widths",
    "state_group_indices",
    "state_dim_row_count",
    "state_dim_row_stride",
    "block_size",
)


def kernel_params(kernel) -> list[str]:
    """Parameter names of a Triton kernel: a ``JITFunction`` (``arg_names``), or the plain
    function that vLLM's ``triton_utils`` placeholder leaves when no Triton driver is active."""
    names = getattr(kernel, "arg_names", None)
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names):
        return list(names)
    fn = getattr(kernel, "fn", kernel)
    import inspect  # lazy: kept off the import path

    return list(inspect.signature(fn).parameters)


def _old_kernel(original) -> str | None:
    got = kernel_params(original)
    if got != OLD_PARAMS:
        return f"parameters are {got}, expected vllm-ascend 0.25.1rc1's 17"
    return None


def _vllm_kernel_params() -> list[str] | None:
    """The parameters of vLLM's own kernel, read from vllm.v1.worker.mamba_utils' source (vllm-ascend's
    patch_mamba_utils replaces the module attribute, so the installed object may be vllm-ascend's)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm.v1.worker.mamba_utils")
    if spec is None or not spec.origin:
        return None
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "postprocess_mamba_fused_kernel":
            return [a.arg for a in node.args.args]
    return None


def _ascend_has_new_signature(original) -> str | None:
    got = kernel_params(original)
    if got == list(PARAMS):
        return f"vllm-ascend's kernel already takes vLLM's {len(PARAMS)} parameters"
    if got != OLD_PARAMS and got == _vllm_kernel_params():  # later releases (0.30: 24)
        return f"vllm-ascend's kernel takes the {len(got)} parameters of the installed vLLM's kernel"
    return None


def _v2_caller_as_expected(original) -> str | None:
    import inspect

    got = list(inspect.signature(original).parameters)
    if got != V2_PARAMS:
        return f"parameters are {got}, expected {V2_PARAMS}"
    if "is_conv_state_dim_first" not in getattr(original, "__globals__", {}):
        return f"{original.__module__} no longer imports is_conv_state_dim_first"
    fields = getattr(original.__globals__.get("MambaSpecDecodeGPUContext"), "__dataclass_fields__", {})
    missing = [f for f in V2_CONTEXT_FIELDS if f not in fields]
    if missing:
        return f"MambaSpecDecodeGPUContext has no {', '.join(missing)}"
    return None


def _v2_caller_passes_out(original) -> str | None:
    names = set(original.__code__.co_names) | set(original.__code__.co_varnames)
    if any("num_accepted_tokens_out" in n or "snapshot" in n for n in names):
        return "vLLM's V2 caller already gives the kernel an out buffer"
    return None


@functools.lru_cache(maxsize=None)
def shared_kernel():
    """The one kernel object both patches install / launch."""
    from ...kernels.postprocess_launch import PostprocessKernel

    return PostprocessKernel()


def kernel_factory(original):
    return shared_kernel()


def v2_caller_factory(original):
    """V2 ``run_fused_postprocess_align`` that reads a snapshot and writes the live counts."""
    kernel = shared_kernel()
    dim_first = original.__globals__["is_conv_state_dim_first"]

    @functools.wraps(original)
    def run_fused_postprocess_align(
        self, num_reqs, num_accepted_tokens_gpu, state_idx_gpu, new_num_computed_tokens_gpu, idx_mapping
    ):
        if num_reqs == 0 or not self.is_initialized:
            return
        accepted_before = num_accepted_tokens_gpu.clone()
        kernel[(num_reqs, self.num_layers * self.num_state_types)](
            accepted_before,
            state_idx_gpu,
            None,
            new_num_computed_tokens_gpu,
            None,
            self.block_table_ptrs,
            self.block_table_stride_req,
            self.state_base_addrs,
            self.state_block_strides,
            self.state_elem_sizes,
            self.state_inner_sizes,
            self.state_conv_widths,
            self.state_group_indices,
            self.state_dim_row_count,
            self.state_dim_row_stride,
            num_accepted_tokens_gpu,  # out: only the kernel's (state 0, piece 0) programs write it
            idx_mapping,
            num_reqs,
            block_size=self.block_size,
            COPY_BLOCK_SIZE=1024,
            CONV_STATE_DIM_FIRST=dim_first(),
            HAS_IDX_MAPPING=True,
            PRECOMPUTED_NEW_COMPUTED=True,
        )

    return run_fused_postprocess_align


GROUP = Group("postprocess_kernel", SUPPORTED)

SPECS = (
    GROUP.spec(
        "postprocess_kernel",
        ASCEND_KERNEL,
        kernel_factory,
        why="vLLM 0.25 launches postprocess_mamba_fused_kernel with 23 parameters; vllm-ascend's takes 17",
        aliases=(
            "vllm.v1.worker.mamba_utils:postprocess_mamba_fused_kernel",
            "vllm_ascend.patch.worker.patch_mamba_utils:postprocess_mamba_fused_kernel",
        ),
        # vLLM's name holds vLLM's own kernel until vllm-ascend's worker patch copies the target there
        copied_by=("vllm_ascend.patch.worker.patch_mamba_utils",),
        precondition=_old_kernel,
        fixed_upstream=_ascend_has_new_signature,
    ),
    GROUP.spec(
        "postprocess_v2_out_buffer",
        V2_CALLER,
        v2_caller_factory,
        why="vLLM 0.25's V2 caller lets the kernel write num_accepted in place while other programs read it",
        precondition=_v2_caller_as_expected,
        fixed_upstream=_v2_caller_passes_out,
    ),
)
