#!/usr/bin/env python3
"""Device check and benchmark of the postprocess kernel (issue 5, section 2).

    python scripts/bench_postprocess.py fetch [--find-links DIR]   # once, with network
    python scripts/bench_postprocess.py check                      # correctness on the device
    python scripts/bench_postprocess.py bench [--sweep]            # check, then the table
    python scripts/bench_postprocess.py --cpu-smoke                # both, tiny, interpreter (CI)

``fetch`` downloads the vLLM 0.25.1 and vllm-ascend 0.25.1rc1 wheels with pip (``--no-deps``)
into a temporary folder, extracts just the two kernel files into ``.bench/`` (git-ignored; carry
it to the device; ``ALP_BENCH_DIR`` moves it) and deletes the wheels.
At run time the kernel functions are lifted out of those files with ``ast`` into
``.bench/_rt_*.py`` and imported with plain ``triton``: no vLLM needed, none of their code kept
here. Kernels: ours (``ascend_layerwise_patch/kernels/``' launcher, loaded by path, so the
package and its dependencies are not needed), vLLM 0.25.1's, vllm-ascend 0.25.1rc1's old
17-parameter kernel (V1 callers and the dim-last layout only: it has no dim-first support), and
a plain ``torch`` copy of the same bytes. Every kernel's output is checked against a PyTorch
reference before it is timed. Times are medians of ``triton.testing.do_bench`` (L2 flushed
between runs); GB/s counts bytes read plus bytes written.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(os.environ.get("ALP_BENCH_DIR") or ROOT / ".bench")
SMOKE_NOTE = ("cpu smoke: Triton's interpreter on the CPU, tiny shapes; the times and ratios below are "
              "not judged -- only that every kernel runs and matches the reference (numbers: docs/h200_postprocess.md)")
FOREIGN = {  # name: (requirement, file in the wheel, kernel functions to lift)
    "vllm": (
        "vllm==0.25.1",
        "vllm/v1/worker/mamba_utils.py",
        ("_copy_mamba_state_block", "postprocess_mamba_fused_kernel"),
    ),
    "ascend": (
        "vllm-ascend==0.25.1rc1",
        "vllm_ascend/ops/triton/mamba/postprocess.py",
        ("postprocess_mamba_fused_kernel",),
    ),
}


# ----------------------------------------------------------------------------- kernels


def fetch(find_links: str | None, no_index: bool = False) -> None:
    """The two kernel files out of their wheels; the wheels (~260 MB) are read, never kept."""
    BENCH.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(BENCH / "wheels", ignore_errors=True)  # where earlier versions kept them
    with tempfile.TemporaryDirectory(prefix="alp-wheels-") as wheels:
        for name, (req, member, _) in FOREIGN.items():
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--pre", "--only-binary=:all:", "-d", wheels]
            cmd.append(req)
            if find_links:
                cmd += ["--find-links", find_links]
            if no_index:
                cmd.append("--no-index")
            subprocess.run(cmd, check=True)
            dist = req.split("==")[0].replace("-", "_")
            wheel = next(Path(wheels).glob(f"{dist}-{req.split('==')[1]}-*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                (BENCH / f"{name}_{Path(member).name}").write_bytes(zf.read(member))
            print(f"{name}: {member} from {wheel.name} -> {BENCH / f'{name}_{Path(member).name}'} (wheel not kept)")


def load_foreign(name: str):
    """The named kernel lifted out of the extracted file into a module of plain triton."""
    _, member, functions = FOREIGN[name]
    path = BENCH / f"{name}_{Path(member).name}"
    if not path.exists():
        return None
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    parts = ["import triton", "import triton.language as tl", ""]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            parts += lines[start : node.end_lineno] + ["", ""]
    out = BENCH / f"_rt_{name}.py"
    out.write_text("\n".join(parts))
    return _import(f"_rt_{name}", out).postprocess_mamba_fused_kernel


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_ours():
    """Our launcher by path: a package object of its own for kernels/ (no library __init__: no wrapt)."""
    if "alp_kernels" not in sys.modules:
        package = types.ModuleType("alp_kernels")
        package.__path__ = [str(ROOT / "ascend_layerwise_patch" / "kernels")]
        sys.modules["alp_kernels"] = package
    return importlib.import_module("alp_kernels.postprocess_launch")


# ----------------------------------------------------------------------------- a mamba cache


class Cache:
    """Layers of (conv, temporal) states as as_strided views into padded pages, like vLLM's."""

    def __init__(self, torch, device, *, layers, width, dim, temporal, blocks, pad, dim_first, groups=1, seed=0):
        self.torch, self.device = torch, device
        self.width, self.dim, self.dim_first, self.temporal = width, dim, dim_first, temporal
        self.conv_bytes = width * dim * 2  # bf16
        self.tmp_offset = -(-self.conv_bytes // 4) * 4
        self.temporal_bytes = 4 * temporal[0] * temporal[1] * temporal[2]  # fp32
        self.page = -(-(self.tmp_offset + self.temporal_bytes + pad) // 64) * 64
        self.blocks, self.layers, self.groups = blocks, layers, min(groups, layers)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.raw = [
            torch.randint(0, 256, (blocks * self.page,), dtype=torch.uint8, device=device, generator=gen)
            for _ in range(layers)
        ]
        self.states = [self.views(raw) for raw in self.raw]

    def with_layout(self, dim_first: bool) -> "Cache":
        """The same bytes seen with the other conv layout."""
        other = Cache.__new__(Cache)
        other.__dict__.update(self.__dict__)
        other.dim_first = dim_first
        other.states = [other.views(raw) for raw in other.raw]
        return other

    def views(self, raw):
        t, (h, k, v) = self.torch, self.temporal
        shape = (self.dim, self.width) if self.dim_first else (self.width, self.dim)
        conv = t.as_strided(raw.view(t.bfloat16), (self.blocks, *shape), (self.page // 2, shape[1], 1))
        tmp = t.as_strided(
            raw.view(t.float32), (self.blocks, h, k, v), (self.page // 4, k * v, v, 1), self.tmp_offset // 4
        )
        return conv, tmp

    def group_of(self, layer):
        return layer * self.groups // self.layers

    def metadata(self, tables):
        """The flattened per-(layer, state) metadata vLLM 0.25 builds (written from its docs)."""
        t, rows = self.torch, []
        for layer, (conv, tmp) in enumerate(self.states):
            g = self.group_of(layer)
            if self.dim_first:
                rows.append((conv, conv.size(2), 1, conv.size(1), conv.stride(1) * 2, g))
            else:
                rows.append((conv, conv.size(1), conv.stride(1), 0, 0, g))
            rows.append((tmp, 0, tmp[0].numel(), 0, 0, g))
        col = lambda i, dt: t.tensor([r[i] for r in rows], dtype=dt, device=self.device)  # noqa: E731
        return dict(
            block_table_ptrs_ptr=t.tensor([x.data_ptr() for x in tables], dtype=t.int64, device=self.device),
            block_table_stride_req=tables[0].stride(0),
            state_base_addrs_ptr=t.tensor([r[0].data_ptr() for r in rows], dtype=t.int64, device=self.device),
            state_block_strides_ptr=t.tensor([self.page] * len(rows), dtype=t.int64, device=self.device),
            state_elem_sizes_ptr=t.tensor([r[0].element_size() for r in rows], dtype=t.int32, device=self.device),
            state_inner_sizes_ptr=col(2, t.int64),
            state_conv_widths_ptr=col(1, t.int32),
            state_group_indices_ptr=col(5, t.int32),
            state_dim_row_count_ptr=col(3, t.int32),
            state_dim_row_stride_ptr=col(4, t.int64),
        )


class Step:
    """Per-request inputs of one step; ``slots`` maps batch rows to request slots (V2)."""

    def __init__(self, torch, device, accepted, state_idx, running, slots, tables, block_size):
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        self.accepted, self.state_idx, self.running = i32(accepted), i32(state_idx), i32(running)
        self.slots, self.tables, self.block_size = slots, tables, block_size
        self.slots_t = i32(slots)
        self.host = (list(accepted), list(state_idx), list(running))

    def decisions(self):
        """[(batch row, slot, src col, dst col, bias)] of rows whose state moves; slots set to 1."""
        moves, ones = [], set()
        accepted, state_idx, running = self.host
        for b, slot in enumerate(self.slots):
            if slot < 0:
                continue
            new = running[slot] + accepted[slot] - 1
            aligned = new // self.block_size * self.block_size
            if aligned < running[slot]:
                continue
            src, dst, bias = state_idx[slot], aligned // self.block_size - 1, aligned - running[slot]
            if src == dst:
                ones.add(slot)
                if bias == 0:
                    continue
            moves.append((b, slot, src, dst, bias))
        return moves, ones


def make_launch(kernel, cache: Cache, step: Step, *, v2: bool = False, old_signature: bool = False):
    """A launch as vLLM 0.25's callers make it, every tensor built up front; returns (fn, counts)."""
    t = cache.torch
    n = len(step.slots)
    md = list(cache.metadata(step.tables).values())
    grid = (n, 2 * cache.layers)
    common = dict(block_size=step.block_size, COPY_BLOCK_SIZE=1024)
    if v2:  # our V2 caller: a snapshot to read, the live counts as the out buffer
        live, new = step.accepted.clone(), step.running + step.accepted - 1

        def fn():
            kernel[grid](step.accepted.clone(), step.state_idx, None, new, None, *md, live, step.slots_t, n,
                         CONV_STATE_DIM_FIRST=cache.dim_first, HAS_IDX_MAPPING=True, PRECOMPUTED_NEW_COMPUTED=True,
                         **common)

        return fn, live
    out, zeros = step.accepted.clone(), t.zeros_like(step.accepted)
    args = [step.accepted, step.state_idx, zeros + 1, step.running - 1, zeros, *md]
    if old_signature:  # vllm-ascend 0.25.1rc1: vLLM 0.23's 17 parameters
        return (lambda: kernel[grid](*args[:13], out, n, **common)), out
    return (lambda: kernel[grid](*args, out, None, n, CONV_STATE_DIM_FIRST=cache.dim_first, **common)), out


class Expected:
    """The reference (vLLM 0.25.1's semantics) applied to a copy of every page, once per case."""

    def __init__(self, cache: Cache, step: Step):
        t = cache.torch
        moves, self.ones = step.decisions()
        self.pages = [raw.clone() for raw in cache.raw]
        self.written = []
        for layer in range(cache.layers):
            conv, tmp = (s.view(t.uint8) for s in cache.views(self.pages[layer]))
            table = step.tables[cache.group_of(layer)].tolist()
            dst_blocks = []
            for b, _slot, src, dst, bias in moves:
                bt = table[b]
                if bias < cache.width:
                    if cache.dim_first:
                        conv[bt[dst], :, : (cache.width - bias) * 2] = conv[bt[src], :, bias * 2 :].clone()
                    else:
                        conv[bt[dst], : cache.width - bias] = conv[bt[src], bias:].clone()
                tmp[bt[dst]] = tmp[bt[src + bias]].clone()
                dst_blocks.append(bt[dst])
            self.written.append(t.tensor(sorted(set(dst_blocks)), dtype=t.long, device=cache.device))
        self.before = [
            raw.view(cache.blocks, cache.page)[w].clone() for raw, w in zip(cache.raw, self.written)
        ]
        self.accepted = list(step.host[0])

    def verify_and_restore(self, cache: Cache, counts) -> str | None:
        t, error = cache.torch, None
        for slot, value in enumerate(self.accepted):
            want = 1 if slot in self.ones else value
            if error is None and int(counts[slot]) != want:
                error = f"num_accepted[{slot}] = {int(counts[slot])}, expected {want}"
        for layer, raw in enumerate(cache.raw):
            if error is None and not t.equal(raw, self.pages[layer]):
                bad = (raw != self.pages[layer]).nonzero()
                error = f"layer {layer}: {bad.numel()} bytes differ, first at byte {int(bad[0])} (page {cache.page})"
            raw.view(cache.blocks, cache.page)[self.written[layer]] = self.before[layer]
        return error


def check_once(kernel, cache: Cache, step: Step, expected: Expected | None = None, **kw) -> str | None:
    expected = expected or Expected(cache, step)
    fn, counts = make_launch(kernel, cache, step, **kw)
    fn()
    return expected.verify_and_restore(cache, counts)


# ----------------------------------------------------------------------------- steps


def random_step(torch, device, rng, cache: Cache, n_rows: int, *, v2: bool, block_size: int, spec: int, cols: int):
    n_slots = n_rows + 2 if v2 else n_rows
    accepted, state_idx, running = [], [], []
    for _ in range(n_slots):
        a = rng.randint(1, spec + 1)
        r = max(1, rng.choice([block_size * rng.randint(1, 5) - rng.randint(0, a), rng.randint(1, 5 * block_size)]))
        dst = (r + a - 1) // block_size - 1
        accepted.append(a)
        running.append(r)
        state_idx.append(max(0, rng.choice([dst, dst, dst - 1, dst + 1, 0])))
    if v2:
        slots = rng.sample(range(n_slots), n_rows)
        slots = [s if i == 0 or rng.random() < 0.7 else -1 for i, s in enumerate(slots)]
    else:
        slots = list(range(n_rows))
    tables = []
    for _ in range(cache.groups):
        gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
        ids = torch.randperm(cache.blocks - 1, generator=gen)[: n_rows * cols].to(torch.int32) + 1
        table = torch.full((n_rows, cols + 5), -1, dtype=torch.int32)
        table[:, :cols] = ids.view(n_rows, cols)
        tables.append(table.to(device))
    return Step(torch, device, accepted, state_idx, running, slots, tables, block_size)


def case_step(torch, device, cache: Cache, n_reqs: int, copying: int, block_size: int, bias: int = 0):
    """``copying`` of ``n_reqs`` requests cross a block boundary (src col 0 -> dst col 1, with
    ``bias`` accepted tokens past the running state: conv shifted, temporal from col ``bias``);
    the others stay inside their block."""
    accepted = [1 + bias] * n_reqs
    running = [2 * block_size - bias if i < copying else 2 * block_size - 7 - bias for i in range(n_reqs)]
    ids = torch.arange(1, 1 + 3 * n_reqs, dtype=torch.int32).view(n_reqs, 3)
    table = torch.full((n_reqs, 8), -1, dtype=torch.int32)
    table[:, :3] = ids
    return Step(torch, device, accepted, [0] * n_reqs, running, list(range(n_reqs)), [table.to(device)], block_size)


# ----------------------------------------------------------------------------- modes

#: BENCH_OURS='{"pieces": 64, ...}': knobs of the kernel timed as "ours" (default: its own defaults)
OURS = json.loads(os.environ.get("BENCH_OURS") or "{}")
#: --sweep: knobs of PostprocessKernel, each set timed beside the defaults (a set equal to the
#: defaults shows the run-to-run spread).
SWEEP = [
    dict(),
    dict(max_registers=72),
    dict(pieces_first=False),
]
SHORT = dict(pieces="p", copy_bytes="b", ds_rows="r", num_warps="w", max_registers="m", min_piece="min",
             ds_min_rows="dsr", pieces_first="pf", packed_walk="pk")


def sweep_name(knobs: dict) -> str:
    return "ours " + (" ".join(f"{SHORT[k]}{int(v)}" for k, v in knobs.items())
                      or "defaults")


def run_check(torch, device, ours, foreign, *, examples: int) -> bool:
    """Small random caches and steps (V1 and V2, both layouts, one or two groups, spec tokens 0
    or 3, src == dst, padded pages, odd sizes): every kernel that can run the case, checked."""
    rng = random.Random(0)
    ok, counts = True, {}
    for i in range(examples):
        dim_first, v2 = bool(i % 2), bool(i // 2 % 2)
        temporal = (rng.randint(1, 3), rng.randint(1, 8), rng.choice([1, 4, 16]))
        cache = Cache(torch, device, layers=rng.randint(1, 3), width=rng.randint(2, 5),
                      dim=rng.choice([1, 3, 8, 64, 1000]), temporal=temporal, blocks=64,
                      pad=rng.choice([0, 64, 4096]), dim_first=dim_first, groups=rng.choice([1, 2]), seed=i)
        step = random_step(torch, device, rng, cache, rng.randint(1, 5), v2=v2, block_size=rng.choice([2, 4, 8]),
                           spec=rng.choice([0, 3]), cols=11)
        kernels = [("ours", ours.PostprocessKernel(pieces=rng.choice([None, 1, 3, 8])), {"v2": v2})]
        if foreign.get("vllm") is not None and not v2:  # vLLM's V2 path races; its V1 is an oracle
            kernels.append(("vllm", foreign["vllm"], {}))
        if foreign.get("ascend") is not None and not v2 and not dim_first:
            kernels.append(("ascend", foreign["ascend"], {"old_signature": True}))
        expected = Expected(cache, step)
        for name, kernel, kw in kernels:
            err = check_once(kernel, cache, step, expected, **kw)
            counts[name] = counts.get(name, 0) + 1
            if err:
                ok = False
                where = f"{name}, example {i}, {'DS' if dim_first else 'SD'}, {'V2' if v2 else 'V1'}"
                print(f"check FAILED [{where}]: {err}")
    print(f"check: {'ok' if ok else 'FAILED'}; examples per kernel: {counts}")
    return ok


def timers(torch, device):
    """{name: fn -> ms}: on a GPU, eager launches (L2 flushed between runs; the method of the
    issue's table) and, with BENCH_GRAPH=1, CUDA-graph replay; on the CPU, a wall clock."""
    if device.type == "cuda":
        import triton.testing

        def graph(fn):
            torch.cuda.synchronize()
            return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")

        timers = {"eager": lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")}
        if os.environ.get("BENCH_GRAPH"):
            timers["graph"] = graph
        return timers

    def wall(fn, reps=2):
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e3

    return {"wall": wall}


def run_bench(torch, device, ours, foreign, *, small: bool, sweep: bool) -> bool:
    if small:
        shape = dict(layers=2, width=4, dim=16, temporal=(2, 4, 8), pad=64)
        block_size, most = 16, 3
    else:  # Qwen3-Next: 36 GDN layers, conv 6 x 8192 bf16, temporal 32 x 128 x 128 fp32 (2 MiB)
        shape = dict(layers=36, width=6, dim=8192, temporal=(32, 128, 128), pad=32768)
        block_size, most = 1024, 128
    cases = [("all copy", "SD", most, most, 0), ("all copy", "SD", 1, 1, 0), ("decode, 1 crosses", "SD", most, 1, 0),
             ("all copy", "DS", most, most, 0), ("all copy", "DS", 1, 1, 0), ("decode, 1 crosses", "DS", most, 1, 0),
             ("all copy, bias 2", "SD", most, most, 2), ("all copy, bias 2", "DS", most, most, 2),
             ("all copy, bias 2", "DS", 1, 1, 2)]
    base = Cache(torch, device, blocks=3 * most + 1, dim_first=False, **shape)
    caches = {"SD": base, "DS": base.with_layout(True)}
    configs = {"ours": ours.PostprocessKernel(**OURS)}
    if sweep:
        for knobs in SWEEP:
            configs[sweep_name(knobs)] = ours.PostprocessKernel(**knobs)
    kernels = list(configs.items()) + [(k, foreign[k]) for k in ("vllm", "ascend") if foreign.get(k) is not None]
    clocks = timers(torch, device)
    tables, ok, launches = {clock: [] for clock in clocks}, True, {}
    for kind, lay, n, copying, bias in cases:
        cache = caches[lay]
        step = case_step(torch, device, cache, n, copying, block_size, bias)
        moves, _ = step.decisions()
        nbytes = cache.layers * sum((cache.width - bias) * cache.dim * 2 + cache.temporal_bytes for *_, bias in moves)
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        results = {clock: {"plain copy": timer(lambda: dst.copy_(src))} for clock, timer in clocks.items()}
        if sweep and device.type == "cuda":  # the copy-only ceiling of a Triton kernel
            copy = triton_copy(torch)
            for clock, timer in clocks.items():
                results[clock]["triton copy"] = timer(lambda: copy(src, dst))
        del src, dst
        expected = Expected(cache, step)
        for name, kernel in kernels:
            old = name == "ascend"
            if old and lay == "DS":
                for res in results.values():
                    res[name] = None  # vllm-ascend's old kernel has no dim-first support
                continue
            err = check_once(kernel, cache, step, expected, old_signature=old)
            if err:
                ok = False
                print(f"bench check FAILED [{name}, {kind}, {lay}, {n} requests]: {err}")
                continue
            fn, _ = make_launch(kernel, cache, step, old_signature=old)
            for clock, timer in clocks.items():
                results[clock][name] = timer(fn)
            if sweep and device.type == "cuda" and kind.startswith("decode"):
                launches.setdefault(name, []).append(launch_us(torch, fn))
        del expected
        for clock in clocks:
            tables[clock].append((kind, lay, n, nbytes, results[clock]))
    if sweep:
        print_registers(ours.compiled())
        for name, us in launches.items():
            print(f"launch (host time per call, decode cases): {name}: {' / '.join(f'{u:.1f}' for u in us)} us")
    for clock, rows in tables.items():
        how = {"graph": "CUDA-graph replay: GPU time only", "eager": "launches from Python, L2 flushed"}
        print(f"\n### {clock} ({how.get(clock, 'interpreter, wall clock')})")
        print_table(rows)
        if sweep:
            print_ratios(rows)
        if small:
            print(SMOKE_NOTE)
    return ok


def launch_us(torch, fn, calls=200):
    """Host time of one launch: ``calls`` launches queued without waiting, then one sync."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def triton_copy(torch):
    """A plain Triton copy, 16 KiB per program: the ceiling of a Triton kernel's copy."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(src, dst, n, BLOCK: tl.constexpr):
        offset = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offset < n
        tl.store(dst + offset, tl.load(src + offset, mask=mask), mask=mask)

    def run(src, dst):
        s, d = (src.view(torch.int64), dst.view(torch.int64)) if src.numel() % 8 == 0 else (src, dst)
        block = 16384 // s.element_size()
        _copy[(triton.cdiv(s.numel(), block),)](s, d, s.numel(), BLOCK=block)

    return run


def print_registers(fn):
    """Registers and spills of every compiled specialisation (a GPU keeps a copy tile in them)."""
    for caches in getattr(fn, "device_caches", {}).values():
        for key, kernel in caches[0].items():
            try:
                kernel._init_handles()
                print(f"regs {kernel.n_regs:3d} spills {kernel.n_spills:3d} warps {kernel.metadata.num_warps}: "
                      f"{str(key)[-90:]}")
            except Exception as e:  # noqa: BLE001 - diagnostics only
                print(f"registers unknown: {e!r}")


def print_ratios(rows):
    """Each kernel's time / plain copy's, a row per kernel, a column per case (the sweep's view)."""
    names = [k for k in rows[0][4] if k != "plain copy"]
    print("\n| kernel | " + " | ".join(f"{kind} {lay} {n}" for kind, lay, n, *_ in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in names:
        cells = ["n/a" if res.get(name) is None else f"{res[name] / res['plain copy']:.3f}" for *_, res in rows]
        print(f"| {name} | " + " | ".join(cells) + " |")


def print_table(rows):
    gbs = lambda nbytes, ms: 2 * nbytes / (ms * 1e-3) / 1e9  # noqa: E731
    names = [k for k in rows[0][4] if k != "plain copy"]
    print("| case | layout | reqs | MB copied | plain copy | " + " | ".join(names)
          + " | vLLM time / ours | ours time / plain | ours, % of plain's GB/s |")
    print("|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|")
    for kind, lay, n, nbytes, res in rows:
        cells = [f"{res['plain copy']:.3f} ms ({gbs(nbytes, res['plain copy']):.0f} GB/s)"]
        for name in names:
            ms = res.get(name)
            cells.append("n/a" if ms is None else f"{ms:.3f} ms ({gbs(nbytes, ms):.0f} GB/s)")
        ours, vllm, plain = res.get("ours"), res.get("vllm"), res["plain copy"]
        ratios = [f"{vllm / ours:.1f}x" if ours and vllm else "-", f"{ours / plain:.2f}x" if ours else "-",
                  f"{100 * plain / ours:.0f}%" if ours else "-"]
        print(f"| {kind} | {lay} | {n} | {nbytes / 1e6:.1f} | " + " | ".join(cells + ratios) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=("fetch", "check", "bench"), default="bench")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under TRITON_INTERPRET=1 on the CPU")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tuning knobs")
    parser.add_argument("--find-links", help="fetch: a folder of wheels to use before the index")
    parser.add_argument("--no-index", action="store_true", help="fetch: only --find-links, no package index")
    parser.add_argument("--examples", type=int, default=24)
    args = parser.parse_args()
    if args.mode == "fetch":
        fetch(args.find_links, args.no_index)
        return 0
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        print(SMOKE_NOTE)
    import torch

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    ours = load_ours()
    foreign = {name: load_foreign(name) for name in FOREIGN}
    missing = [name for name, k in foreign.items() if k is None]
    if missing:
        print(f"not in .bench/ (run `fetch`): {', '.join(missing)}; timing the others")
    if device.type == "cuda":
        import triton

        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
              f"GPU tuning: {ours.TUNING['gpu']}"
              + (f"; ours: {OURS}" if OURS else ""))
    ok = run_check(torch, device, ours, foreign, examples=8 if args.cpu_smoke else args.examples)
    if args.mode == "bench":
        ok &= run_bench(torch, device, ours, foreign, small=args.cpu_smoke, sweep=args.sweep)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
