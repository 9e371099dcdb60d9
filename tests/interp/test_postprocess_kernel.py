"""The postprocess kernel under Triton's interpreter, bit-exact against a PyTorch reference.

States are ``as_strided`` views into padded per-layer pages, as vLLM lays them out; every
comparison is over the raw page bytes (padding included) and the accepted-token counts. The
reference (``reference`` below) is written from vLLM 0.25.1's semantics, see
``ascend_layerwise_patch.kernels.postprocess``; vLLM 0.25.1's own kernel, run through its real
``MambaSpecDecodeGPUContext``, is a second oracle where it is race-free (V1).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from ascend_layerwise_patch.kernels.postprocess import PARAMS
from ascend_layerwise_patch.kernels.postprocess_launch import PostprocessKernel
from ascend_layerwise_patch.patches import postprocess_kernel as patch

#: pairs whose vLLM launches the kernel with the 23 parameters from both callers (V1 and V2 align)
WITH_VLLM_CALLERS = ("v0251", "v0250", "v0260")
#: this library's kernel is never installed on vllm-ascend 0.30 (its own takes vLLM's parameters there):
#: the tests without a pairs mark of their own run on the older pairs only
pytestmark = pytest.mark.pairs("v0251", "v0250", "v0240", "v0260")
SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), phases=[Phase.generate]
)

# ----------------------------------------------------------------------------- a small mamba cache


@dataclass
class Layout:
    dim_first: bool = False
    groups: tuple[int, ...] = (2,)  # layers per mamba group
    width: int = 4  # conv window (tokens)
    dim: int = 6
    conv_dtype: torch.dtype = torch.bfloat16
    temporal: tuple[int, int] = (2, 3)
    temporal_dtype: torch.dtype = torch.float32
    pad: int = 8  # page padding bytes (multiple of 4)
    block_size: int = 4
    spec: int = 3  # speculative tokens
    align: int = 1  # extra alignment (bytes) of the temporal state's offset and of the page size


@dataclass
class Cache:
    layout: Layout
    rows: int  # block-table rows (batch rows)
    cols: int
    pages: dict[str, torch.Tensor] = field(default_factory=dict)  # layer -> raw uint8 pages
    states: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    layer_names: list[list[str]] = field(default_factory=list)
    tables: list[torch.Tensor] = field(default_factory=list)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: page.clone() for name, page in self.pages.items()}


def state_views(layout: Layout, raw: torch.Tensor, stride: int, blocks: int):
    """(conv, temporal) of one layer: as_strided views into pages of ``stride`` bytes."""
    lo = layout
    conv_es = torch.tensor([], dtype=lo.conv_dtype).element_size()
    tmp_es = torch.tensor([], dtype=lo.temporal_dtype).element_size()
    tmp_offset = _round_up(lo.width * lo.dim * conv_es, max(tmp_es, lo.align))
    conv_shape = (lo.dim, lo.width) if lo.dim_first else (lo.width, lo.dim)
    conv = torch.as_strided(raw.view(lo.conv_dtype), (blocks, *conv_shape), (stride // conv_es, conv_shape[1], 1))
    h, k = lo.temporal
    temporal = torch.as_strided(
        raw.view(lo.temporal_dtype), (blocks, h, k), (stride // tmp_es, k, 1), tmp_offset // tmp_es
    )
    return conv, temporal


def page_bytes(layout: Layout) -> int:
    lo = layout
    conv_es = torch.tensor([], dtype=lo.conv_dtype).element_size()
    tmp_es = torch.tensor([], dtype=lo.temporal_dtype).element_size()
    tmp_offset = _round_up(lo.width * lo.dim * conv_es, max(tmp_es, lo.align))
    return _round_up(tmp_offset + lo.temporal[0] * lo.temporal[1] * tmp_es + lo.pad, max(4, lo.align))


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def make_cache(layout: Layout, rows: int, cols: int, seed: int) -> Cache:
    """Random bytes in every page; block tables of distinct random block ids (block 0 unused)."""
    gen = torch.Generator().manual_seed(seed)
    page = page_bytes(layout)
    blocks = rows * cols + 1
    cache = Cache(layout, rows, cols)
    for g, n_layers in enumerate(layout.groups):
        names = [f"model.layers.{g}.{i}.linear_attn" for i in range(n_layers)]
        cache.layer_names.append(names)
        for name in names:
            raw = torch.randint(0, 256, (blocks * page,), dtype=torch.uint8, generator=gen)
            cache.pages[name] = raw
            cache.states[name] = state_views(layout, raw, page, blocks)
        ids = torch.randperm(rows * cols, generator=gen).to(torch.int32) + 1
        table = torch.full((rows, cols + 3), -7, dtype=torch.int32)  # wider than used: a real stride
        table[:, :cols] = ids.view(rows, cols)
        cache.tables.append(table)
    return cache


def metadata(cache: Cache) -> dict:
    """The kernel's flattened per-(layer, state) metadata, built the way vLLM 0.25 documents it."""
    rows = []
    for g, names in enumerate(cache.layer_names):
        for name in names:
            conv, temporal = cache.states[name]
            es = conv.element_size()
            if cache.layout.dim_first:
                rows.append((conv, conv.size(2), 1, conv.size(1), conv.stride(1) * es, g))
            else:
                rows.append((conv, conv.size(1), conv.stride(1), 0, 0, g))
            rows.append((temporal, 0, temporal[0].numel(), 0, 0, g))
    col = lambda i, dtype: torch.tensor([r[i] for r in rows], dtype=dtype)  # noqa: E731
    return dict(
        block_table_ptrs_ptr=torch.tensor([t.data_ptr() for t in cache.tables], dtype=torch.int64),
        block_table_stride_req=cache.tables[0].stride(0),
        state_base_addrs_ptr=torch.tensor([r[0].data_ptr() for r in rows], dtype=torch.int64),
        state_block_strides_ptr=torch.tensor([r[0].stride(0) * r[0].element_size() for r in rows], dtype=torch.int64),
        state_elem_sizes_ptr=torch.tensor([r[0].element_size() for r in rows], dtype=torch.int32),
        state_inner_sizes_ptr=col(2, torch.int64),
        state_conv_widths_ptr=col(1, torch.int32),
        state_group_indices_ptr=col(5, torch.int32),
        state_dim_row_count_ptr=col(3, torch.int32),
        state_dim_row_stride_ptr=col(4, torch.int64),
    )


