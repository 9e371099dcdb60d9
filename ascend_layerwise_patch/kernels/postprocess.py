"""The fused mamba postprocess kernel with vLLM 0.25's 23-parameter signature: its Triton code (the
launcher, :class:`~.postprocess_launch.PostprocessKernel`, and the launch tuning are in
``postprocess_launch``).

vLLM 0.25's ``MambaSpecDecodeGPUContext`` launches ``postprocess_mamba_fused_kernel[grid](...)``
with 23 parameters, from two callers: V1 ``run_fused_postprocess`` (an out buffer for
``num_accepted_tokens``) and V2 ``run_fused_postprocess_align`` (``HAS_IDX_MAPPING`` and
``PRECOMPUTED_NEW_COMPUTED``). :class:`PostprocessKernel` takes that launch and does the same work,
written from scratch for an NPU first:

Semantics (those of vLLM 0.25.1, bit for bit). For each batch row ``b`` (request slot ``r`` =
``idx_mapping[b]`` under ``HAS_IDX_MAPPING``, skipped if negative, else ``r = b``)::

    running = computed + scheduled - draft;  new = running + accepted - 1   (V1)
    new = computed;                          running = new - accepted + 1   (PRECOMPUTED_NEW_COMPUTED)
    aligned = new // block_size * block_size
    if aligned >= running:
        bias = aligned - running;  dst = aligned // block_size - 1;  src = mamba_state_idx[r]
        if src == dst: out[r] = 1          # out = the out buffer, or num_accepted in place if None
        unless src == dst and bias == 0, for every (layer, state) of every mamba group:
            conv, dim last (SD):  state[bt[b, dst], :width - bias]    = state[bt[b, src], bias:]
            conv, dim first (DS): state[bt[b, dst], :, :width - bias] = state[bt[b, src], :, bias:]
            temporal:             state[bt[b, dst]]                    = state[bt[b, src + bias]]

Only the block-table row is ``b``; every per-request input and the out buffer are indexed by ``r``.
Copies are byte copies (``memmove`` when source and destination overlap: the SD shift in place).

Design, and why it suits triton-ascend as well as a GPU:

* **Grid (states, pieces, request blocks)**, not vLLM's (requests, states); on a GPU pieces first,
  (pieces, states, request blocks), so that the programs of one state start together. Each program
  loads, in one round of memory latency, its state's metadata, the first group's block table
  address and the decision inputs of up to ``REQ_BLOCK`` (128) requests as vectors; then gathers
  the source and destination block ids of all of them at once (one more round for the batch
  instead of one per request), and walks only the requests that copy. The grid no longer grows
  with the batch: 128 pieces x 72 states on an H200 for a Qwen3-Next step of up to 128 requests.
  An NPU runs a grid in rounds over its few dozen vector cores (triton-ascend's guide sizes grids
  by the core count): there the piece count comes out at 8 (40 or 48 cores), a small multiple of
  the cores.
* **Pieces.** Every (request, state) copy is cut into up to ``pieces`` pieces of whole copy steps,
  one per program: a 2 MiB temporal state is copied by 128 programs of 16 KiB on an H200 instead
  of one walking it 1 KiB at a time (the idea of vllm-ascend's later ``TEMPORAL_TILES``). A piece
  gets at least ``MIN_PIECE`` bytes of its state's largest region (16 KiB on a GPU: a 96 KiB conv
  state in 6 pieces), so every program of a state agrees on the count; the programs past it, and
  all programs of a step where no request copies, stop after the first round of loads. The piece
  count is chosen at launch from the device's core count (vector cores on an NPU, SMs on a GPU)
  and is a runtime value, so it never triggers a recompile.
* **One copy loop.** Every region a request moves (temporal state, SD conv window, packed DS conv
  state, each token row of the in-place shift) goes through the same ``_copy_piece`` call: plain
  ``tl.load``/``tl.store`` of an ``arange`` tile, unmasked 8-byte words when both ends and the
  length allow it (``tl.multiple_of`` is a hint checked at run time first), then a masked tail in
  small steps; unaligned regions (none in vLLM's layouts) go as bytes in small steps. The int64
  address is cast to a pointer once per region, outside the copy loop (triton-ascend's pointer
  analysis rejects a cast inside it, see the negative control in tests/ascend_compile; nor can it
  follow a reduced int64 address into the cast, so there the walk reduces int32 block ids, four
  reductions per copying request; on a GPU it packs them into two int64 reductions,
  ``PACKED_WALK``). No inline assembly, no atomics, no CUDA-only intrinsics.
* **Tile sizes per backend** (``TUNING``). On an NPU every tile is staged in the vector core's
  192 KiB unified buffer (UB), and bishengir double-buffers it: 8 KiB steps. On a GPU a tile lives
  in registers and bytes in flight set the bandwidth: 16 KiB steps (92-96 registers with 4 warps),
  up to 128 pieces of at least 16 KiB on an H200, pieces first.
* **Dim-first conv states** (dim rows of a few bytes each) are copied as 2-D tiles of
  ``DS_ROWS * 4`` elements, rows x 16 bytes (as 4-, 2- or 1-byte elements, whichever the addresses
  allow), the rows split over the pieces (at least ``DS_MIN_ROWS`` rows each: with a shift a row
  moves a few bytes at a time, so they get more pieces than their bytes would), the shift applied
  once per row. With no shift and packed rows the state is one contiguous span, copied as such.
* **The in-place shift** (SD conv state, source block == destination block, bias > 0) is the one
  overlapping copy. It moves token row ``j + bias`` to row ``j`` for ``j = 0, 1, ...`` in order;
  each program moves only its own piece (columns) of every row, and a row is read before it is
  written, so programs never touch each other's bytes and no read sees a write. (Under the
  interpreter programs run in order, so a race here could never show there.)
* **No program reads what another writes.** Every program reads ``num_accepted`` and only the
  (state 0, piece 0) program writes the 1s -- into the out buffer. With no out buffer (vLLM
  0.25.x's V2 caller) that write goes to ``num_accepted`` in place, as vLLM's kernel does, and
  that caller races; ``patches/postprocess_kernel/`` replaces that caller so it passes one.
* ``COPY_BLOCK_SIZE`` is accepted for the signature and ignored: tiling is this kernel's own.

Measured (2026-12-04). Unified buffer planned by bishengir (triton-ascend 3.2.0, ascendnpu-ir
1.2.0) for every launch variant this launcher produces on an NPU (tests/ascend_compile: 48 variants
per target -- flags, ``None`` arguments, ``num_reqs`` / stride specialisations of vLLM 0.25's V1,
V2 and spec-decode callers), of 196,608 B; identical on Atlas A2 (Ascend910B3) and A3
(Ascend910_9392):

    conv dim last (SD), every variant    37,376 - 41,728 B   19.0 - 21.2 %
    conv dim first (DS), every variant   44,544 - 48,896 B   22.7 - 24.9 %

(the kernel before the NPU layout, with 16 KiB tiles: 185 - 188 KB, 94 - 96 %). On an NVIDIA H200
(docs/h200_postprocess.md, one run): 90.3 % (SD) and 91.1 % (DS) of a plain copy's bandwidth for
128 requests all copying, 86 % with a 2-token shift in DS, 1.09x (SD) and 1.08x (DS) a plain
copy's time for a decode step of 128 requests with one crossing a block.

Importing this module imports neither torch nor triton. The launcher object is what gets
installed (also in ``check --cpu``, where the NPU stand-ins make real Triton unusable); the Triton
functions below are plain Python until :func:`compiled` hands them to ``triton.jit``, on the first
launch, which binds ``tl`` to ``triton.language``. Until then ``tl`` is a placeholder whose only
attribute, ``constexpr``, is the string Triton looks for in a parameter's annotation: the
annotations read ``tl.constexpr`` as in any Triton code (the interpreter re-reads them as text).
"""

