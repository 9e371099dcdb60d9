"""Issue 26: the pool's health reaches vLLM's /metrics and its "KV Transfer metrics" log line.

Harness: tests/standins/harness_pool (``PoolInstance``: vLLM's real Scheduler, the AscendStore
connector halves on every TP rank, vLLM's ``KVOutputAggregator``, a byte-level MemCache with faults)
and its ``StatsTap`` (the scheduler's ``log_stats`` on; every ``SchedulerStats`` handed to vLLM's own
``PrometheusStatLogger`` -- registry of its own -- and ``KVConnectorLogging``). Each scenario is one
fault the other groups already handle (the faults of test_load_failures_pool.py, test_send_integrity.py
and test_send_shedding.py, set up with the same harness helpers) on a TP=2 instance; the scrape shows
that fault's figure and 0 for every other one. With the group off, a failing pool shows nothing.

On v0300 (issue 34, the ``test_030_*`` tests) the same figures come through vllm-ascend 0.30.0rc2's own
stats path (pool_metrics/v030.py), next to its four ``vllm:ascend_store_*`` metrics, which the tests
show at 0 on the layerwise path; the failures are those pool_load_recovery recovers (a copy that
returns an error or raises, keys evicted before the load, a copy past the bounded layer wait).

The TP ranks of the harness share one process, so one rank's ``get_kv_connector_stats`` drains the
counts the process's threads bumped; in a server each worker process reports its own, and the
aggregator sums them either way (the test checks the figures arrive in the workers' aggregated
output, before the scheduler adds its own).
"""

from __future__ import annotations

import time

import pytest

import ascend_layerwise_patch
from ascend_layerwise_patch import pool_events
from ascend_layerwise_patch.patches import load_failures, pool_metrics
from ascend_layerwise_patch.patches import _failed_load
from ascend_layerwise_patch.patches.mamba_lifetime import send_integrity, send_shedding
from ascend_layerwise_patch.patches.pool_metrics import v030 as pool_metrics_030
from ascend_layerwise_patch.registry import APPLIED, SKIPPED

from support import PAIR, activate_skipping

PAIRS = ("v0251", "v0260", "v0300")
if PAIR not in PAIRS:
    pytest.skip(f"for pairs {', '.join(PAIRS)}; installed: {PAIR}", allow_module_level=True)

from byte_store import G2L, L2G  # noqa: E402
from harness_pool import TIME_SCALE, PoolInstance, StatsTap, engine_loop, make_pool, slow_store, soak  # noqa: E402

pytestmark = pytest.mark.pairs(*PAIRS)

PROMPT = list(range(3000, 3040))  # 2 full blocks of 16 in the pool
B_PROMPT = PROMPT[:32] + list(range(6000, 6016)) + [1, 2, 3]
COUNTERS = {
    "load_failed": ("vllm:ascend_pool_load_failures_total", "failed"),
    "load_raised": ("vllm:ascend_pool_load_failures_total", "raised"),
    "load_late": ("vllm:ascend_pool_load_failures_total", "late"),
    "requests_rolled_back": ("vllm:ascend_pool_requests_rolled_back_total", None),
    "pool_keys_failed": ("vllm:ascend_pool_keys_failed_total", None),
    "stuck_sends": ("vllm:ascend_pool_stuck_sends_total", None),
    "saves_shed": ("vllm:ascend_pool_saves_shed_total", None),
    "tokens_recomputed": ("vllm:ascend_pool_tokens_recomputed_total", None),
    "hits_cut_back": ("vllm:ascend_pool_hits_cut_back_total", None),
    "mamba_state_bytes_loaded": ("vllm:ascend_pool_mamba_state_bytes_loaded_total", None),
}
GAUGES = ("vllm:ascend_pool_send_held_blocks", "vllm:ascend_pool_send_open_events", "vllm:ascend_pool_oldest_stuck_send_age_seconds")
AGE = "oldest_stuck_send_age_seconds"
MAMBA = "mamba_state_bytes_loaded"


def _activate(on: bool) -> None:
    reg = activate_skipping() if on else activate_skipping(pool_metrics.GROUP)
    reg.apply_pending()
    if not on:
        assert {st.state for st in reg.status() if st.group == pool_metrics.GROUP} == {SKIPPED}