# ----------------------------------------------------------------------------- requests


@dataclass
class Step:
    """One step's per-request inputs. Per-request arrays are indexed by slot; rows by batch."""

    slots: list[int]  # batch row -> request slot (-1: skipped row); identity for V1
    accepted: torch.Tensor
    state_idx: torch.Tensor
    running: torch.Tensor  # tokens in the running state (V1: computed + scheduled - draft)
    draft: torch.Tensor


def decide(step: Step, slot: int, block_size: int):
    accepted, running = int(step.accepted[slot]), int(step.running[slot])
    new = running + accepted - 1
    aligned = new // block_size * block_size
    if aligned < running:
        return None
    return int(step.state_idx[slot]), aligned // block_size - 1, aligned - running


def reference(cache: Cache, step: Step) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """vLLM 0.25.1's postprocess semantics in PyTorch, on byte views (a copy is a memmove)."""
    pages = cache.snapshot()
    out = step.accepted.clone()
    lo = cache.layout
    for b, slot in enumerate(step.slots):
        if slot < 0 or (d := decide(step, slot, lo.block_size)) is None:
            continue
        src, dst, bias = d
        if src == dst:
            out[slot] = 1
            if bias == 0:
                continue
        for g, names in enumerate(cache.layer_names):
            bt = cache.tables[g][b].tolist()
            for name in names:
                conv, temporal = (s.view(torch.uint8) for s in cache.states[name])
                conv = torch.as_strided(pages[name], conv.shape, conv.stride(), conv.storage_offset())
                temporal = torch.as_strided(pages[name], temporal.shape, temporal.stride(), temporal.storage_offset())
                es = cache.states[name][0].element_size()
                if bias >= lo.width:
                    pass  # nothing left of the window: the kernels copy no conv bytes
                elif lo.dim_first:
                    conv[bt[dst], :, : (lo.width - bias) * es] = conv[bt[src], :, bias * es :].clone()
                else:
                    conv[bt[dst], : lo.width - bias] = conv[bt[src], bias:].clone()
                temporal[bt[dst]] = temporal[bt[src + bias]].clone()
    changed = sum(not torch.equal(page, cache.pages[name]) for name, page in pages.items())
    if currently_in_test_context():
        event(f"layers changed: {changed}/{len(pages)}")
    return pages, out


