"""The real MemCache (``memcache_hybrid`` from PyPI) on a CPU machine: what stands in for the Ascend
hardware, built from source here, and one MetaService per test process.

MemCache is three pieces: a MetaService (keys, leases, eviction), one LocalService client per
process (``DistributedObjectStore``: its share of the pool is a ``/dev/shm`` file every client maps,
transport ``host_shm``) and memfabric (``memfabric_hybrid``), which reaches the device through
CANN. Only the hardware is stood in:

- **CANN** (``cann_stub.c``): memfabric ``dlopen`` s ``libascendcl.so`` and a few other runtime
  libraries under ``$ASCEND_HOME_PATH/lib64``. One small C library answers every symbol it looks up:
  a device id maps to itself, ``aclrtMalloc`` is ``posix_memalign``, ``aclrtMemcpy`` is ``memmove``
  (so MemCache's copies are real byte copies), everything else succeeds and does nothing.
- **The driver version file** (``path_shim.c``, ``LD_PRELOAD``): memfabric refuses to start unless it
  reads an Ascend driver version via ``/etc/ascend_install.info``. The shim redirects that one path
  to a file here. It also redirects the MetaService's process lock (``/tmp/mmc_meta_service.lock``)
  to a path per MetaService, so that parallel test processes each run their own. Nothing on the
  host is written outside ``work_dir()``.
- **Device memory**: the directions vllm-ascend's backend uses (save ``L2G``, load ``G2L``) are
  accepted only for addresses in memfabric's device window ``[DEVICE_VA_START, DEVICE_VA_END)``.
  :func:`device_buffer` maps host memory there; the harness puts every rank's KV cache in it.

The shim must be loaded when the process starts (``LD_PRELOAD``): :func:`client_env` is the
environment of the processes that run MemCache (the MetaService and the agents, ``agent.py``);
the harness's own processes never open a client.

Everything is built into ``work_dir()`` (``$ALP_MEMCACHE_DIR``, default ``$TMPDIR/alp-memcache``)
by :func:`build` (gcc); nothing built is committed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: memfabric's window of local device addresses (hybm): [16 TiB, 24 TiB)
DEVICE_VA_START = 0x100000000000
DEVICE_VA_END = 0x180000000000
#: the libraries memfabric and MemCache open from $ASCEND_HOME_PATH/lib64 (all the same stub)
CANN_LIBS = ("libascendcl.so", "libascend_hal.so", "libruntime.so", "libra.so", "libhccl.so", "libhcomm.so",
             "libdcmi.so", "libnnopbase.so", "libopapi.so", "libtsdclient.so")
#: a driver version memfabric accepts (it needs at least V100R001C18B100)
DRIVER_VERSION = "Version=25.2.0\nInnerversion=V100R001C23SPC005B219\n"
#: seconds a client's init waits to join memfabric's group before it fails, per start attempt
#: (``Cluster.START_TRIES``): a lost join is given up fast; a join that is only slow (8 rank
#: processes importing vLLM on 2 cores) gets longer on each try
JOIN_TIMEOUT_S = (5, 15, 40)
#: the MetaService answers on these offsets from its base port: meta, config store, metrics
PORT_OFFSETS = {"meta": 0, "config_store": 1000, "metrics": 3000}


def work_dir() -> Path:
    d = os.environ.get("ALP_MEMCACHE_DIR") or os.path.join(tempfile.gettempdir(), "alp-memcache")
    return Path(d)


def version() -> str | None:
    """The installed ``memcache-hybrid`` version, or None."""
    from importlib import metadata

    try:
        return metadata.version("memcache-hybrid")
    except metadata.PackageNotFoundError:
        return None


def shows_writing() -> bool:
    """Whether the installed MemCache shows a key still being written to ``batch_is_exist`` and
    ``batch_get_key_info`` (1.2.x; its read lease then fails). 1.3.0 does not."""
    return (version() or "").startswith("1.2.")


def _compile(name: str, extra: list[str]) -> Path:
    src = HERE / f"{name}.c"
    digest = hashlib.sha1(src.read_bytes()).hexdigest()[:12]
    out = work_dir() / "lib" / f"{name}-{digest}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src), *extra], check=True, capture_output=True, text=True)
        except FileNotFoundError as exc:
            raise RuntimeError("building MemCache's hardware stand-ins needs gcc on PATH") from exc
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"gcc failed on {src.name}:\n{exc.stderr}") from exc
        os.replace(tmp, out)
    return out


def build() -> dict[str, str]:
    """Build the stand-ins (once per source version); the paths :func:`client_env` needs."""
    root = work_dir()
    cann = _compile("cann_stub", [])
    shim = _compile("path_shim", ["-ldl"])
    home = root / "ascend"
    (home / "lib64").mkdir(parents=True, exist_ok=True)
    (home / "driver").mkdir(parents=True, exist_ok=True)
    blob = cann.read_bytes()
    for name in CANN_LIBS:  # real files, not links: memfabric resolves the path it loads
        target = home / "lib64" / name
        if not target.exists() or target.read_bytes() != blob:
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(blob)
            os.replace(tmp, target)
    (home / "driver" / "version.info").write_text(DRIVER_VERSION)
    info = home / "ascend_install.info"
    info.write_text(f"Driver_Install_Path_Param={home}\n")
    return {"home": str(home), "shim": str(shim), "install_info": str(info)}


def client_env(base: dict | None = None, join_timeout_s: int = JOIN_TIMEOUT_S[0]) -> dict[str, str]:
    """The environment of a process that runs a MemCache client (built first if need be)."""
    paths = build()
    env = dict(os.environ if base is None else base)
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "path_shim" not in p]
    libs = [os.path.join(paths["home"], "lib64"), *(p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p)]
    env.setdefault("MF_GROUP_JOIN_MAX_TIMEOUT", str(join_timeout_s))
    env.update(
        ASCEND_HOME_PATH=paths["home"],
        LD_LIBRARY_PATH=":".join(dict.fromkeys(libs)),
        ALP_ASCEND_INSTALL_INFO=paths["install_info"],
        LD_PRELOAD=":".join([paths["shim"], *preload]),
    )
    return env


def shim_loaded() -> bool:
    """Whether this process started with the path shim (a client can start here)."""
    return "path_shim" in os.environ.get("LD_PRELOAD", "") and bool(os.environ.get("ALP_ASCEND_INSTALL_INFO"))


def _free_base_port() -> int:
    """A base port whose three MetaService ports are free now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + max(PORT_OFFSETS.values()) >= 65000:
            continue
        try:
            for off in PORT_OFFSETS.values():
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports for a MetaService")