@pytest.mark.pairs("v0251", "v0260")
def test_pool_metrics_applies():
    """The group's state, on its own (the figure tests run as configured)."""
    try:
        _activate(True)
        mine = {s.name for s in pool_metrics.SPECS}  # the 0.30 members (v030.py) are out of range here
        assert {st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.name in mine} == {APPLIED}
    finally:
        _activate(True)


@pytest.fixture
def library():
    for _ in range(2 * pool_events.ZERO_TAKES):  # nothing left over from other tests in this process
        if pool_events.take() is None:
            break
    yield _activate
    _activate(True)


def _figures(tap: StatsTap, inst: PoolInstance) -> dict[str, float]:
    """Each figure as scraped (the engine's labels), and a check that every metric is there."""
    got = tap.scrape("vllm:ascend_pool")
    engine = {"engine": "0", "model_name": inst.configs[0].model_config.served_model_name}  # vLLM's labels

    def sample(name, **more):
        return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted({**engine, **more}.items())) + "}"

    out = {}
    for key, (name, kind) in COUNTERS.items():
        s = sample(name, kind=kind) if kind else sample(name)
        assert s in got, (s, sorted(got))
        out[key] = got[s]
    for name in GAUGES:
        out[name.rpartition("_pool_")[2]] = got[sample(name)]
    return out


def _text(tap: StatsTap) -> str:
    from prometheus_client import generate_latest

    return generate_latest(tap.registry).decode()


def _worker_counts(inst: PoolInstance) -> dict[str, int]:
    """The counts carried by the workers' aggregated outputs (before the scheduler's own)."""
    total: dict[str, int] = {}
    for out in inst.kv_outputs:
        stats = getattr(out, "kv_connector_stats", None) if out is not None else None
        for key, n in (stats.data.get("counts", {}) if stats is not None else {}).items():
            total[key] = total.get(key, 0) + n
    return total


def _rank_integrity(rank) -> tuple[dict[str, int], bool]:
    """In a rank's process: its send_integrity counters, and whether a send of it is open now."""
    return send_integrity.counters(), any(ledger.since for ledger in list(send_integrity._ledgers))


def _stuck_total(inst: PoolInstance) -> int:
    """Stuck sends counted so far, over every rank (each counts its own sending thread's)."""
    return sum(counts["stuck_sends_total"] for counts, _open in inst.on_ranks(_rank_integrity))


def _fill(pool) -> None:
    """A saves PROMPT; returns once every key A allocated is finished (0.30's sending thread finishes
    the final layer's keys after A's last step: an eviction then would meet keys still being written,
    whose failed finishes count as ``pool_keys_failed`` -- test_memcache_capacity's case, not these)."""
    a = PoolInstance(pool, name="A", tp=2)
    a.add_request("a", PROMPT, max_tokens=1)
    engine_loop(a)
    for _ in range(3000):  # bounded (60 s): a finish that never comes fails here, not later
        if not any(blob.state == "writing" for blob in list(pool.blobs.values())):
            return
        time.sleep(0.02)
    raise AssertionError(f"A's saves never finished: {[k for k, b in pool.blobs.items() if b.state == 'writing']}")


def _load_fault_run(fault: str | None, evict_gdn: bool = False):
    """A fills the pool; B (TP=2, recompute) hits 32 tokens and its first GDN load gets ``fault``."""
    pool = make_pool()
    _fill(pool)
    policy = "recompute" if fault else "fail"  # vLLM's default (0.26: vllm-ascend refuses recompute for hybrids)
    b = PoolInstance(pool, name="B", tp=2, kv_load_failure_policy=policy)
    tap = StatsTap(b)
    group = str(b.group_of[b.gdn_layers[0]])
    if evict_gdn:  # MemCache evicted A's GDN states, its attention blocks are still there
        assert pool.evict(lambda k: k.split("@")[1] == group)
    f = pool.add_fault(fault, direction=G2L, times=1, match=lambda k: k.split("@")[1] == group) if fault else None

    def after(inst, _so):
        if f is not None and inst.steps >= 1:
            f.gate.set()

    b.add_request("b", B_PROMPT, max_tokens=3)
    engine_loop(b, on_step=after)
    assert not b.has_work() and pool.violations == []
    return b, tap, f, pool


ZERO = dict.fromkeys(COUNTERS, 0.0) | {"send_held_blocks": 0.0, "send_open_events": 0.0, AGE: 0.0}


