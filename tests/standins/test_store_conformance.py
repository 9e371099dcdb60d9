"""The byte store behaves as MemCache does where the library can tell: the same operations, by
three clients (A, B writers, C a reader), on the real MemCache of this pair's venv (one agent per
client) and on ``byte_store.PoolService``; every observable result compared.

What is compared is what vllm-ascend's MemCache path acts on: whether an allocation got an address
(and whether two got the same one), a copy's or finish's success, ``exists``, a key info's size, a
lease's success, and which writer's bytes a reader gets. Error codes are compared as "not 0" (the
backend logs them, and acts only on 0 / not 0).
"""

from __future__ import annotations

import pytest

import memcache_host

if memcache_host.version() is None:
    pytest.skip("memcache-hybrid is not installed in this venv", allow_module_level=True)

import numpy as np  # noqa: E402

from byte_store import G2L, L2G, LocalHost, PoolService  # noqa: E402

OBJ = 1 << 16

pytestmark = [
    pytest.mark.pairs("v0251", "v0260", "v0300"),
    pytest.mark.control("the stores' behaviour, not the library's: the same with and without it"),
]


class _Client(LocalHost):
    """One MemCache client of the scenario: on the real store its own agent (keyed by ``pid``)."""

    def __init__(self, regions, pid: int):
        super().__init__(regions)
        self.pid = pid