import threading
from typing import Any

#: vLLM 0.25's parameter list of ``postprocess_mamba_fused_kernel``, in order.
PARAMS = (
    "num_accepted_tokens_ptr",
    "mamba_state_idx_ptr",
    "num_scheduled_tokens_ptr",
    "num_computed_tokens_ptr",
    "num_draft_tokens_ptr",
    "block_table_ptrs_ptr",
    "block_table_stride_req",
    "state_base_addrs_ptr",
    "state_block_strides_ptr",
    "state_elem_sizes_ptr",
    "state_inner_sizes_ptr",
    "state_conv_widths_ptr",
    "state_group_indices_ptr",
    "state_dim_row_count_ptr",
    "state_dim_row_stride_ptr",
    "num_accepted_tokens_out_ptr",
    "idx_mapping_ptr",
    "num_reqs",
    "block_size",
    "COPY_BLOCK_SIZE",
    "CONV_STATE_DIM_FIRST",
    "HAS_IDX_MAPPING",
    "PRECOMPUTED_NEW_COMPUTED",
)
REQ_BLOCK = 128  # requests whose decisions one program loads as one vector
DS_COLS = 16  # bytes per row of a dim-first tile (a conv window of <= 8 bf16 elements)


class _Placeholder:
    """``tl`` before compiled(): annotations ``tl.constexpr`` evaluate to what Triton reads."""

    constexpr = "constexpr"