def _state_bytes(inst: PoolInstance) -> int:
    """Bytes of one GDN layer's state on one rank (the harness's MambaSpec: conv + ssm state)."""
    import math

    spec = inst.specs[inst.gdn_layers[0]]
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(spec.shapes, spec.dtypes))


def _hit_mamba_bytes(inst: PoolInstance, states: int = 1) -> float:
    """What a pool hit loads of the GDN group: ``states`` states (the one it resumes from: the null
    blocks of the hit are not loaded, mamba_pool_resume_load / mamba_pool_null_loads) per GDN layer
    per rank."""
    return float(states * len(inst.gdn_layers) * inst.tp * _state_bytes(inst))


# ------------------------------------------------------------------------------------- v0251
@pytest.mark.pairs("v0251", "v0260")
def test_a_clean_run_shows_every_metric_at_zero(library):
    library(True)
    b, tap, _f, _pool = _load_fault_run(None)
    got = _figures(tap, b)
    # B's 32-token hit loaded one GDN state per GDN layer per rank: the only count of a clean run
    expected = _hit_mamba_bytes(b)
    print(f"\nclean hit: mamba state bytes expected {expected:.0f}, scraped {got[MAMBA]:.0f}; age {got[AGE]}")
    assert got == ZERO | {MAMBA: expected}
    assert _worker_counts(b) == {MAMBA: expected}  # counted by the workers, summed by vLLM's aggregator
    text = _text(tap)
    assert "# HELP vllm:ascend_pool_load_failures_total Layerwise KV pool loads that failed" in text
    assert "# HELP vllm:ascend_pool_oldest_stuck_send_age_seconds Seconds the oldest" in text
    assert "# HELP vllm:ascend_pool_mamba_state_bytes_loaded_total Bytes of mamba" in text
    # the log line: the bytes loaded, and at most the send backlog's peak (a step's sends may outlive
    # it: on 0.25.1rc1 save_kv_layer does not wait for them; on 0.26.0rc1 that depends on the threads'
    # timing); no stuck-send age
    lines = tap.log_lines()
    assert len(lines) == 1 and f"{MAMBA}={int(expected)}" in lines[0], lines
    keys = [p.split("=")[0] for p in lines[0].split(": ")[1].split(", ")]
    assert set(keys) <= {MAMBA, "send_held_blocks_peak", "send_open_events_peak"}, lines
    assert b.outputs["b"] and any(s.kv_connector_stats is None for s in tap.stats)


@pytest.mark.pairs("v0251")
@pytest.mark.parametrize("fault,kind", [("error", "load_failed"), ("raise", "load_raised"), ("gate", "load_late")])
def test_a_failed_load_is_counted_by_kind_with_its_rollback(library, monkeypatch, fault, kind):
    library(True)
    monkeypatch.setattr(_failed_load, "WAIT_S", 0.3)  # upstream's 10 s, shortened for the gate fault
    b, tap, f, pool = _load_fault_run(fault)
    assert f.hits == 1
    got = _figures(tap, b)
    # the keys the failed step saved, finished as failed on BOTH ranks: block 2 of the GDN and
    # attention groups on each (TP 2 over 2 KV heads: both ranks save both), 2 on the failing rank
    # by load_failures_saves and 2 on the other by load_failures_agreement (issue 32)
    keys_failed = 4.0
    # rolled back to token 0 (align mode keeps the latest GDN state only): the 32 tokens hit + 16 computed
    mamba = got.pop(MAMBA)
    print(f"\n{fault}: mamba state bytes loaded {mamba:.0f} of a full hit's {_hit_mamba_bytes(b):.0f}")
    if fault in ("error", "raise"):  # the one failed copy (first GDN layer, one rank) is not counted, the rest is
        assert mamba == _hit_mamba_bytes(b) - _state_bytes(b)
    else:  # the gated copy returns late (the rest of that rank's step abandoned): never a full hit
        assert 0 < mamba < _hit_mamba_bytes(b)
    assert {**got, MAMBA: 0.0} == ZERO | {kind: 1.0, "requests_rolled_back": 1.0, "pool_keys_failed": keys_failed, "tokens_recomputed": 48.0}
    # the load's count came from a worker, through vLLM's aggregation of the TP ranks' outputs
    assert _worker_counts(b).get(kind) == 1
    lines = tap.log_lines()
    assert len(lines) == 1 and lines[0].startswith("KV Transfer metrics: ")
    assert f"{kind}=1" in lines[0] and "requests_rolled_back=1" in lines[0], lines
    print(f"\n{fault}: {lines[0]} {got}")