@st.composite
def steps(draw, layout: Layout, n_rows: int, v2: bool):
    """Requests that hit every branch: no copy, copy with / without bias, src == dst."""
    bs, spec = layout.block_size, layout.spec
    n_slots = n_rows + 2 if v2 else n_rows
    slots = list(range(n_rows))
    if v2:
        slots = draw(st.permutations(range(n_slots)))[:n_rows]
        slots = [s if not draw(st.booleans()) or i == 0 else -1 for i, s in enumerate(slots)]
    accepted = torch.ones(n_slots, dtype=torch.int32)
    state_idx = torch.zeros(n_slots, dtype=torch.int32)
    running = torch.ones(n_slots, dtype=torch.int32)
    draft = torch.zeros(n_slots, dtype=torch.int32)
    for s in range(n_slots):
        draft[s] = draw(st.integers(0, spec))
        accepted[s] = draw(st.integers(1, int(draft[s]) + 1))
        near_boundary = bs * draw(st.integers(1, 5)) - draw(st.integers(0, int(accepted[s])))
        running[s] = max(1, draw(st.one_of(st.just(near_boundary), st.integers(1, 5 * bs))))
        new = int(running[s] + accepted[s] - 1)
        dst = new // bs - 1
        state_idx[s] = max(0, draw(st.sampled_from([dst, dst, dst - 1, dst + 1, 0])))
    return Step(slots, accepted, state_idx, running, draft)


def cols_needed(layout: Layout) -> int:
    return 5 + layout.spec + 3


layouts = st.builds(
    Layout,
    dim_first=st.booleans(),
    groups=st.sampled_from([(1,), (2,), (1, 2)]),
    width=st.integers(2, 5),
    dim=st.integers(1, 9),
    conv_dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.uint8]),  # uint8: the byte paths
    temporal=st.tuples(st.integers(1, 3), st.integers(1, 5)),
    temporal_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    pad=st.sampled_from([0, 4, 12, 40]),
    block_size=st.sampled_from([2, 4, 8]),
    spec=st.sampled_from([0, 3]),
)
# vLLM 0.26's MambaSpecDecodeGPUContext asserts 8-byte aligned temporal states and pages (its kernel
# copies them as uint64), as real caches are: the tests through vLLM's callers use such layouts.
vllm_layouts = layouts.map(lambda lo: replace(lo, align=8))
kernels = st.builds(
    PostprocessKernel,
    pieces=st.sampled_from([1, 2, 3, 4]),
    copy_bytes=st.sampled_from([16, 64, 256]),
    ds_rows=st.sampled_from([4, 8, 128]),
    # pieces of at least min_piece bytes / ds_min_rows rows: small values keep several pieces
    # working on these small states; the GPU default (16 KiB) leaves them to one
    min_piece=st.sampled_from([16, 64, None]),
    ds_min_rows=st.sampled_from([1, 2, None]),
    pieces_first=st.booleans(),
    packed_walk=st.booleans(),
)


# ----------------------------------------------------------------------------- launching


def v1_args(cache: Cache, step: Step, out: torch.Tensor) -> dict:
    computed = step.running - 1
    return dict(
        num_accepted_tokens_ptr=step.accepted.clone(),
        mamba_state_idx_ptr=step.state_idx,
        num_scheduled_tokens_ptr=1 + step.draft,
        num_computed_tokens_ptr=computed,
        num_draft_tokens_ptr=step.draft,
        **metadata(cache),
        num_accepted_tokens_out_ptr=out,
        idx_mapping_ptr=None,
        num_reqs=len(step.slots),
        block_size=cache.layout.block_size,
        COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=cache.layout.dim_first,
    )