#: the MetaService's main, stopped (SIGINT: it ignores SIGTERM) once the process that started it is
#: gone -- a pytest-xdist worker ends without running atexit handlers
_META_MAIN = """
import os, signal, sys, threading, time
parent = int(sys.argv[1])
def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
    os._exit(0)
threading.Thread(target=watch, daemon=True).start()
from memcache_hybrid import MetaService
sys.exit(MetaService.main())
"""


class MetaService:
    """One MemCache MetaService process on loopback, with its own ports, lock and logs; the local
    config file its clients read (``MMC_LOCAL_CONFIG_PATH``). Stop it with :meth:`stop`."""

    START_LIMIT_S = 30.0

    def __init__(self, dram: str = "64MB", world_size: int = 64, log_level: str = "error", evict_high: int | None = None, evict_low: int | None = None, lease_ttl_ms: int | None = None):
        """``lease_ttl_ms``: the lease MemCache gives an allocation or a read lease asked for with
        ttl 0 (vllm-ascend's backend asks so); MemCache's default is about 10 s."""
        self.dir = Path(tempfile.mkdtemp(prefix="meta-", dir=_ensure(work_dir() / "run")))
        self.port = _free_base_port()
        url = lambda kind, scheme="tcp": f"{scheme}://127.0.0.1:{self.port + PORT_OFFSETS[kind]}"  # noqa: E731
        logs = _ensure(self.dir / "logs")
        meta_conf = [
            f"ock.mmc.meta_service_url = {url('meta')}",
            f"ock.mmc.meta_service.config_store_url = {url('config_store')}",
            f"ock.mmc.meta_service.metrics_url = {url('metrics', 'http')}",
            f"ock.mmc.log_level = {log_level}",
            "ock.mmc.log_output_target = file",
            f"ock.mmc.log_path = {logs}",
        ]
        if evict_high is not None:
            meta_conf.append(f"ock.mmc.evict_threshold_high = {evict_high}")
        if evict_low is not None:
            meta_conf.append(f"ock.mmc.evict_threshold_low = {evict_low}")
        if lease_ttl_ms is not None:
            meta_conf.append(f"ock.mmc.meta.lease_ttl_ms = {lease_ttl_ms}")
        (self.dir / "meta.conf").write_text("\n".join(meta_conf) + "\n")
        self.local_config = self.dir / "local.conf"
        self.local_config.write_text(
            "\n".join(
                [
                    f"ock.mmc.meta_service_url = {url('meta')}",
                    f"ock.mmc.local_service.config_store_url = {url('config_store')}",
                    f"ock.mmc.log_level = {log_level}",
                    f"ock.mmc.local_service.world_size = {world_size}",
                    "ock.mmc.local_service.protocol = host_shm",
                    f"ock.mmc.local_service.dram.size = {dram}",
                    "ock.mmc.local_service.hbm.size = 0",
                ]
            )
            + "\n"
        )
        env = client_env()
        env.update(MMC_META_CONFIG_PATH=str(self.dir / "meta.conf"), ALP_MMC_META_LOCK=str(self.dir / "meta.lock"))
        env.update(self.environ())
        self.log = open(self.dir / "meta_service.out", "w")
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _META_MAIN, str(os.getpid())],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir,
        )
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"MemCache MetaService exited ({self.proc.returncode}); see {self.log.name}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if time.monotonic() - started > self.START_LIMIT_S:
                    self.stop()
                    raise RuntimeError(f"MemCache MetaService did not listen on {self.port} within {self.START_LIMIT_S} s")
                time.sleep(0.05)
        self.start_s = time.monotonic() - started

    def environ(self) -> dict[str, str]:
        """What a client process needs on top of :func:`client_env`."""
        return {"MMC_LOCAL_CONFIG_PATH": str(self.local_config), "ALP_MMC_SHM_NS": f"{self.port}"}

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port + PORT_OFFSETS['metrics']}/metrics/summary", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> None:
        """SIGINT (the MetaService ignores SIGTERM), then SIGKILL after 10 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self.log.close()


def _ensure(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_RW, _MAP_SHARED, _MAP_FIXED_NOREPLACE = 3, 0x01, 0x100000
_next_slot = [0]


class _Mapping:
    """One shared mapping in the device window: its memfd stays open while it is mapped, so that a
    MemCache agent can map the same memory (``/proc/<pid>/fd/<fd>``) at the same address."""

    def __init__(self, addr: int, size: int, fd: int):
        self.addr, self.size, self.fd = addr, size, fd
        _BUFFERS[addr] = self
        # bound now: at interpreter exit this module's globals may be gone before the mapping is
        self._forget, self._munmap, self._close = _BUFFERS.pop, _libc.munmap, os.close

    def __del__(self):
        self._forget(self.addr, None)
        self._munmap(self.addr, self.size)
        self._close(self.fd)


#: this process's device buffers, by start address
_BUFFERS: dict[int, _Mapping] = {}


def buffer_of(addr: int, size: int) -> tuple[str, int, int]:
    """(path another process opens to map it, start, size) of the device buffer holding
    ``[addr, addr + size)`` in this process."""
    for m in list(_BUFFERS.values()):
        if m.addr <= addr and addr + size <= m.addr + m.size:
            return f"/proc/{os.getpid()}/fd/{m.fd}", m.addr, m.size
    raise ValueError(f"{addr:#x}+{size} is not in a device buffer of this process")


def device_buffer(size: int):
    """``size`` bytes of zeroed shared memory mapped inside memfabric's device window, as a uint8
    tensor (unmapped once the last tensor on it is gone). Each process takes its own 32 GiB slice of
    the window (by pid), and the buffers of one process follow each other in it."""
    import numpy as np
    import torch

    page = 1 << 21
    size = (int(size) + page - 1) // page * page
    span = 1 << 35
    base = DEVICE_VA_START + (os.getpid() % ((DEVICE_VA_END - DEVICE_VA_START) // span)) * span
    fd = os.memfd_create("alp-kv-cache")
    os.ftruncate(fd, size)
    for _ in range(64):
        want = base + _next_slot[0]
        _next_slot[0] += size + page
        if _next_slot[0] > span - (1 << 30):  # wrap (the top GiB is an agent's scratch)
            _next_slot[0] = 0
            continue
        got = _libc.mmap(want, size, _PROT_RW, _MAP_SHARED | _MAP_FIXED_NOREPLACE, fd, 0)
        if got == want:
            array = (ctypes.c_uint8 * size).from_address(got)
            array.mapping = _Mapping(got, size, fd)
            return torch.from_numpy(np.ctypeslib.as_array(array))
        if got not in (None, ctypes.c_void_p(-1).value):
            _libc.munmap(got, size)
    os.close(fd)
    raise OSError(ctypes.get_errno(), "could not map a buffer in the device window")


def _tail(path: str, lines: int = 12) -> str:
    """The last lines of an agent's log, for an error that may be read only in a CI log."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "".join(f"\n  | {line}" for line in text)