@pytest.mark.pairs("v0251")
def test_a_hit_cut_back_to_a_saved_state_is_counted(library):
    """The pool holds A's attention blocks but not its GDN states: mamba_pool_hit cuts B's hit to 0."""
    library(True)
    b, tap, _f, _pool = _load_fault_run(None, evict_gdn=True)
    got = _figures(tap, b)
    assert got == ZERO | {"hits_cut_back": 1.0}, got  # no hit left: no mamba state bytes loaded


@pytest.mark.pairs("v0251")
def test_with_the_group_off_a_failing_pool_shows_nothing(library, monkeypatch):
    library(False)
    b, tap, f, _pool = _load_fault_run("error")
    assert f.hits == 1
    assert tap.scrape("vllm:ascend_pool") == {}
    assert all(s.kv_connector_stats is None for s in tap.stats) and tap.log_lines() == []
    pool_events.drain()  # what the other groups counted meanwhile


@pytest.mark.pairs("v0251")
def test_a_hung_send_is_counted_and_its_held_blocks_shown(library, monkeypatch):
    """One save copy of rank 1 hangs several steps (save_kv_layer's scaled wait gives up); then returns."""
    library(True)
    monkeypatch.setattr(send_integrity, "STUCK_AFTER_S", 10.0 * TIME_SCALE)
    monkeypatch.setattr(send_integrity, "STUCK_REPEAT_S", 60.0)
    pool = make_pool()
    inst = PoolInstance(pool, name="A", tp=2)  # a process per rank: each counts its own sends
    inst.scale_save_wait()
    tap = StatsTap(inst)
    f = pool.add_fault("gate", direction=L2G, times=1, match=lambda k: k.endswith("@1"))
    total0 = _stuck_total(inst)
    seen: list[dict] = []

    stuck_at: list[int] = []
    intervals: list[tuple[float, list[str]]] = []  # each step a log interval: (held after it, its lines)

    def watch(i, _so):
        seen.append(_figures(tap, i))
        before = len(tap.lines)
        intervals.append((seen[-1]["send_held_blocks"], tap.log_lines()[before:]))
        if not stuck_at and _stuck_total(i) > total0:
            stuck_at.append(i.steps)
        if (stuck_at and i.steps >= stuck_at[0] + 3) or i.steps > 200:  # 3 more steps stuck, then it returns
            f.gate.set()

    inst.add_request("a", PROMPT, max_tokens=2)
    engine_loop(inst, on_step=watch)
    got = _figures(tap, inst)
    assert f.hits == 1 and _stuck_total(inst) == total0 + 1
    # ... every block given back, the stuck-send age back to 0 at the end; no hit: no mamba bytes
    assert got == ZERO | {"stuck_sends": 1.0}
    ages = [s[AGE] for s in seen]
    # the age while stuck: at least save_kv_layer's (scaled) wait, growing step by step
    stuck = [a for a in ages if a]
    assert stuck and min(stuck) >= send_integrity.STUCK_AFTER_S and max(stuck) > min(stuck), ages
    assert ages[-1] == 0.0, ages
    held = max(s["send_held_blocks"] for s in seen)
    assert held > 0 and max(s["send_open_events"] for s in seen) >= 1
    line = "".join(tap.log_lines())
    assert "stuck_sends=1" in line and f"send_held_blocks_peak={int(held)}" in line, line
    # every interval in which the stuck send held blocks logged them, also the ones where nothing
    # changed (issue 34: the gauges were reported only when the set of open events changed)
    holding = [(h, lines) for h, lines in intervals if h > 0]
    assert len(holding) >= 3, intervals
    silent = [(h, lines) for h, lines in holding if not any(f"send_held_blocks_peak={int(h)}" in x for x in lines)]
    assert silent == [], silent
    assert f"{AGE}_peak={max(stuck)}" in line, line
    print(f"\nhung send: peak {held:.0f} block references held; stuck-send age {min(stuck)}..{max(stuck)} s over "
          f"{len(stuck)} steps, then {ages[-1]}; {line}")