tl: Any = _Placeholder()  # triton.language once compiled() has run

# ----------------------------------------------------------------------------- Triton code
# Plain functions until compiled() passes them to triton.jit and rebinds these module names.


def _copy_tile_loop(src, dst, count, LANES: tl.constexpr, TAIL: tl.constexpr):
    """``count`` elements from ``src`` to ``dst`` (typed pointers): unmasked tiles of ``LANES``,
    then masked steps of ``TAIL`` (a runtime mask defeats vector access: a small tile keeps the
    tail from setting the register count on a GPU, or the UB plan on an NPU)."""
    lanes = tl.arange(0, LANES)
    full = count // LANES * LANES
    for i in range(0, full, LANES):
        tl.store(dst + i + lanes, tl.load(src + i + lanes))
    tail = tl.arange(0, TAIL)
    for j in range(full, count, TAIL):
        mask = j + tail < count
        tl.store(dst + j + tail, tl.load(src + j + tail, mask=mask), mask=mask)


def _copy_bytes(src_addr, dst_addr, nbytes, COPY_BYTES: tl.constexpr, SLOW_BYTES: tl.constexpr):
    """Non-overlapping copy of ``nbytes`` between two int64 addresses."""
    aligned = (((src_addr | dst_addr) & 15) == 0) & ((nbytes & 7) == 0)
    if aligned:
        # Both ends 16-byte aligned (checked above, so the hint is true): 8-byte words.
        src_words = tl.multiple_of(src_addr.to(tl.pointer_type(tl.int64)), 16)
        dst_words = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.int64)), 16)
        _copy_tile_loop(src_words, dst_words, nbytes // 8, COPY_BYTES // 8, SLOW_BYTES // 8)
    else:
        # Rare (vLLM's states are aligned): bytes, in small steps, so that this path costs no
        # more registers (GPU) or unified buffer (NPU) than the fast one.
        src_bytes = src_addr.to(tl.pointer_type(tl.uint8))
        dst_bytes = dst_addr.to(tl.pointer_type(tl.uint8))
        _copy_tile_loop(src_bytes, dst_bytes, nbytes, SLOW_BYTES, SLOW_BYTES)


def _copy_piece(src_addr, dst_addr, nbytes, piece, pieces, COPY_BYTES: tl.constexpr, SLOW_BYTES: tl.constexpr):
    """This program's piece of a non-overlapping copy cut into at most ``pieces`` pieces of whole
    copy steps (the masked tail, in small steps, comes only at the region's end; pieces past the
    region copy nothing)."""
    chunk = ((nbytes + pieces - 1) // pieces + COPY_BYTES - 1) // COPY_BYTES * COPY_BYTES
    lo = piece * chunk
    hi = tl.minimum(nbytes, lo + chunk)
    if lo < hi:
        _copy_bytes(src_addr + lo, dst_addr + lo, hi - lo, COPY_BYTES, SLOW_BYTES)


def _copy_rows(src, dst, rows, row_stride, row_len, piece, pieces, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``row_len`` elements of each of ``rows`` rows (``row_stride`` elements apart, typed
    pointers); this program's share of the rows only.

    A row may overlap itself (the in-place shift of a dim-first conv state): a row lies in one
    tile, which is loaded whole before it is stored, and column steps go front to back.
    """
    per = (rows + pieces - 1) // pieces
    r_lo = piece * per
    r_hi = tl.minimum(rows, r_lo + per)
    r = tl.arange(0, ROWS)[:, None]
    c = tl.arange(0, COLS)[None, :]
    for r0 in range(r_lo, r_hi, ROWS):
        row = r0 + r
        offset = row.to(tl.int64) * row_stride + c
        for c0 in range(0, row_len, COLS):
            mask = (row < r_hi) & (c0 + c < row_len)
            tl.store(dst + offset + c0, tl.load(src + offset + c0, mask=mask), mask=mask)


def _copy_row_span(
    src_addr, dst_addr, rows, row_stride, row_bytes, piece, pieces, ROWS: tl.constexpr, COLS: tl.constexpr
):
    """Rows of a dim-first state as 4- or 2-byte elements where every address and length allows
    (a bf16 window shifted by an even number of tokens moves as int32), else as bytes; a tile
    holds ``ROWS * 4`` elements whatever their size (fewer rows of narrower elements)."""
    bits = src_addr | dst_addr | row_stride | row_bytes
    if (bits & 3) == 0:
        src4 = src_addr.to(tl.pointer_type(tl.int32))
        dst4 = dst_addr.to(tl.pointer_type(tl.int32))
        _copy_rows(src4, dst4, rows, row_stride // 4, row_bytes // 4, piece, pieces, ROWS, COLS // 4)
    elif (bits & 1) == 0:
        src2 = src_addr.to(tl.pointer_type(tl.int16))
        dst2 = dst_addr.to(tl.pointer_type(tl.int16))
        _copy_rows(src2, dst2, rows, row_stride // 2, row_bytes // 2, piece, pieces, ROWS // 2, COLS // 2)
    else:
        src1 = src_addr.to(tl.pointer_type(tl.uint8))
        dst1 = dst_addr.to(tl.pointer_type(tl.uint8))
        _copy_rows(src1, dst1, rows, row_stride, row_bytes, piece, pieces, ROWS // 4, COLS)


def _postprocess_kernel(
    num_accepted_tokens_ptr,
    mamba_state_idx_ptr,
    num_scheduled_tokens_ptr,
    num_computed_tokens_ptr,
    num_draft_tokens_ptr,
    block_table_ptrs_ptr,
    block_table_stride_req,
    state_base_addrs_ptr,
    state_block_strides_ptr,
    state_elem_sizes_ptr,
    state_inner_sizes_ptr,
    state_conv_widths_ptr,
    state_group_indices_ptr,
    state_dim_row_count_ptr,
    state_dim_row_stride_ptr,
    num_accepted_tokens_out_ptr,
    idx_mapping_ptr,
    num_reqs,
    block_size: tl.constexpr,
    CONV_STATE_DIM_FIRST: tl.constexpr,
    HAS_IDX_MAPPING: tl.constexpr,
    PRECOMPUTED_NEW_COMPUTED: tl.constexpr,
    REQ_BLOCK: tl.constexpr,
    COPY_BYTES: tl.constexpr,
    SLOW_BYTES: tl.constexpr,
    DS_ROWS: tl.constexpr,
    DS_COLS: tl.constexpr,
    MIN_PIECE: tl.constexpr,
    DS_MIN_ROWS: tl.constexpr,
    PIECES_FIRST: tl.constexpr,
    PACKED_WALK: tl.constexpr,
):
    if PIECES_FIRST:
        piece = tl.program_id(0)
        pieces = tl.num_programs(0)
        state_idx = tl.program_id(1)
    else:
        state_idx = tl.program_id(0)
        piece = tl.program_id(1)
        pieces = tl.num_programs(1)
    first_row = tl.program_id(2) * REQ_BLOCK

    # -- one round of memory latency for everything that depends on no load: this program's state
    # (its metadata, and the first group's block table address, which a one-group model needs) and
    # the decisions for REQ_BLOCK batch rows at once, as vectors
    base = tl.load(state_base_addrs_ptr + state_idx).to(tl.int64)
    block_stride = tl.load(state_block_strides_ptr + state_idx).to(tl.int64)
    elem = tl.load(state_elem_sizes_ptr + state_idx).to(tl.int64)
    inner = tl.load(state_inner_sizes_ptr + state_idx).to(tl.int64)
    width = tl.load(state_conv_widths_ptr + state_idx)
    group = tl.load(state_group_indices_ptr + state_idx)
    table_addr = tl.load(block_table_ptrs_ptr).to(tl.int64)
    if CONV_STATE_DIM_FIRST:
        dim_rows = tl.load(state_dim_row_count_ptr + state_idx)
        row_stride = tl.load(state_dim_row_stride_ptr + state_idx).to(tl.int64)

    lane = tl.arange(0, REQ_BLOCK)
    batch = first_row + lane
    active_rows = batch < num_reqs
    if HAS_IDX_MAPPING:
        req = tl.load(idx_mapping_ptr + batch, mask=active_rows, other=-1)
        active_rows = active_rows & (req >= 0)
    else:
        req = batch
    accepted = tl.load(num_accepted_tokens_ptr + req, mask=active_rows, other=1)
    src_col = tl.load(mamba_state_idx_ptr + req, mask=active_rows, other=0)
    if PRECOMPUTED_NEW_COMPUTED:
        new_computed = tl.load(num_computed_tokens_ptr + req, mask=active_rows, other=0)
        running = new_computed - accepted + 1
    else:
        scheduled = tl.load(num_scheduled_tokens_ptr + req, mask=active_rows, other=0)
        computed = tl.load(num_computed_tokens_ptr + req, mask=active_rows, other=0)
        draft = tl.load(num_draft_tokens_ptr + req, mask=active_rows, other=0)
        running = computed + scheduled - draft
        new_computed = running + accepted - 1
    aligned = (new_computed // block_size) * block_size
    needs = active_rows & (aligned >= running)
    bias = aligned - running
    dst_col = aligned // block_size - 1
    same_col = src_col == dst_col

    if (state_idx == 0) & (piece == 0):
        ones = tl.full((REQ_BLOCK,), 1, tl.int32)
        if num_accepted_tokens_out_ptr is None:
            tl.store(num_accepted_tokens_ptr + req, ones, mask=needs & same_col)
        else:
            tl.store(num_accepted_tokens_out_ptr + req, ones, mask=needs & same_col)

    copies = needs & ~(same_col & (bias == 0))
    # one reduction: the copying requests (low 16 bits) and those of them with a shift
    counts = tl.sum(copies.to(tl.int32) + (copies & (bias > 0)).to(tl.int32) * 65536, axis=0)
    n_copies = counts % 65536

    # -- the pieces this state's largest region fills at MIN_PIECE bytes or more each (and, dim
    # first with a shift, where rows are copied a few bytes each, DS_MIN_ROWS rows or more):
    # programs past them, and every program of a step where no request copies, are done here
    temporal = width == 0
    if CONV_STATE_DIM_FIRST:
        span = tl.where(temporal, inner * elem, dim_rows.to(tl.int64) * row_stride)
        fill = tl.where(temporal | (counts < 65536), 1, (dim_rows + DS_MIN_ROWS - 1) // DS_MIN_ROWS).to(tl.int64)
    else:
        span = tl.where(temporal, 1, width).to(tl.int64) * inner * elem
        fill = span * 0 + 1
    active = tl.minimum(tl.maximum((span + MIN_PIECE - 1) // MIN_PIECE, fill), pieces).to(tl.int32)
    if (piece < active) & (n_copies > 0):
        if group != 0:
            table_addr = tl.load(block_table_ptrs_ptr + group).to(tl.int64)
        table = table_addr.to(tl.pointer_type(tl.int32))

        # -- every copying request's block ids gathered as vectors (one round of memory latency
        # for the batch, none inside the walk)
        rows_at = table + batch.to(tl.int64) * block_table_stride_req
        dst_block = tl.load(rows_at + dst_col, mask=copies, other=0)
        src_block = tl.load(rows_at + tl.where(temporal, src_col + bias, src_col), mask=copies, other=0)
        if PACKED_WALK:
            # Two reductions per copying request: (lane, shift) as one int64 key whose minimum
            # names the next lane (independent of the gather above, so it can overlap it), then
            # that lane's (source, destination) block ids as one int64.
            key = lane.to(tl.int64) * 4294967296 + bias.to(tl.int64)
            blocks = src_block.to(tl.int64) * 4294967296 + dst_block.to(tl.uint32, bitcast=True).to(tl.int64)
        else:
            tok_v = bias.to(tl.int64)

        # -- walk the copying requests in order: the next lane above `prev` that copies.
        # nbytes < 0 marks each layout's special region: rows of a shifted dim-first conv state
        # (DS), or the in-place shift (SD: source block == destination block).
        prev = state_idx * 0 - 1
        for _ in range(0, n_copies):
            if PACKED_WALK:
                k = tl.min(tl.where(copies & (lane > prev), key, REQ_BLOCK * 4294967296), axis=0)
                prev = (k >> 32).to(tl.int32)
                tok = k - (k >> 32) * 4294967296
                v = tl.sum(tl.where(lane == prev, blocks, 0), axis=0)
                s_block = v >> 32  # the sign of the source id restored by the arithmetic shift
                d_block = v.to(tl.int32).to(tl.int64)  # low 32 bits
            else:
                # Addresses from reduced int32 block ids (triton-ascend's pointer analysis cannot
                # follow a reduced int64 address into the pointer cast).
                cur = tl.min(tl.where(copies & (lane > prev), lane, REQ_BLOCK), axis=0)
                prev = cur
                pick = lane == cur
                s_block = tl.sum(tl.where(pick, src_block, 0), axis=0).to(tl.int64)
                d_block = tl.sum(tl.where(pick, dst_block, 0), axis=0).to(tl.int64)
                tok = tl.sum(tl.where(pick, tok_v, 0), axis=0)
            left = tl.maximum(width - tok.to(tl.int32), 0).to(tl.int64)  # conv tokens kept
            if CONV_STATE_DIM_FIRST:
                row_bytes = left * elem
                packed = (tok == 0) & (row_bytes == row_stride)  # whole packed rows: one span
                src_off = tl.where(temporal | packed, 0, tok * elem)
                n = tl.where(temporal, inner * elem, tl.where(packed, dim_rows.to(tl.int64) * row_stride, -row_bytes))
            else:
                src_off = tl.where(temporal, 0, tok * inner * elem)
                n = tl.where(temporal, inner * elem, left * inner * elem)
                in_place = ~temporal & (s_block == d_block)  # rows left after the shift, as -rows
                n = tl.where(in_place, tl.where(tok > 0, -left, 0), n)
            s = base + s_block * block_stride + src_off
            d = base + d_block * block_stride
            # n >= 0: one region. n < 0, SD: the in-place shift, -n token rows (of inner * elem
            # bytes) moved up by `tok` rows, front to back; each program moves only its own
            # columns of every row, and a row is read before it is written, so no program races
            # another.
            reps = n * 0 + 1
            step = n * 0
            if n < 0:
                if CONV_STATE_DIM_FIRST:
                    _copy_row_span(s, d, dim_rows, row_stride, -n, piece, active, DS_ROWS, DS_COLS)
                    reps = n * 0
                else:
                    reps = -n
                    step = inner * elem
                    n = step
            for j in range(0, reps):
                _copy_piece(s + j * step, d + j * step, n, piece, active, COPY_BYTES, SLOW_BYTES)


_TRITON_FUNCTIONS = (
    "_copy_tile_loop",
    "_copy_bytes",
    "_copy_piece",
    "_copy_rows",
    "_copy_row_span",
    "_postprocess_kernel",
)
_lock = threading.Lock()
_compiled: Any = None


def compiled():
    """The Triton kernel (``triton.jit`` on first use, which imports triton)."""
    global tl, _compiled
    if _compiled is None:
        with _lock:
            if _compiled is None:
                import triton
                import triton.language as language

                tl = language
                g = globals()
                for name in _TRITON_FUNCTIONS:
                    g[name] = triton.jit(g[name])
                _compiled = g["_postprocess_kernel"]
    return _compiled