class AgentError(RuntimeError):
    """A MemCache agent failed a call (its traceback is the message) or did not answer."""


class AgentHung(AgentError):
    """A MemCache agent's client init did not return within ``Cluster.START_LIMIT_S``."""


class AgentHandle:
    """The parent's handle on one agent: calls go over one connection per calling thread."""

    REPLY_LIMIT_S = 90.0

    def __init__(self, proc, address: str, owner: int):
        self.proc, self.address, self.owner = proc, address, owner
        self._local = threading.local()
        self.mapped: set[int] = set()  # start addresses of the owner's buffers mapped in the agent
        self.hello = self._ask(("hello",))

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            from multiprocessing.connection import Client

            conn = self._local.conn = Client(self.address, family="AF_UNIX")
        return conn

    def _ask(self, msg):
        conn = self._conn()
        conn.send(msg)
        if not conn.poll(self.REPLY_LIMIT_S):
            raise AgentError(f"MemCache agent of process {self.owner} did not answer {msg[:2]} within {self.REPLY_LIMIT_S} s")
        kind, value = conn.recv()
        if kind != "ok":
            raise AgentError(f"MemCache agent of process {self.owner}, {msg[:2]}:\n{value}")
        return value

    def call(self, name: str, *args):
        return self._ask(("call", name, args))

    def map(self, path: str, addr: int, size: int) -> None:
        if addr not in self.mapped:
            self._ask(("map", path, addr, size))
            self.mapped.add(addr)

    def read(self, key: str, size: int):
        return self._ask(("read", key, size))

    def unmap_all(self) -> None:
        self._ask(("unmap_all",))
        self.mapped.clear()

    def close(self, wait: bool = True) -> None:
        """Tell the agent to close its client (it takes seconds: MemCache's close); ``wait``: until it has."""
        try:
            self._ask(("close",))
        except (AgentError, OSError, EOFError):
            pass
        if wait:
            self.wait()

    def wait(self) -> None:
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Cluster:
    """A MetaService and the agents (MemCache clients) of the harness processes that use it.

    An agent serves one harness process at a time. When that process ends (:meth:`release`), its
    agent forgets the process's buffers and waits for the next process: its client, and the objects
    in its share of the pool, live on (as a MemCache local service that outlives one engine would;
    the writer dying with its share is :meth:`drop`)."""

    #: an agent's start beyond its join timeout: its client's init (1.2.0 imports torch: seconds on 2 busy cores)
    START_LIMIT_S = 30.0
    #: A client's init joins memfabric's group (``smem_bm_join``). On 2 busy cores about one join in
    #: five never completes: no member sees the newcomer's join event, and the join waits out its
    #: timeout, 900 s by default (both versions; seen far more with 1.2.0's slower start). With
    #: ``MF_GROUP_JOIN_MAX_TIMEOUT`` (:data:`JOIN_TIMEOUT_S`) the init gives up, cleans up and
    #: returns -1, and a new agent then joins (every retry did in 15 starts, 5 lost joins, two busy
    #: loops); an agent killed mid-join instead left its rank stuck for the next one. Each try waits
    #: longer, which helps a slow join only: a stalled one (CI: all three tries, 5 to 40 s) is not
    #: helped, and its cause is not known.
    START_TRIES = len(JOIN_TIMEOUT_S)

    def __init__(self, prestart: int = 0, **meta_options):
        """``prestart``: agents started now, idle until a process takes one."""
        self.meta = MetaService(**meta_options)
        self.agents: dict[int, AgentHandle] = {}
        self.idle: list[AgentHandle] = []
        self.lock = threading.Lock()
        self.device_ids = iter(range(1 << 30))
        self.agent_start_s: list[float] = []
        self.start_retries: list[str] = []  # why an agent was started again (START_TRIES)
        self.idle = [self._start(-1 - i) for i in range(prestart)]

    def agent(self, pid: int) -> AgentHandle:
        """The agent of harness process ``pid`` (started on first use). Agents start one at a time;
        between two start attempts of one the lock is let go, so the starts waiting behind it go
        first (seen in CI: one newcomer's join failed three times in a row, and the agents started
        right after it joined at once)."""
        for attempt in range(1, self.START_TRIES + 1):
            with self.lock:
                handle = self.agents.get(pid)
                if handle is not None:
                    return handle
                if self.idle:
                    handle = self.idle.pop()
                else:
                    try:
                        handle = self._start_once(pid, JOIN_TIMEOUT_S[attempt - 1])
                    except AgentError as exc:  # init returned non-zero (a lost join) or never returned
                        self.start_retries.append(str(exc))
                        if attempt == self.START_TRIES:
                            raise
                        print(f"memcache_host: {str(exc).splitlines()[0]}; starting it again (attempt {attempt + 1} of "
                              f"{self.START_TRIES}, after the starts waiting behind it)", file=sys.stderr)
                        handle = None
                if handle is not None:
                    handle.owner = pid
                    self.agents[pid] = handle
                    return handle
            time.sleep(0.2)  # outside the lock: a waiting start takes it first
        raise AssertionError("unreachable")

    def _start(self, owner: int) -> AgentHandle:
        for attempt in range(1, self.START_TRIES + 1):
            try:
                return self._start_once(owner, JOIN_TIMEOUT_S[attempt - 1])
            except AgentError as exc:  # init returned non-zero (a lost join) or never returned
                self.start_retries.append(str(exc))
                if attempt == self.START_TRIES:
                    raise
                print(f"memcache_host: {str(exc).splitlines()[0]}; starting it again (attempt {attempt + 1} of {self.START_TRIES})", file=sys.stderr)
        raise AssertionError("unreachable")

    def _start_once(self, owner: int, join_timeout_s: int) -> AgentHandle:
        started = time.monotonic()
        address = str(self.meta.dir / f"agent-{owner}-{next(self.device_ids)}.sock")
        env = client_env(join_timeout_s=join_timeout_s)
        env.update(self.meta.environ())
        log = open(self.meta.dir / f"agent-{owner}.out", "a")  # MemCache logs to stdout
        ready_r, ready_w = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "agent.py"), address, str(os.getpid()), "0", str(ready_w)],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.meta.dir, pass_fds=(ready_w,),
        )
        os.close(ready_w)
        import select

        with os.fdopen(ready_r) as ready:  # "ready <init rc>" once it listens; "" if it died first
            limit = self.START_LIMIT_S + join_timeout_s
            line = ready.readline() if select.select([ready], [], [], limit)[0] else "(no answer)"
        log.close()
        if not line.startswith("ready"):
            proc.kill()
            raise (AgentHung if line == "(no answer)" else AgentError)(
                f"MemCache agent for process {owner} did not start within {limit:.0f} s "
                f"(exit {proc.wait()}; its client's init: see {log.name}){_tail(log.name)}"
            )
        if line.split()[-1] != "0":
            proc.kill()
            raise AgentError(
                f"MemCache client init returned {line.split()[-1]} (join timeout {join_timeout_s} s; "
                f"see {log.name}){_tail(log.name)}"
            )
        handle = AgentHandle(proc, address, owner)
        self.agent_start_s.append(time.monotonic() - started)
        return handle

    def release(self, pid: int) -> None:
        """The harness process ``pid`` ended: its agent is free for another process."""
        with self.lock:
            handle = self.agents.pop(pid, None)
        if handle is not None:
            handle.unmap_all()
            with self.lock:
                self.idle.append(handle)

    def drop(self, pid: int) -> None:
        """The harness process ``pid`` ended: its agent (its client, and the objects in its share) goes too."""
        with self.lock:
            handle = self.agents.pop(pid, None)
        if handle is not None:
            handle.close()

    def close(self) -> None:
        """Every agent closes its client (at once: each takes seconds), then the MetaService stops."""
        with self.lock:
            handles = [*self.agents.values(), *self.idle]
            self.agents, self.idle = {}, []
        for handle in handles:
            handle.close(wait=False)
        for handle in handles:
            handle.wait()
        self.meta.stop()
        for left in Path("/dev/shm").glob(f"memfabric_hybrid_{self.meta.port}_*"):  # a client that died uncleanly
            left.unlink(missing_ok=True)