@pytest.mark.pairs("v0251")
def test_slow_sends_shed_saves_as_counted_by_the_bound(library, monkeypatch):
    """test_send_shedding's slow store (smaller): the shed saves on /metrics equal the bound's own count."""
    library(True)
    monkeypatch.setattr(send_integrity, "STUCK_AFTER_S", 0.12)
    monkeypatch.setattr(send_shedding, "_warned", {"at": None, "since": 0})
    shed0 = send_shedding.counters()["shed_saves"]
    pool = make_pool()
    # a process per rank: the shedding bound is the scheduler's (this process), the send ledgers each rank's
    inst = PoolInstance(pool, max_model_len=512, num_blocks=120, max_num_seqs=8, tp=2)
    stuck0 = _stuck_total(inst)
    inst.scale_save_wait()
    tap = StatsTap(inst)
    fault = slow_store(pool, seed=0)
    soak(inst, seed=0, deadline_s=30.0, on_finished=lambda _i: fault.gate.set(), requests=12, prompt=(20, 200), output=(1, 3))
    assert not inst.has_work()
    # the loop may stop with a shed save's copy still in flight (no open event keeps it stepping), or
    # in the step where a stuck copy returned (one rank's take saw it live, and vLLM aggregates
    # gauges by max over the ranks): the age gauge, like every vLLM stats figure, moves on engine steps. Once the copies returned, one more request's steps
    # report it as 0.
    deadline = time.monotonic() + 10.0
    while any(open_ for _counts, open_ in inst.on_ranks(_rank_integrity)) and time.monotonic() < deadline:
        time.sleep(0.01)
    inst.add_request("after", list(range(9000, 9005)), max_tokens=1)
    engine_loop(inst)
    got = _figures(tap, inst)
    shed = send_shedding.counters()["shed_saves"] - shed0
    stuck = _stuck_total(inst) - stuck0
    assert shed > 0
    got[MAMBA] = 0.0  # whatever the soak's own pool hits loaded: not this test's figure
    assert got == ZERO | {"saves_shed": float(shed), "stuck_sends": float(stuck)}  # stuck-send age 0 at the end
    print(f"\nslow store: {tap.log_lines()}")


# ------------------------------------------------------------------------------------- v0300
# vLLM 0.30.0 + vllm-ascend 0.30.0rc2 (issue 34): the same figures through 0.30's own AscendStore stats
# (its AscendStoreKVConnectorStats / AscendStorePromMetrics, extended by pool_metrics/v030.py), next to
# its own four vllm:ascend_store_* metrics. What moves there: the failures pool_load_recovery reports
# (by kind), the requests it rolls back and the tokens they recompute, the keys the agreement drops,
# the mamba state bytes a hit loads. StatsTap is used as it is: vLLM 0.30's PrometheusStatLogger has
# the same _kv_connector_cls / record() as 0.25's.
UPSTREAM_030 = ("vllm:ascend_store_load_get_keys_total", "vllm:ascend_store_delayed_release_requests",
                "vllm:ascend_store_delayed_release_blocks", "vllm:ascend_store_load_get_duration_seconds_count")


def _upstream_figures(tap: StatsTap, inst: PoolInstance) -> dict[str, float]:
    """vllm-ascend 0.30.0rc2's own four (the histogram by its sample count), with the engine's labels."""
    got = tap.scrape("vllm:ascend_store")
    labels = "{" + f'engine="0",model_name="{inst.configs[0].model_config.served_model_name}"' + "}"
    return {name: got[name + labels] for name in UPSTREAM_030}


#: async scheduling: B prefills in 16-token chunks after its 32-token hit, so the step after the failed one
#: (scheduled before the failure is known) saves a full block computed on the state never loaded
B_PROMPT_ASYNC = PROMPT[:32] + list(range(6000, 6032)) + [1, 2]