def launch_direct(kernel, cache: Cache, step: Step, v2: bool) -> torch.Tensor:
    """Our kernel, launched as vLLM's callers do (V2: with an out buffer, as our caller does)."""
    n_states = 2 * sum(cache.layout.groups)
    if not v2:
        # V1 inputs are computed + scheduled - draft = running, with scheduled = 1 + draft
        out = step.accepted.clone()
        args = v1_args(cache, step, out)
        args["num_computed_tokens_ptr"] = step.running - 1
        kernel[(len(step.slots), n_states)](**args)
        return out
    live = step.accepted.clone()
    kernel[(len(step.slots), n_states)](
        step.accepted.clone(),
        step.state_idx,
        None,
        step.running + step.accepted - 1,
        None,
        *metadata(cache).values(),
        live,
        torch.tensor(step.slots, dtype=torch.int32),
        len(step.slots),
        block_size=cache.layout.block_size,
        COPY_BLOCK_SIZE=1024,
        CONV_STATE_DIM_FIRST=cache.layout.dim_first,
        HAS_IDX_MAPPING=True,
        PRECOMPUTED_NEW_COMPUTED=True,
    )
    return live


def assert_same(cache: Cache, expected_pages, got_out, expected_out):
    for name, page in cache.pages.items():
        bad = (page != expected_pages[name]).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.numel()} bytes differ, first at {bad[:4].flatten().tolist()}"
    assert torch.equal(got_out, expected_out), (got_out, expected_out)


@given(layout=layouts, kernel=kernels, n_rows=st.integers(1, 5), v2=st.booleans(), data=st.data())
@SETTINGS
def test_direct_launch_matches_reference(layout, kernel, n_rows, v2, data):
    step = data.draw(steps(layout, n_rows, v2))
    cache = make_cache(layout, n_rows, cols_needed(layout), seed=n_rows)
    expected_pages, expected_out = reference(cache, step)
    out = launch_direct(kernel, cache, step, v2)
    n_slots = len(step.accepted)
    assert_same(cache, expected_pages, out[:n_slots], expected_out)