class _Run:
    """Drives one pool with clients A, B, C over one buffer of this process (one slot per copy)."""

    def __init__(self, pool, buffer, fake_pids):
        self.pool, self.buf = pool, buffer
        base = buffer.data_ptr()
        self.slots = iter(range(buffer.numel() // OBJ))
        self.clients = {name: _Client([(base, buffer.numel())], pid) for name, pid in zip("ABC", fake_pids)}
        if hasattr(pool, "cluster"):  # the real store: each client's agent maps the buffer
            for c in self.clients.values():
                pool.register_region((memcache_host.buffer_of(base, buffer.numel())), buffer.numel(), host=c)
        else:
            pool.register_region(base, buffer.numel())

    def _slot(self) -> int:
        return next(self.slots) * OBJ

    def alloc(self, who, key):
        return self.pool.batch_alloc([key], [OBJ], host=self.clients[who])[0]

    def write(self, who, gva, salt: int):
        off = self._slot()
        self.buf[off : off + OBJ] = salt
        return self.pool.batch_copy([gva], [self.buf.data_ptr() + off], [OBJ], L2G, host=self.clients[who])

    def finish(self, who, key, res=0):
        return self.pool.batch_write_finish([key], [res], host=self.clients[who])[0]

    def exists(self, who, key):
        return self.pool.batch_is_exist([key], host=self.clients[who])[0]

    def size(self, who, key):
        return self.pool.batch_get_key_info([key], host=self.clients[who])[0].size()

    def lease(self, who, key):
        return self.pool.batch_add_lease([key], 1000, host=self.clients[who])[0]

    def read(self, who, key):
        """As vllm-ascend's layerwise load reads: key info, a read lease, the copy, the lease
        released; (copy result, the salt of the bytes read: which writer's, or None)."""
        info = self.pool.batch_get_key_info([key], host=self.clients[who])[0]
        if not info.size():
            return ("no key", None)
        if self.lease(who, key) != 0:
            return ("no lease", None)
        off = self._slot()
        self.buf[off : off + OBJ] = 0
        rc = self.pool.batch_copy([info.gva_list()[0]], [self.buf.data_ptr() + off], [OBJ], G2L, host=self.clients[who])
        self.pool.batch_remove_lease([key], host=self.clients[who])
        values = np.unique(self.buf[off : off + OBJ].numpy())
        return (rc, int(values[0]) if len(values) == 1 else "mixed")


def _scenario(run: _Run) -> list[tuple[str, object]]:
    """The operations of ``../shared/notes/memcache.md``'s table; (what, result) of each."""
    out = []
    ok = lambda v: v == 0  # noqa: E731
    addr = lambda v: v > 0  # noqa: E731

    # one writer: alloc, copy, finish; the key is then there for another client
    g = run.alloc("A", "k1")
    out += [("alloc new key", addr(g)), ("copy into it", ok(run.write("A", g, 11))), ("finish 0", ok(run.finish("A", "k1")))]
    out += [("exists (other client)", run.exists("C", "k1")), ("key info size > 0", run.size("C", "k1") > 0), ("read", run.read("C", "k1"))]
    # a second writer of a ready key: its address, and a reader still gets the first writer's bytes
    g2 = run.alloc("B", "k1")
    out += [("alloc of a ready key: an address", addr(g2)), ("  the same address", g2 == g)]
    out += [("copy other bytes into it", ok(run.write("B", g2, 12))), ("finish 0 again", ok(run.finish("B", "k1"))), ("read after", run.read("C", "k1"))]
    # a key being written: no reader gets its bytes (exists and key info differ by version: _shows_writing)
    g = run.alloc("A", "k2")
    out += [("lease of a key being written", ok(run.lease("C", "k2")))]
    out += [("a read of a key being written fails", run.read("C", "k2")[0] != 0)]
    # two writers of one allocation: the same address; both finish; the key is there
    g_b = run.alloc("B", "k2")
    out += [("second writer's alloc: the same address", g_b == g)]
    out += [("A copies", ok(run.write("A", g, 21))), ("B copies", ok(run.write("B", g_b, 21)))]
    out += [("A finishes 0", ok(run.finish("A", "k2"))), ("B finishes 0", ok(run.finish("B", "k2"))), ("read", run.read("C", "k2"))]
    # a failed finish removes the key for everyone, also after the other writer finished it with 0
    g = run.alloc("A", "k3")
    g_b = run.alloc("B", "k3")
    run.write("A", g, 31)
    run.write("B", g_b, 31)
    out += [("B finishes 0", ok(run.finish("B", "k3"))), ("A finishes -1", ok(run.finish("A", "k3", -1)))]
    out += [("exists after a failed finish", run.exists("C", "k3")), ("key info size after", run.size("C", "k3"))]
    g = run.alloc("A", "k4")
    run.write("A", g, 41)
    out += [("finish -1 first", ok(run.finish("A", "k4", -1))), ("the other writer's finish 0 after it", ok(run.finish("B", "k4")))]
    out += [("exists", run.exists("C", "k4"))]
    # the key can be written again after a failed finish
    g = run.alloc("B", "k4")
    out += [("alloc after a failed finish", addr(g)), ("copy", ok(run.write("B", g, 42))), ("finish", ok(run.finish("B", "k4"))), ("read", run.read("C", "k4"))]
    # a lease of a ready key, then the key removed: gone for everyone at once
    out += [("lease of a ready key", ok(run.lease("C", "k1")))]
    run.pool.evict(lambda key: key == "k1")
    out += [("exists after remove under a lease", run.exists("A", "k1")), ("key info size", run.size("B", "k1"))]
    # a key removed while it is being written (a full pool evicts such keys on 1.2.0): the writer's
    # copy and finish fail, and the key is not there (what pool_save_failures acts on)
    g = run.alloc("A", "k5")
    run.pool.evict(lambda key: key == "k5")
    out += [("copy into a key removed while written", ok(run.write("A", g, 51))), ("  its finish 0", ok(run.finish("A", "k5")))]
    out += [("  exists after", run.exists("C", "k5"))]
    # never written
    out += [("exists of a missing key", run.exists("C", "nope")), ("finish of a key nobody allocated", ok(run.finish("C", "nope")))]
    return out


#: the allocation lease of the lease scenario's own MetaService (MemCache's default is ~10 s)
LEASE_MS = 1000


def _past_the_lease(run: _Run) -> list[tuple[str, object]]:
    """Writers that outlive their allocation lease (``outlive_allocations``: the real store's own
    expiry, the byte store's model of it); one finishes 0, the other -1."""
    ok = lambda v: v == 0  # noqa: E731
    g, h = run.alloc("A", "x"), run.alloc("B", "y")
    out = [("copy inside the allocation lease", ok(run.write("A", g, 51)) and ok(run.write("B", h, 61)))]
    run.pool.outlive_allocations()
    out += [("copy past the allocation lease", ok(run.write("A", g, 52)))]
    out += [(f"{PAST} its finish 0", ok(run.finish("A", "x"))), (f"{PAST} exists after", run.exists("C", "x"))]
    out += [(f"{PAST} read after", run.read("C", "x"))]
    out += [(f"{PAST} finish -1", ok(run.finish("B", "y", -1))), (f"{PAST} exists after -1", run.exists("C", "y"))]
    return out


#: rows of the lease scenario whose MemCache 1.3.0 result changes once its MetaService reclaims the
#: expired allocation (about a second after the expiry); the results after that are accepted too
PAST = "past the lease:"
RECLAIMED = {f"{PAST} its finish 0": False, f"{PAST} exists after": 0, f"{PAST} read after": ("no key", None),
             f"{PAST} finish -1": False, f"{PAST} exists after -1": 0}


def _shows_writing(run: _Run) -> tuple[int, bool]:
    """(exists, key info size > 0) of a key another client is writing."""
    run.alloc("A", "w1")
    seen = (run.exists("C", "w1"), run.size("C", "w1") > 0)
    run.finish("A", "w1", -1)
    return seen


@pytest.fixture(scope="module")
def results():
    from harness_pool.runtime import memcache_cluster
    from memcache_pool import MemcachePool

    buffer = memcache_host.device_buffer(OBJ * 64)
    cluster = memcache_cluster()
    real = MemcachePool(cluster)
    got = {"memcache": _scenario(_Run(real, buffer, (-101, -102, -103)))}
    got["memcache shows writing"] = _shows_writing(_Run(real, buffer, (-101, -102, -103)))
    for pid in (-101, -102, -103):
        cluster.release(pid)
    short = memcache_host.Cluster(lease_ttl_ms=LEASE_MS)  # its own MetaService: a short allocation lease
    try:
        got["memcache"] += _past_the_lease(_Run(MemcachePool(short), buffer, (-121, -122, -123)))
    finally:
        short.close()
    byte = PoolService()
    got["bytes"] = _scenario(_Run(byte, buffer, (1, 2, 3))) + _past_the_lease(_Run(PoolService(), buffer, (1, 2, 3)))
    got["bytes shows writing"] = _shows_writing(_Run(byte, buffer, (1, 2, 3)))
    print(f"\nMemCache {memcache_host.version()} vs byte store:")
    for (what, mc), (_w, bs) in zip(got["memcache"], got["bytes"]):
        print(f"  {what:45s} {str(mc):12s} {str(bs):12s}")
    print(f"  {'(exists, key info) of a key being written':45s} {got['memcache shows writing']!s:12s} {got['bytes shows writing']!s:12s}")
    return got


def test_the_byte_store_answers_as_memcache_does(results):
    assert [w for w, _ in results["memcache"]] == [w for w, _ in results["bytes"]]
    differ = [
        (w, mc, bs)
        for (w, mc), (_w, bs) in zip(results["memcache"], results["bytes"])
        if mc != bs and not (w in RECLAIMED and mc == RECLAIMED[w] and not memcache_host.shows_writing())
    ]
    assert differ == [], differ


def test_a_key_being_written_shows_as_the_installed_version_shows_it(results):
    """1.2.0 shows a key still being written (exists 1, key info with its size; its read lease
    fails), 1.3.0 does not; the byte store answers as the installed version."""
    assert results["memcache shows writing"] == results["bytes shows writing"]
    shows = memcache_host.shows_writing()
    assert results["memcache shows writing"] == (int(shows), shows)


def test_what_the_byte_store_does_not_model():
    """Measured, for the docstrings: MemCache 1.3.0 refuses the same client's allocation of a key for a short while after that
    client finished it with a failure (another client gets an address at once; measured ~2 s); 1.2.0
    and the byte store hand out an address at once (listed in its docstring). A test that re-saves
    at once after failed saves runs on the byte store (test_pool_key_layout's lost-prefix case)."""
    from harness_pool.runtime import memcache_cluster
    from memcache_pool import MemcachePool

    buffer = memcache_host.device_buffer(OBJ * 8)
    cluster = memcache_cluster()
    got = {}
    for name, pool, pids in (("memcache", MemcachePool(cluster), (-111, -112, -113)), ("bytes", PoolService(), (1, 2, 3))):
        run = _Run(pool, buffer, pids)
        run.alloc("A", "r")
        run.finish("A", "r", -1)
        got[name] = (run.alloc("A", "r") > 0, run.alloc("B", "r") > 0)
    for pid in (-111, -112, -113):
        cluster.release(pid)
    # MemCache's refusal lasts ~2 s of wall time: printed, not asserted (a stalled CI core could outlast it)
    print(f"\nsame client re-allocates at once after its failed finish: MemCache {memcache_host.version()} "
          f"{'an address' if got['memcache'][0] else 'refused'}; byte store {'an address' if got['bytes'][0] else 'refused'}")
    assert got["memcache"][1] and got["bytes"] == (True, True), got
