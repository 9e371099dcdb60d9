"""Async scheduling (issue 23): a step still running on the device when the scheduler moves on -- its
cache writes held back (:class:`InFlightWrites`), its pre-copy uploads read late (:class:`DelayedUploads`)."""

from __future__ import annotations

from .instance import PoolInstance
from .rank import _Rank


def _ranks_here(inst: PoolInstance, driver: str) -> list:
    """The instance's ranks, for a driver that reaches into their memory from this process."""
    if inst.procs is not None:
        raise TypeError(f"{driver} reaches into the ranks' memory from the engine's process: build {inst.name} with processes=False")
    return inst.ranks


def block_spans(inst: PoolInstance, layer: str, block_id: int) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` of ``layer``'s block ``block_id`` in rank 0's cache memory (GDN
    state tensors, or attention K and V): layers of different groups share memory (vLLM <= 0.29: one
    page per shared tensor; vLLM 0.30: every group overlaid on one allocation), compare these."""
    cache = _ranks_here(inst, "block_spans")[0].kv_caches[layer]
    spans = []
    for tensor in list.__iter__(cache) if isinstance(cache, list) else cache:
        block = tensor[block_id]
        spans.append((block.data_ptr(), block.data_ptr() + block.numel() * block.element_size()))
    return spans


def overlaps(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)


class InFlightWrites:
    """Stands in for a device that is still running a step: the cache writes of the batch executed
    after :meth:`hold_next` (every rank) are held back. They land at the next executed batch's first
    layer compute (stream order: that step's compute runs after them, its ungated layer loads need
    not), or when the held batch's output is processed (``update_from_output``: the device finished
    it), whichever comes first. ``landed`` lists ``(layer name, block id)`` of each write as it lands."""

    def __init__(self, inst: PoolInstance):
        self.inst, self.armed, self.capturing, self.batch = inst, False, False, None
        self.pending: list[tuple] = []
        self.landed: list[tuple[str, int]] = []
        self._layer = None
        execute, update = inst._execute, inst.scheduler.update_from_output

        def _execute(so):
            if not self.armed:
                return execute(so)
            self.armed, self.capturing, self.batch = False, True, so
            try:
                return execute(so)
            finally:
                self.capturing = False

        def update_from_output(so, output):
            if so is self.batch:
                self.land()
            return update(so, output)

        inst._execute, inst.scheduler.update_from_output = _execute, update_from_output
        for rank in _ranks_here(inst, "InFlightWrites"):
            self._wrap(rank)

    def _wrap(self, rank: _Rank) -> None:
        gdn, attention = rank.gdn_compute, rank.attention

        def write(tensors, block_id, value):
            if self.capturing:
                self.pending.append((self._layer, tensors, block_id, value))
            else:
                _Rank._write_block(tensors, block_id, value)

        def gdn_compute(name):
            self._enter(name)
            return gdn(name)

        def attn(query, layer_name):
            self._enter(layer_name)
            return attention(query, layer_name)

        rank._write_block, rank.gdn_compute, rank.attention = write, gdn_compute, attn

    def _enter(self, layer: str) -> None:
        self._layer = layer
        if not self.capturing and self.pending:
            self.land()

    def hold_next(self) -> None:
        self.armed = True

    def land(self) -> None:
        for layer, tensors, block_id, value in self.pending:
            _Rank._write_block(tensors, block_id, value)
            self.landed.append((layer, block_id))
        self.pending.clear()


class DelayedUploads:
    """Stands in for the device's non-blocking upload of a rank's pinned pre-copy rows
    (``CpuGpuBuffer.copy_to_gpu`` on ``src_ptrs`` / ``dst_ptrs`` / ``sizes``): the harness copies at
    once (its forward needs the rows), but the read the device would do is deferred until an event
    recorded after it is synchronized (:meth:`event` stands in for ``torch.npu.Event``), or -- the
    device running a step behind -- until the rank uploads the same buffer again (its next step).
    ``wrong_rows`` counts the rows such a late read finds rewritten (the device would copy them)."""

    def __init__(self, inst: PoolInstance, rank: int = 0):
        self.pending: list[tuple] = []  # (upload number, buffer, rows as uploaded)
        self.uploads = self.wrong_rows = self.rows = 0
        bufs = _ranks_here(inst, "DelayedUploads")[rank].mamba_bufs.preprocess
        for buf in (bufs.src_ptrs, bufs.dst_ptrs, bufs.sizes):
            self._wrap(buf)

    def _wrap(self, buf) -> None:
        upload = buf.copy_to_gpu

        def copy_to_gpu(n=None):
            if any(b is buf for _, b, _ in self.pending):  # the next step's upload: the last one ran
                self.execute()
            self.uploads += 1
            self.pending.append((self.uploads, buf, buf.np[: len(buf.np) if n is None else n].copy()))
            return upload(n)

        buf.copy_to_gpu = copy_to_gpu

    def execute(self, upto: int | None = None) -> None:
        """The device reads the pending uploads (those numbered up to ``upto``, or all)."""
        keep = []
        for number, buf, rows in self.pending:
            if upto is not None and number > upto:
                keep.append((number, buf, rows))
                continue
            self.rows += len(rows)
            self.wrong_rows += int((buf.np[: len(rows)] != rows).sum())
        self.pending = keep

    def event(self, *args, **kwargs):
        """A ``torch.npu.Event`` stand-in: ``synchronize`` completes the uploads before its ``record``."""
        owner = self

        class _Event:
            mark = None

            def record(self, *a):
                self.mark = owner.uploads

            def synchronize(self):
                if self.mark is not None:
                    owner.execute(upto=self.mark)

        return _Event()
