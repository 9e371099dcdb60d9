"""The launcher of the fused mamba postprocess kernel (``postprocess``'s Triton code):
:class:`PostprocessKernel` takes vLLM 0.25's 23-parameter launch ``kernel[grid](...)``, works out the
grid and the tuning for the device (``TUNING`` by Triton backend, the piece count from its cores) once
per (device, states), and launches the kernel compiled on first use. Importing it imports neither
torch nor triton.

A by-path load (tests/ascend_compile, scripts/bench_postprocess.py: no package, no wrapt) makes a
package object of its own for this folder and imports this module from it; ``kernel`` is the
Triton code's module (``kernel._copy_bytes`` may be swapped before the first compile).
"""

from __future__ import annotations

from . import postprocess as kernel
from .postprocess import DS_COLS, PARAMS, REQ_BLOCK, compiled

__all__ = ["PARAMS", "PostprocessKernel", "TUNING", "compiled", "default_pieces", "device_cores", "device_info", "kernel"]

_DEFAULTS = {"HAS_IDX_MAPPING": False, "PRECOMPUTED_NEW_COMPUTED": False}
_N_PARAMS = len(PARAMS)
_INDEX = {name: i for i, name in enumerate(PARAMS)}
_DEFAULT_AT = tuple((_INDEX[name], value) for name, value in _DEFAULTS.items())
_MISSING = object()
#: Where ``launch`` reads the values it passes on by name (the first ``_NUM_REQS`` go as they are).
_NUM_REQS, _BLOCK_SIZE = _INDEX["num_reqs"], _INDEX["block_size"]
_DIM_FIRST, _HAS_IDX, _PRECOMPUTED = (_INDEX[n] for n in ("CONV_STATE_DIM_FIRST", "HAS_IDX_MAPPING", "PRECOMPUTED_NEW_COMPUTED"))

#: Launch defaults by Triton backend: bytes per copy step, rows per dim-first tile, programs per
#: core and at most ``max_pieces`` (set the piece count), the least bytes a piece gets (a state
#: smaller than ``pieces * min_piece`` is copied by fewer programs: the others exit at once), grid
#: order, the walk's reductions and warps. An NPU vector core stages every tile in its 192 KiB
#: unified buffer, double-buffered by bishengir: 8 KiB steps plan 20-26% of it
#: (tests/ascend_compile). A GPU keeps a tile in registers and wants bytes in flight: the best of
#: scripts/bench_postprocess.py --sweep on an H200 (docs/h200_postprocess.md).
TUNING = {
    "npu": dict(copy_bytes=8192, ds_rows=64, programs_per_core=8, max_pieces=64, min_piece=8192,
                ds_min_rows=64, pieces_first=False, packed_walk=False, num_warps=None),
    "gpu": dict(copy_bytes=16384, ds_rows=128, programs_per_core=64, max_pieces=128, min_piece=16384,
                ds_min_rows=128, pieces_first=True, packed_walk=True, num_warps=4),
}
MAX_PIECES = 64  # default_pieces' cap where the caller names none

_devices: dict[str, tuple[str, int | None]] = {}


def device_info(device) -> tuple[str, int | None]:
    """(``"npu"`` or ``"gpu"``, vector cores / SMs) of ``device`` from Triton's driver; the
    interpreter or no driver: ``("gpu", None)``."""
    key = str(device)
    if key not in _devices:
        try:
            from triton.runtime import driver

            backend = "npu" if driver.active.get_current_target().backend == "npu" else "gpu"
            props = driver.active.utils.get_device_properties(getattr(device, "index", None) or 0)
            cores = int(props.get("num_vectorcore") or props.get("multiprocessor_count") or 0) or None
            _devices[key] = (backend, cores)
        except Exception:  # noqa: BLE001 - interpreter, no driver: fall back to the defaults
            _devices[key] = ("gpu", None)
    return _devices[key]


def device_cores(device) -> int | None:
    return device_info(device)[1]


