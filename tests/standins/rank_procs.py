"""The pool harness's TP ranks as processes, as vLLM's ``MultiprocExecutor`` runs them.

``PoolInstance(processes=True)`` forks one process per TP rank once its configs, KV cache specs and
scheduler are built (the engine core stays in the test's process, as vLLM's does). Each rank
process then:

- joins a real ``torch.distributed`` gloo group of the instance's TP size, and installs it as
  vLLM's TP group (``parallel_state._TP``: ``get_tp_group()``, its ``cpu_group``, ranks and world
  size answer as on an NPU worker);
- builds its own ``_Rank``: caches, the AscendStore worker half and the layer threads it starts,
  its own module state (``pool_events``, marks on module globals, caches are per process, as in
  production);
- talks to the shared pool through ``byte_store_remote.PoolServer`` (MemCache is a service every worker
  process reaches; copies read and write the rank's own memory when they run);
- executes each step's ``SchedulerOutput`` and answers with its ``ModelRunnerOutput`` and what its
  layers read; its layers' outputs are summed over the group (:meth:`_Rank._all_reduce`).

Every wait is bounded: the parent waits ``REPLY_LIMIT_S`` for the ranks of a call and fails with
the ranks that did not come back (and the tracebacks of those that raised); a rank blocked in a
collective another rank never entered raises after ``COLLECTIVE_TIMEOUT_S`` (gloo's timeout).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import byte_store
import byte_store_remote

COLLECTIVE_TIMEOUT_S = 15.0
START_LIMIT_S = 240.0  # a rank's start: its worker half, caches, threads and its MemCache agent (2 cores, 8 ranks)
#: a step's answer from every rank; above the collective timeout, so a rank stuck in a collective
#: shows as the error it raises rather than as a missing answer
REPLY_LIMIT_S = 60.0

#: set in a rank process (for the harness's own self-test: module state is per process)
MARK: str | None = None
#: the records of vLLM's logger (and its children: the library logs as ``vllm.ascend_layerwise_patch``)
#: this rank process logged, as plain dicts (see :func:`log_records`)
RECORDS: list[dict] = []


class RankFailure(AssertionError):
    """One or more rank processes raised or did not answer in time."""


#: every instance's rank processes not closed yet (the standins conftest closes them after each test:
#: a test that fails before its instance's close must not leave TP ranks running, or a suite's
#: failed tests pile up processes until the machine runs out of memory)
LIVE: list[RankProcesses] = []


def close_all() -> int:
    """Close every instance's rank processes still open; how many instances that was."""
    left = list(LIVE)
    for procs in left:
        procs.close()
    return len(left)