def _recovered_run(fault: str | None, scheduling: str = "sync"):
    """A fills the pool (TP 2); B (TP 2, recompute) hits 32 tokens of it; ``fault``: B's first GDN load
    copy returns an error ("error") or raises ("raise"), or every pool key is evicted between B's
    first schedule and its load ("evict"); pool_load_recovery reports the load, B's request is
    preempted and recomputes its prompt."""
    pool = make_pool()
    _fill(pool)
    asy = scheduling == "async"
    b = PoolInstance(pool, name="B", tp=2, kv_load_failure_policy="recompute", async_scheduling=asy,
                     long_prefill_token_threshold=16 if asy else 0)
    tap = StatsTap(b)
    group = str(b.group_of[b.gdn_layers[0]])
    f = None
    if fault in ("error", "raise", "gate"):
        f = pool.add_fault(fault, direction=G2L, times=1, match=lambda k: k.split("@")[1] == group)
    evicted: list[str] = []

    def after_schedule(inst, _so):
        if fault == "evict" and inst.steps == 0:
            evicted.extend(pool.evict(lambda _k: True))

    def on_step(inst, _so):
        if f is not None and inst.steps >= 1:
            f.gate.set()  # the gated copy returns after the bounded wait gave up (or never: other faults)

    b.after_schedule = after_schedule
    b.add_request("b", B_PROMPT_ASYNC if asy else B_PROMPT, max_tokens=3)
    engine_loop(b, on_step=on_step)
    assert not b.has_work() and pool.violations == []
    assert (f.hits == 1) if f is not None else (bool(evicted) == (fault == "evict"))
    return b, tap


@pytest.mark.pairs("v0300")
def test_pool_metrics_applies_on_030():
    try:
        _activate(True)
        states = {st.name: st.state for st in ascend_layerwise_patch.REGISTRY.status() if st.group == pool_metrics.GROUP}
        assert {n: s for n, s in states.items() if n.endswith("_030")} == dict.fromkeys((s.name for s in pool_metrics_030.SPECS), APPLIED)
    finally:
        _activate(True)


@pytest.mark.pairs("v0300")
def test_030_a_pool_hit_shows_its_state_bytes_next_to_upstreams_figures(library):
    library(True)
    b, tap = _recovered_run(None)
    got = _figures(tap, b)
    expected = _hit_mamba_bytes(b)  # one GDN state per GDN layer per rank
    up = _upstream_figures(tap, b)
    print(f"\n0.30 clean hit: mamba state bytes expected {expected:.0f}, scraped {got[MAMBA]:.0f}; vllm-ascend's own: {up}")
    assert got == ZERO | {MAMBA: expected}
    # vllm-ascend's own four are registered and stay 0 on the layerwise path (docs/metrics.md: why)
    assert up == dict.fromkeys(UPSTREAM_030, 0.0)
    lines = tap.log_lines()
    assert len(lines) == 1 and f"{MAMBA}={int(expected)}" in lines[0], lines
    assert "ascend_store_delayed_release_requests=0" in lines[0], lines  # upstream's reduce, extended
    # a step with nothing to report carries upstream's None (the scheduler's get_stats, a worker's empty stats)
    assert any(s.kv_connector_stats is None for s in tap.stats)


@pytest.mark.pairs("v0300")
@pytest.mark.parametrize(
    "fault,kind,scheduling",
    [("error", "load_failed", "sync"), ("raise", "load_raised", "sync"), ("evict", "load_failed", "sync"),
     ("gate", "load_late", "sync"), ("error", "load_failed", "async")],
)
def test_030_a_recovered_load_is_counted_by_kind_with_its_rollback(library, monkeypatch, fault, kind, scheduling):
    """B's 32-token hit fails to load (pool_load_recovery reports it, B's request is preempted and
    recomputes its prompt): the failure by kind, the request rolled back, the tokens it recomputes, the
    GDN bytes that did load; vllm-ascend's own four stay 0 (the layerwise path feeds none of them)."""

    library(True)
    monkeypatch.setattr(_failed_load, "WAIT_S", 0.3)  # the layer wait's bound (pool_load_wait_bound), for the gate
    b, tap = _recovered_run(fault, scheduling)
    got = _figures(tap, b)
    mamba = got.pop(MAMBA)
    up = _upstream_figures(tap, b)
    lines = tap.log_lines()
    print(f"\n0.30 {fault} {scheduling}: {got} mamba {mamba:.0f} (a full hit: {_hit_mamba_bytes(b):.0f}); vllm-ascend's own: {up}; {lines}")
    n_kind = 2.0 if fault == "evict" else 1.0  # a key gone: each rank's worker reports the request's load
    # rolled back to token 0 (align mode keeps the latest GDN state only): the 32 tokens hit, and under
    # async scheduling the 16-token chunk computed in the step already in flight
    recomputed = 48.0 if scheduling == "async" else 32.0
    # 0 keys failed: 0.30's load step saves nothing for the request, and the later steps' saves are dropped
    # by pool_load_recovery until it recomputes. Its recompute then saves the prefix again: after the
    # eviction, on the real MemCache 1.2.0 a copy into a key allocated right after the eviction removed
    # it may be refused (-3102) while the MetaService still reclaims the old allocation; those keys cost
    # only themselves (pool_save_failures), and whether the tap sees their count before B's last step
    # is a race: not compared for "evict" (test_pool_save_failures / test_memcache_capacity count them)
    if fault == "evict":
        got.pop("pool_keys_failed")
    zero = {k: v for k, v in ZERO.items() if k not in (MAMBA, *(("pool_keys_failed",) if fault == "evict" else ()))}
    assert got == zero | {kind: n_kind, "requests_rolled_back": 1.0, "tokens_recomputed": recomputed}
    if fault == "evict":  # nothing loaded
        assert mamba == 0.0
    elif fault == "gate":  # the gated copy returns after the step gave up: never a full hit
        assert 0 <= mamba < _hit_mamba_bytes(b)
    else:  # the failed copy (one GDN layer on one rank) is not counted, the rest is
        assert mamba == _hit_mamba_bytes(b) - _state_bytes(b)
    assert up == dict.fromkeys(UPSTREAM_030, 0.0)
    assert len(lines) == 1 and f"{kind}={int(n_kind)}" in lines[0] and "requests_rolled_back=1" in lines[0], lines
    assert f"tokens_recomputed={int(recomputed)}" in lines[0] and "ascend_store_delayed_release_blocks=0" in lines[0], lines