def default_pieces(cores: int | None, states: int, programs_per_core: int = 32, max_pieces: int = MAX_PIECES) -> int:
    """Enough programs to keep every core busy with one copying request, as a power of two."""
    if not cores:
        return 4
    want = -(-cores * programs_per_core // max(states, 1))
    pieces = 1
    while pieces < want and pieces < max_pieces:
        pieces *= 2
    return pieces


class PostprocessKernel:
    """Drop-in for ``postprocess_mamba_fused_kernel``: ``kernel[grid](*23 params)`` launches ours.

    ``grid`` is the caller's ``(num_reqs, num_layers * num_state_types)``; only its second entry
    (the number of states) and ``min(grid[0], num_reqs)`` are used. The keyword arguments
    are tuning knobs; None takes the backend's ``TUNING`` entry (the piece count: from
    the device's cores). The GPU defaults are the best of a sweep on an H200
    (scripts/bench_postprocess.py --sweep); none of the knobs changes what is copied.
    """

    arg_names = PARAMS

    def __init__(
        self,
        *,
        pieces: int | None = None,
        copy_bytes: int | None = None,
        ds_rows: int | None = None,
        num_warps: int | None = None,
        max_registers: int | None = None,
        min_piece: int | None = None,
        ds_min_rows: int | None = None,
        pieces_first: bool | None = None,
        packed_walk: bool | None = None,
    ):
        if copy_bytes is not None and (copy_bytes < 16 or copy_bytes & (copy_bytes - 1)):
            raise ValueError(f"copy_bytes must be a power of two >= 16, got {copy_bytes}")
        if ds_rows is not None and (ds_rows < 4 or ds_rows & (ds_rows - 1)):
            raise ValueError(f"ds_rows must be a power of two >= 4, got {ds_rows}")
        if min_piece is not None and min_piece < 1:
            raise ValueError(f"min_piece must be positive, got {min_piece}")
        if ds_min_rows is not None and ds_min_rows < 1:
            raise ValueError(f"ds_min_rows must be positive, got {ds_min_rows}")
        self.pieces = pieces
        self.copy_bytes = copy_bytes
        self.ds_rows = ds_rows
        self.num_warps = num_warps
        self.max_registers = max_registers  # GPU only: Triton's maxnreg
        self.min_piece = min_piece
        self.ds_min_rows = ds_min_rows
        self.pieces_first = pieces_first
        self.packed_walk = packed_walk
        self._cache: dict = {}

    def __repr__(self) -> str:
        return f"<ascend_layerwise_patch postprocess_mamba_fused_kernel (23 params) pieces={self.pieces}>"

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, *args, **kwargs)

    def _knob(self, name, tuning):
        value = getattr(self, name)
        return tuning[name] if value is None else value

    def _settings(self, device, states: int):
        """(pieces, the launch's constant keyword arguments) for a device and a
        number of states, worked out once: a decode step's launch is on the host's critical path."""
        key = (device, states)
        found = self._cache.get(key)
        if found is None:
            backend, cores = device_info(device)
            tuning = TUNING[backend]
            pieces = self.pieces or default_pieces(cores, states, tuning["programs_per_core"], tuning["max_pieces"])
            copy_bytes = self._knob("copy_bytes", tuning)
            const = dict(
                REQ_BLOCK=REQ_BLOCK,
                COPY_BYTES=copy_bytes,
                SLOW_BYTES=max(copy_bytes // 16, 16),
                DS_ROWS=self._knob("ds_rows", tuning),
                DS_COLS=DS_COLS,
                MIN_PIECE=self._knob("min_piece", tuning),
                DS_MIN_ROWS=self._knob("ds_min_rows", tuning),
                PIECES_FIRST=bool(self._knob("pieces_first", tuning)),
                PACKED_WALK=bool(self._knob("packed_walk", tuning)),
            )
            num_warps = self._knob("num_warps", tuning)
            if num_warps:
                const["num_warps"] = num_warps
            if self.max_registers and backend == "gpu":
                const["maxnreg"] = self.max_registers
            found = self._cache[key] = (pieces, const)
        return found

    def launch(self, grid, *args, **kwargs) -> None:
        given = len(args)
        if given > _N_PARAMS:
            raise TypeError(f"postprocess_mamba_fused_kernel takes {_N_PARAMS} parameters, got {given}")
        a = list(args) + [_MISSING] * (_N_PARAMS - given)
        for key, value in kwargs.items():
            i = _INDEX.get(key)
            if i is None:
                raise TypeError(f"postprocess_mamba_fused_kernel got an unexpected parameter {key!r}")
            if i < given:
                raise TypeError(f"postprocess_mamba_fused_kernel got multiple values for {key!r}")
            a[i] = value
        if given + len(kwargs) < _N_PARAMS:
            for i, value in _DEFAULT_AT:
                if a[i] is _MISSING:
                    a[i] = value
            missing = [p for p, v in zip(PARAMS, a) if v is _MISSING]
            if missing:
                raise TypeError(f"postprocess_mamba_fused_kernel is missing {', '.join(missing)}")
        if callable(grid):
            grid = grid(dict(zip(PARAMS, a)))
        rows, states = min(int(grid[0]), int(a[_NUM_REQS])), (int(grid[1]) if len(grid) > 1 else 1)
        if rows <= 0 or states <= 0:
            return
        kernel = compiled()
        pieces, const = self._settings(a[0].device, states)
        blocks = -(-rows // REQ_BLOCK)
        kernel[(pieces, states, blocks) if const["PIECES_FIRST"] else (states, pieces, blocks)](
            *a[:_NUM_REQS],
            rows,
            block_size=a[_BLOCK_SIZE],
            CONV_STATE_DIM_FIRST=bool(a[_DIM_FIRST]),
            HAS_IDX_MAPPING=bool(a[_HAS_IDX]),
            PRECOMPUTED_NEW_COMPUTED=bool(a[_PRECOMPUTED]),
            **const,
        )