class RankProcesses:
    """The parent's handle on one instance's rank processes."""

    def __init__(self, inst, make_rank):
        self.tp = inst.tp
        self.name = inst.name
        self.server = byte_store_remote.PoolServer(inst.pool) if inst.pool is not None else None
        address = self.server.address if self.server is not None else None
        fd, self.init_file = tempfile.mkstemp(prefix="alp-gloo-")
        os.close(fd)
        os.unlink(self.init_file)  # gloo's FileStore creates it
        ctx = multiprocessing.get_context("fork")
        self.conns, self.procs = [], []
        self.closed = False
        self.reply_limit = REPLY_LIMIT_S  # a test may shorten it
        LIVE.append(self)
        for r in range(self.tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main, args=(inst, r, child, address, self.init_file, make_rank), name=f"{inst.name}-rank{r}", daemon=True
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._collect(range(self.tp), START_LIMIT_S, "start")

    # ------------------------------------------------------------------ calls
    def execute(self, so, step: int, inst) -> list:
        """Every rank executes ``so`` (each deserializes its own copy, as a worker does)."""
        for conn in self.conns:
            conn.send(("execute", so, step))
        replies = self._collect(range(self.tp), self.reply_limit, f"step {step}")
        outputs = []
        for output, reads, null_writes, drafts in replies:
            inst.reads.extend(reads)
            inst.null_writes.extend(null_writes)
            inst.drafts.extend(drafts)
            outputs.append(output)
        tokens = [o.sampled_token_ids for o in outputs]
        if any(t != tokens[0] for t in tokens):  # TP ranks sample from one all-reduced hidden state
            raise RankFailure(f"instance {self.name}: ranks sampled different tokens at step {step}: {tokens}")
        return outputs

    def call(self, fn, *args, ranks=None) -> list:
        """``fn(rank, *args)`` in each rank process (``fn``: a module-level function); the results."""
        ranks = list(range(self.tp)) if ranks is None else list(ranks)
        for r in ranks:
            self.conns[r].send(("call", fn, args))
        return self._collect(ranks, self.reply_limit, getattr(fn, "__name__", "call"))

    def _collect(self, ranks, limit: float, what: str) -> list:
        deadline = time.monotonic() + limit
        replies, errors, missing = {}, {}, []
        for r in ranks:
            conn = self.conns[r]
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                missing.append(r)
                continue
            try:
                kind, payload = conn.recv()
            except EOFError:
                errors[r] = f"rank {r}'s process ended (exit code {self.procs[r].exitcode})"
                continue
            if kind == "ok":
                replies[r] = payload
            else:
                errors[r] = payload
        if errors or missing:
            lines = [f"instance {self.name}, {what}: TP ranks {sorted(errors) + missing} failed"]
            if missing:
                lines.append(f"ranks {missing} did not come back within {limit:.0f} s")
                stacks = self._stacks(missing)
            answered = [r for r in ranks if r in replies]
            if answered:
                lines.append(f"ranks {answered} answered")
            for r, text in sorted(errors.items()):
                lines.append(f"--- rank {r} raised:\n{text}")
            for r, text in (stacks if missing else {}).items():
                lines.append(f"--- rank {r} is at:\n{text}")
            self.close()
            raise RankFailure("\n".join(lines))
        return [replies[r] for r in ranks]

    def _stacks(self, ranks) -> dict[int, str]:
        """Where each of ``ranks`` is (its threads' Python stacks), as far as it can tell."""
        for r in ranks:
            try:
                os.kill(self.procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(0.5)
        out = {}
        for r in ranks:
            try:
                with open(_stack_file(self.init_file, r)) as f:
                    out[r] = f.read().strip() or "(no stack: it did not reach the rank's main loop)"
            except OSError:
                out[r] = "(no stack: it did not reach the rank's main loop)"
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self in LIVE:
            LIVE.remove(self)
        for conn in self.conns:
            try:
                conn.send(("close",))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self.conns:
            conn.close()
        if self.server is not None:
            drop = getattr(self.server.service, "drop_process", None)
            for proc in self.procs:  # the real MemCache: each rank's client (agent) is free for another process
                if drop is not None and proc.pid is not None:
                    drop(proc.pid)
            self.server.close()
        for path in [self.init_file] + [_stack_file(self.init_file, r) for r in range(self.tp)]:
            try:
                os.unlink(path)
            except OSError:
                pass


# ---------------------------------------------------------------------- in the rank process
def _stack_file(init_file: str, rank: int) -> str:
    return f"{init_file}.rank{rank}.stack"


def _tp_group(rank: int, tp: int, init_file: str, config):
    """A gloo process group of ``tp`` ranks, installed as vLLM's TP group; its CPU group."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state as ps

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    from vllm.config import set_current_vllm_config

    # the class vLLM's initialize_model_parallel builds its TP group with (vllm-ascend's worker patch
    # replaces it: its HCCL options read the current config), on gloo for the device group too
    # its groups get the bounded timeout too (new_group's default is 30 minutes)
    from torch.distributed import distributed_c10d as c10d

    default_timeout = c10d._get_default_timeout
    c10d._get_default_timeout = lambda backend: timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    try:
        with set_current_vllm_config(config):
            ps._TP = ps.GroupCoordinator(
                group_ranks=[list(range(tp))], local_rank=rank, torch_distributed_backend="gloo", use_device_communicator=False, group_name="tp"
            )
    finally:
        c10d._get_default_timeout = default_timeout
    return ps._TP.cpu_group


def _fresh_std_streams() -> None:
    """New ``sys.stdout`` / ``sys.stderr`` objects over the same descriptors, and a new stream for
    every logging handler (``logging._handlerList`` holds them all, those wrapped inside another
    handler too): a thread of the engine's process may have been inside a write to one of them when
    this process was forked, and a buffered stream's internal lock is not reset by fork (a rank
    then hangs at its first log line)."""
    import logging
    import sys

    def fresh(fd: int):
        return open(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace", closefd=True)

    swap = {}
    for name, fd in (("stdout", 1), ("stderr", 2)):
        new = fresh(fd)
        for old in (getattr(sys, name), getattr(sys, f"__{name}__")):
            swap[id(old)] = new
        setattr(sys, name, new)
    for ref in list(getattr(logging, "_handlerList", [])):
        handler = ref()
        stream = getattr(handler, "stream", None)
        if stream is None:
            continue
        if id(stream) not in swap:
            try:
                fd = stream.fileno()
            except Exception:  # no descriptor of its own (an in-memory capture): the process's stderr
                fd = 2
            swap[id(stream)] = fresh(fd)
        handler.stream = swap[id(stream)]  # not setStream: it would flush the old stream


def _die_with_parent() -> None:
    """Linux: this rank process is killed when the process that forked it dies (a test process
    killed mid-test must not leave its TP ranks running)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_main(inst, r: int, conn, address, init_file: str, make_rank) -> None:
    try:
        _die_with_parent()
        _fresh_std_streams()
        # the engine's process may have run OpenMP regions (torch's intra-op pool): a forked child's
        # first parallel region would wait for the parent's pool threads forever (as DataLoader
        # workers, one thread per rank process)
        import torch

        torch.set_num_threads(1)
        # where this rank is, on the parent's request (SIGUSR1), when it does not answer in time
        faulthandler.register(signal.SIGUSR1, file=open(_stack_file(init_file, r), "w"), all_threads=True)
        if address is not None:  # this process reaches the pool as a MemCache client does
            inst.pool = byte_store_remote.RemoteService(address, real=getattr(inst.pool, "real", False))
            byte_store.install(inst.pool)
        _capture_log(r)
        group = _tp_group(r, inst.tp, init_file, inst.configs[r])
        rank = make_rank(inst, r)
        rank.group = group
        inst.procs, inst.ranks, inst._current_rank = None, [rank], rank
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "close":
            return
        try:
            if msg[0] == "execute":
                so, inst.steps = msg[1], msg[2]
                inst.reads, inst.null_writes, inst.drafts = [], [], []
                output = rank.execute(so)
                rank.accept(output)
                reply = (output, inst.reads, inst.null_writes, inst.drafts)
            else:
                fn, args = msg[1], msg[2]
                reply = fn(rank, *args)
            conn.send(("ok", reply))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def _capture_log(r: int) -> None:
    """Keep every record vLLM's logger gets in this rank process (WARNING and above): the worker
    halves' warnings, which a test reads through :func:`log_records` as it reads the engine's own."""
    import logging

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            RECORDS.append({"name": record.name, "levelname": record.levelname, "levelno": record.levelno,
                            "msg": record.getMessage(), "rank": r})

    logging.getLogger("vllm").addHandler(_Keep(logging.WARNING))


# ------------------------------------------------------------------ functions to call in ranks
def log_records(rank) -> list[dict]:
    """What :func:`_capture_log` kept in this rank process so far."""
    return list(RECORDS)


def set_mark(rank, value: str) -> int:
    global MARK
    MARK = value
    return os.getpid()


def get_mark(rank) -> tuple[str | None, int]:
    return MARK, os.getpid()


def tp_group_view(rank) -> dict:
    """What vLLM's TP group answers in this process."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size, get_tp_group

    group = get_tp_group()
    return dict(
        rank=get_tensor_model_parallel_rank(),
        world=get_tensor_model_parallel_world_size(),
        cpu_group_size=group.cpu_group.size(),
        pid=os.getpid(),
    )