@pytest.mark.pairs("v0300")
def test_030_with_the_group_off_a_recovered_load_shows_nothing(library):
    library(False)
    b, tap = _recovered_run("error")
    assert tap.scrape("vllm:ascend_pool") == {}
    assert _upstream_figures(tap, b) == dict.fromkeys(UPSTREAM_030, 0.0)  # vllm-ascend's own are still there
    assert all(s.kv_connector_stats is None for s in tap.stats) and tap.log_lines() == []
    pool_events.drain()  # what the other groups counted meanwhile


@pytest.mark.pairs("v0300")
def test_030_a_stuck_send_is_counted(library, monkeypatch):
    """A save copy that takes 1 s holds 0.30's end-of-step wait (the whole engine): ``send_stuck_030``
    counts one stuck send, which /metrics shows with the step that ends the wait; the age gauge reads 0
    by then (no scrape can run while the engine is held). TP 1: the watch runs in this process."""
    from ascend_layerwise_patch.patches.mamba_lifetime import v030 as lifetime_030

    library(True)
    monkeypatch.setattr(lifetime_030, "STUCK_AFTER_S", 0.12)
    pool = make_pool()
    inst = PoolInstance(pool, name="S")
    tap = StatsTap(inst)
    fault = pool.add_fault("delay", direction=L2G, delay=lambda: 1.0, times=1)
    inst.add_request("s", PROMPT, max_tokens=1)
    engine_loop(inst)
    got = _figures(tap, inst)
    lines = tap.log_lines()
    print(f"\n0.30 stuck send: {got}; {lines}")
    assert fault.hits == 1
    assert got == ZERO | {"stuck_sends": 1.0}
    assert any("stuck_sends=1" in line for line in lines), lines
    assert _upstream_figures(tap, inst) == dict.fromkeys(UPSTREAM_030, 0.0)


@pytest.mark.pairs("v0300")
def test_030_a_slow_store_moves_no_pool_figure(library):
    """A store slower than the model on 0.30 (every save copy 1.5-6x save_kv_layer's scaled wait): 0.30
    holds each step until its copies returned, so no send holds a block, nothing is shed and nothing
    fails -- every ``vllm:ascend_pool_*`` figure stays 0, registered all the same (docs/metrics.md: why)."""
    library(True)
    pool = make_pool()
    inst = PoolInstance(pool, name="slow")
    inst.scale_save_wait()
    tap = StatsTap(inst)
    fault = slow_store(pool, seed=0, hang_p=0.0)
    for i in range(4):
        inst.add_request(f"r{i}", list(range(40_000 + 100 * i, 40_000 + 100 * i + 40)), max_tokens=2)
    engine_loop(inst)
    got = _figures(tap, inst)
    print(f"\n0.30 slow store: {fault.hits} slow copies; {got}")
    assert fault.hits > 0 and got == ZERO
    assert not inst.has_work() and inst.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == inst.kv_cache_config.num_blocks - 1