@pytest.mark.parametrize("dim_first", [False, True])
@pytest.mark.parametrize("conv_dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("in_place", [False, True])
def test_every_shift(dim_first, conv_dtype, in_place):
    """Every accept bias 0..3 for conv windows of 3..5 tokens, in place (src == dst column) or
    not: each element width of the dim-first row copy and the SD shift in place are reached."""
    for width in (3, 4, 5):
        for bias in range(4):
            layout = Layout(dim_first=dim_first, groups=(1,), width=width, dim=7, conv_dtype=conv_dtype)
            cache = make_cache(layout, rows=1, cols=6, seed=width * 10 + bias)
            step = Step([0], *(torch.tensor([v], dtype=torch.int32) for v in (bias + 1, int(in_place), 8 - bias, 3)))
            assert decide(step, 0, layout.block_size) == (int(in_place), 1, bias)
            expected_pages, expected_out = reference(cache, step)
            for kernel in (PostprocessKernel(pieces=2, copy_bytes=16, ds_rows=4, min_piece=16, ds_min_rows=1),
                           PostprocessKernel(pieces=3, copy_bytes=16, ds_rows=4, min_piece=16, ds_min_rows=1,
                                             pieces_first=False, packed_walk=False)):
                cache = make_cache(layout, rows=1, cols=6, seed=width * 10 + bias)
                out = launch_direct(kernel, cache, step, v2=False)
                assert_same(cache, expected_pages, out, expected_out)


@pytest.mark.pairs(*WITH_VLLM_CALLERS)
def test_signature_is_vllm_025s():
    from vllm.v1.worker import mamba_utils

    assert list(PARAMS) == list(mamba_utils.postprocess_mamba_fused_kernel.arg_names)
    assert PostprocessKernel.arg_names == PARAMS


def test_block_stride_above_2_31_bytes():
    """Block 1 of each state sits 2**32 + 4 KiB above block 0: an int32 block offset would wrap
    to 4 KiB, into memory this test watches. The storage is one sparse allocation (only the
    pages in use are touched); the expected bytes come from a compact twin of the same cache."""
    layout = Layout(groups=(1,), pad=8, block_size=4, spec=3)
    twin = make_cache(layout, rows=1, cols=1, seed=3)  # 2 blocks
    twin.tables[0][0, :2] = torch.tensor([1, 0], dtype=torch.int32)
    page, stride = page_bytes(layout), 2**32 + 4096
    big = Cache(layout, 1, 2, layer_names=twin.layer_names, tables=twin.tables)
    for name, compact in twin.pages.items():
        raw = torch.empty(stride + page, dtype=torch.uint8)
        raw[:page], raw[stride:] = compact[:page], compact[page:]
        raw[4096 : 4096 + page] = 0xA5
        big.pages[name], big.states[name] = raw, state_views(layout, raw, stride, 2)
    # new 5, accepted 3: dst col 0 == src col 0 (block 1), bias 1: conv shifted in place,
    # temporal from col 1 (block 0, 4 GiB below) to block 1
    step = Step([0], *(torch.tensor([v], dtype=torch.int32) for v in (3, 0, 3, 3)))
    expected_pages, expected_out = reference(twin, step)
    out = launch_direct(PostprocessKernel(), big, step, v2=False)
    assert out.tolist() == expected_out.tolist() == [1]
    for name, raw in big.pages.items():
        assert torch.equal(raw[:page], expected_pages[name][:page])
        assert torch.equal(raw[stride:], expected_pages[name][page:])
        assert bool((raw[4096 : 4096 + page] == 0xA5).all())
        assert not torch.equal(expected_pages[name], twin.pages[name])  # something was copied


# ----------------------------------------------------------------------------- vLLM's callers


@contextlib.contextmanager
def conv_layout(dim_first: bool):
    """vLLM's conv-state layout for the block (it reads it once and caches it: cleared here)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    old = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS" if dim_first else "SD"
    get_conv_state_layout.cache_clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ["VLLM_SSM_CONV_STATE_LAYOUT"]
        else:
            os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = old
        get_conv_state_layout.cache_clear()


def vllm_context(cache: Cache, max_reqs: int):
    """vLLM's real MambaSpecDecodeGPUContext over this cache (metadata built by vLLM). vLLM 0.30 takes
    the copy functions by mamba type (``create(..., copy_funcs, ...)``), 0.25 / 0.26 a count of state types."""
    import inspect

    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec, get_temporal_copy_spec
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.utils import CpuGpuBuffer
    from vllm.v1.worker.mamba_utils import MambaSpecDecodeGPUContext

    by_type = "copy_funcs" in inspect.signature(MambaSpecDecodeGPUContext.create).parameters
    lo = cache.layout
    conv, temporal = next(iter(cache.states.values()))
    extra = {}
    if by_type:
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

        extra["mamba_type"] = MambaAttentionBackendEnum.GDN_ATTN
    spec = MambaSpec(
        block_size=lo.block_size,
        shapes=(tuple(conv.shape[1:]), tuple(temporal.shape[1:])),
        dtypes=(lo.conv_dtype, lo.temporal_dtype),
        mamba_cache_mode="align",
        num_speculative_blocks=lo.spec,
        **extra,
    )
    groups = [KVCacheGroupSpec(names, spec) for names in cache.layer_names]
    config = KVCacheConfig(num_blocks=conv.shape[0], kv_cache_tensors=[], kv_cache_groups=groups)
    funcs = (get_conv_copy_spec, get_temporal_copy_spec)
    copy_funcs = {spec.mamba_type: funcs} if by_type else funcs
    make_buffer = lambda n, dtype: CpuGpuBuffer(n, dtype=dtype, device="cpu", pin_memory=False)  # noqa: E731
    ctx = MambaSpecDecodeGPUContext.create(max_reqs, config, copy_funcs if by_type else 2, torch.device("cpu"), make_buffer)
    forward_context = {name: SimpleNamespace(kv_cache=list(states)) for name, states in cache.states.items()}
    ctx.initialize_from_forward_context(config, forward_context, copy_funcs, cache.tables)
    return ctx


def run_v1(ctx, step: Step) -> torch.Tensor:
    n = len(step.slots)
    ctx.run_fused_postprocess(
        num_reqs=n,
        num_accepted_tokens_gpu=step.accepted.clone(),
        mamba_state_idx_gpu=step.state_idx,
        num_scheduled_tokens_gpu=1 + step.draft,
        num_computed_tokens_gpu=step.running - 1,
        num_draft_tokens_gpu=step.draft,
    )
    return ctx.num_accepted_tokens_out[:n].clone()


def run_v2(ctx, step: Step) -> torch.Tensor:
    live = step.accepted.clone()
    ctx.run_fused_postprocess_align(
        len(step.slots), live, step.state_idx, step.running + step.accepted - 1,
        torch.tensor(step.slots, dtype=torch.int32),
    )
    return live


@pytest.fixture
def installed(monkeypatch):
    """What the patch group installs on vLLM 0.25: our kernel, and our V2 caller."""
    from vllm.v1.worker import mamba_utils

    original_v2 = mamba_utils.MambaSpecDecodeGPUContext.run_fused_postprocess_align
    assert patch._v2_caller_as_expected(original_v2) is None
    assert patch._v2_caller_passes_out(original_v2) is None
    monkeypatch.setattr(mamba_utils, "postprocess_mamba_fused_kernel", patch.kernel_factory(None))
    monkeypatch.setattr(
        mamba_utils.MambaSpecDecodeGPUContext, "run_fused_postprocess_align", patch.v2_caller_factory(original_v2)
    )
    return mamba_utils


@pytest.mark.pairs(*WITH_VLLM_CALLERS)
@given(layout=vllm_layouts, n_rows=st.integers(1, 5), v2=st.booleans(), data=st.data())
@settings(SETTINGS, max_examples=60)
def test_vllm_callers_with_our_kernel(layout, n_rows, v2, data):
    """V1 ``run_fused_postprocess`` (out buffer) and V2 ``run_fused_postprocess_align``
    (HAS_IDX_MAPPING, PRECOMPUTED_NEW_COMPUTED), vLLM's own code, with the patch's objects."""
    from vllm.v1.worker import mamba_utils

    step = data.draw(steps(layout, n_rows, v2))
    cache = make_cache(layout, n_rows, cols_needed(layout), seed=n_rows)
    expected_pages, expected_out = reference(cache, step)
    context = mamba_utils.MambaSpecDecodeGPUContext
    saved = (mamba_utils.postprocess_mamba_fused_kernel, context.run_fused_postprocess_align)
    original_v2 = saved[1]
    mamba_utils.postprocess_mamba_fused_kernel = patch.kernel_factory(None)
    mamba_utils.MambaSpecDecodeGPUContext.run_fused_postprocess_align = patch.v2_caller_factory(original_v2)
    try:
        with conv_layout(layout.dim_first):
            ctx = vllm_context(cache, max_reqs=len(step.accepted) + 1)
            out = run_v2(ctx, step) if v2 else run_v1(ctx, step)
    finally:
        mamba_utils.postprocess_mamba_fused_kernel = saved[0]
        mamba_utils.MambaSpecDecodeGPUContext.run_fused_postprocess_align = saved[1]
    assert_same(cache, expected_pages, out, expected_out[: len(out)])


@pytest.mark.pairs(*WITH_VLLM_CALLERS)
@given(layout=vllm_layouts, n_rows=st.integers(1, 4), data=st.data())
@settings(SETTINGS, max_examples=25)
def test_reference_agrees_with_vllms_kernel_on_v1(layout, n_rows, data):
    """The reference is vLLM 0.25.1's semantics: its own kernel, V1 (race-free), agrees."""
    from vllm.v1.worker import mamba_utils

    assert "InterpretedFunction" in type(mamba_utils.postprocess_mamba_fused_kernel).__name__
    step = data.draw(steps(layout, n_rows, v2=False))
    cache = make_cache(layout, n_rows, cols_needed(layout), seed=n_rows)
    expected_pages, expected_out = reference(cache, step)
    with conv_layout(layout.dim_first):
        out = run_v1(vllm_context(cache, max_reqs=n_rows), step)
    assert_same(cache, expected_pages, out, expected_out)


# ----------------------------------------------------------------------------- the V2 race


def race_case(dim_first: bool) -> tuple[Cache, Step]:
    """Request slot 2 at batch row 0: new 5, accepted 3, block size 4 -> dst col 0 == src col 0,
    bias 1. The (row 0, state 0) program sets accepted to 1; a program that reads 1 afterwards
    sees running 5 > aligned 4 and skips its copy."""
    layout = Layout(dim_first=dim_first, groups=(2,), block_size=4, spec=3)
    cache = make_cache(layout, rows=1, cols=4, seed=11)
    step = Step([2], torch.tensor([1, 1, 3], dtype=torch.int32), torch.tensor([0, 0, 0], dtype=torch.int32),
                torch.tensor([1, 1, 3], dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    return cache, step


@pytest.mark.pairs(*WITH_VLLM_CALLERS)
@pytest.mark.parametrize("dim_first", [False, True])
@pytest.mark.parametrize(
    "path",
    [
        pytest.param("vllm", marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason="vLLM 0.25's V2 race")),
        pytest.param(
            "vllm_caller_our_kernel",
            marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason="the caller is the race"),
        ),
        "patched",
    ],
)
def test_v2_race(path, dim_first, request):
    from vllm.v1.worker import mamba_utils

    cache, step = race_case(dim_first)
    expected_pages, expected_out = reference(cache, step)
    assert expected_out.tolist() == [1, 1, 1]
    if path != "vllm":
        request.getfixturevalue("installed")
        if path == "vllm_caller_our_kernel":
            original = mamba_utils.MambaSpecDecodeGPUContext.run_fused_postprocess_align.__wrapped__
            request.getfixturevalue("monkeypatch").setattr(
                mamba_utils.MambaSpecDecodeGPUContext, "run_fused_postprocess_align", original
            )
    with conv_layout(dim_first):
        out = run_v2(vllm_context(cache, max_reqs=3), step)
    assert_same(cache, expected_pages, out, expected_out)


# ----------------------------------------------------------------------------- vLLM 0.30 + vllm-ascend 0.30.0rc2
# Both members are skipped there as fixed upstream: vllm-ascend's kernel takes vLLM 0.30's 24 parameters
# (the 24th, TEMPORAL_TILES, a constexpr with a default) and vLLM's V2 caller reads a snapshot. These run
# the defects' scenarios with the library reverted: vLLM's own callers launching vllm-ascend's own kernel.

VOUCH_030 = "a vouch: vllm-ascend 0.30's own kernel and vLLM 0.30's callers, run with the library reverted in the test"

ASCEND_030_PROBE = """
from ascend_layerwise_patch import cpu_standins; cpu_standins.install()
import inspect, json
import vllm_ascend.patch.worker.patch_mamba_utils  # as NPUWorker's patch import does (vllm_ascend.patch.worker)
from vllm.v1.worker import mamba_utils
kernel = mamba_utils.postprocess_mamba_fused_kernel
v2 = mamba_utils.MambaSpecDecodeGPUContext.run_fused_postprocess_align
fn = getattr(kernel, "fn", kernel)  # a plain function where vLLM's triton_utils finds no Triton driver
print(json.dumps(dict(module=fn.__module__, file=inspect.getsourcefile(fn), tiles=mamba_utils._TEMPORAL_TILES,
                      v2=v2.__module__, tagged=[hasattr(o, "__ascend_layerwise_patch__") for o in (kernel, v2)])))
"""


@pytest.fixture(scope="module")
def ascend_030():
    """vLLM's mamba_utils as vllm-ascend 0.30.0rc2's worker patch leaves it, the library reverted.

    Where that patch puts the kernel (and ``_TEMPORAL_TILES``) is read in a child with the NPU
    runtime stood in (vllm_ascend.ops imports torch_npu; the stand-ins break real Triton here);
    the same kernel file is then loaded and installed in this process."""
    import importlib.util
    import json

    import ascend_layerwise_patch as alp
    from support import run_python
    from vllm.v1.worker import mamba_utils

    found = json.loads(run_python(ASCEND_030_PROBE, env={"ASCEND_LAYERWISE_PATCH": "0"}).stdout.splitlines()[-1])
    assert found["module"] == "vllm_ascend.ops.triton.mamba.postprocess" and found["tiles"] == 1, found
    assert found["v2"] == "vllm.v1.worker.mamba_utils" and found["tagged"] == [False, False], found
    spec = importlib.util.spec_from_file_location(found["module"], found["file"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = module.postprocess_mamba_fused_kernel
    assert "InterpretedFunction" in type(kernel).__name__  # vllm-ascend's Triton code, run here
    alp.REGISTRY.revert()
    saved = (mamba_utils.postprocess_mamba_fused_kernel, mamba_utils._TEMPORAL_TILES)
    mamba_utils.postprocess_mamba_fused_kernel, mamba_utils._TEMPORAL_TILES = kernel, found["tiles"]
    try:
        caller = mamba_utils.MambaSpecDecodeGPUContext.run_fused_postprocess_align
        assert not hasattr(caller, "__ascend_layerwise_patch__") and not isinstance(kernel, PostprocessKernel)
        # what the group's detectors see: the cells these tests back
        assert "24 parameters" in patch._ascend_has_new_signature(kernel)
        assert patch._v2_caller_passes_out(caller) is not None
        yield mamba_utils
    finally:
        mamba_utils.postprocess_mamba_fused_kernel, mamba_utils._TEMPORAL_TILES = saved
        alp.REGISTRY.activate()


@pytest.mark.pairs("v0300")
@pytest.mark.control(VOUCH_030)
@given(layout=vllm_layouts, n_rows=st.integers(1, 5), v2=st.booleans(), data=st.data())
@settings(SETTINGS, max_examples=40)
def test_030_vllm_callers_with_ascend_kernel(ascend_030, layout, n_rows, v2, data):
    """vLLM 0.30's V1 ``run_fused_postprocess`` and V2 ``run_fused_postprocess_align`` launch
    vllm-ascend 0.30's kernel (24 parameters, one temporal tile): it launches, and pages and
    accepted counts are the reference's (V2: rows in any slot order, skipped rows)."""
    step = data.draw(steps(layout, n_rows, v2))
    cache = make_cache(layout, n_rows, cols_needed(layout), seed=n_rows)
    expected_pages, expected_out = reference(cache, step)
    with conv_layout(layout.dim_first):
        ctx = vllm_context(cache, max_reqs=len(step.accepted))  # V2 snapshots the whole buffer
        out = run_v2(ctx, step) if v2 else run_v1(ctx, step)
    assert_same(cache, expected_pages, out, expected_out)


@pytest.mark.pairs("v0300")
@pytest.mark.control(VOUCH_030)
@pytest.mark.parametrize("dim_first", [False, True])
def test_030_v2_race_case_is_clean(ascend_030, dim_first):
    """vLLM 0.25's V2 race (test_v2_race: the state-0 program resets accepted to 1 before the
    request's other programs read it) through vLLM 0.30's V2 caller: every layer copied."""
    cache, step = race_case(dim_first)
    expected_pages, expected_out = reference(cache, step)
    assert expected_out.tolist() == [1, 1, 1]
    with conv_layout(dim_first):
        out = run_v2(vllm_context(cache, max_reqs=3), step)
    assert_same(cache, expected_pages, out, expected_out)
