"""Group ``pool_metrics`` on vllm-ascend 0.30.0rc2 (vLLM 0.29 / 0.30): the same ``vllm:ascend_pool_*``
figures through 0.30's own connector stats path, alongside its own four metrics (issue 34).

Target   vllm-ascend 0.30.0rc2's AscendStore stats path, which it already implements:
         ``AscendStoreConnector.get_kv_connector_stats`` (its halves' ``get_stats``; the scheduler's
         returns None), ``metrics:AscendStoreKVConnectorStats.aggregate`` / ``.reduce`` and
         ``metrics:AscendStorePromMetrics.__init__`` / ``.observe`` (``vllm:ascend_store_load_get_duration_seconds``,
         ``..._load_get_keys_total``, ``..._delayed_release_requests``, ``..._delayed_release_blocks``);
         and, for the mamba state bytes loaded, the layerwise receiving thread and the worker as on 0.25
         (loads.py's wrappers, stacked on pool_load_recovery's).
Versions vLLM >=0.29,<0.31; vllm-ascend 0.30.x (``V029_030``): vLLM 0.29 hands the stats' ``data`` to the
         loggers as 0.30 hands ``to_dict()`` (the same dict); what moves there is what its applied groups
         count (the mamba state bytes; pool_load_recovery is out of range on 0.29).
Why      0.30.0rc2's stats carry only its own figures: the failures pool_load_recovery reports and
         recovers, the keys the agreement drops and the GDN bytes a hit loads stay off /metrics and the
         "KV Transfer metrics" line. Its own four do not move on the layerwise path (docs/metrics.md says so).
How      Extend, not replace. ``get_kv_connector_stats``: upstream's result first; then one
         ``pool_events.take()`` (two truth tests when nothing happened) and the scheduler's send gauges
         (``__init__._gauges``: nothing while no send event is open, which on 0.30's layerwise path is
         always -- it touches no block for a layerwise send); nothing to add: upstream's result as it is
         (None on the scheduler, None or its own object on a worker), no allocation. Something to add:
         upstream's ``AscendStoreKVConnectorStats`` (its own, or a new one when it had none) carries it
         under one key, ``ascend_pool`` (``{"counts": ..., "gauges": ...}``, as ``AscendPoolStats``'
         data), next to its own keys; it pickles by name as before. ``aggregate`` (vLLM's
         ``KVOutputAggregator`` over TP workers, the scheduler adding its own, the log line's interval)
         merges that key as ``AscendPoolStats.aggregate`` does (counts summed, gauges by max) into a new
         dict, then runs upstream's; ``reduce`` adds ``AscendPoolStats.reduce``'s figures to upstream's;
         upstream's ``is_empty`` (``not self.data``) already counts the key. ``AscendStorePromMetrics``
         builds an ``AscendPoolPromMetrics`` (stats_types: the 0.25 metric definitions) next to its own
         metrics, and its ``observe`` hands it the key's data after upstream's own.
Removal  When vllm-ascend's AscendStore metrics carry the pool's failures themselves (detected: its
         metrics module names ``ascend_pool_`` metrics or counts failed loads; the group then skips).
"""

from __future__ import annotations

import functools

from ... import pool_events
from .._checks import expects as _expects
from .._checks import source as _source
from .._ranges import V029_030
from .._targets import STORE
from . import _gauges, _get_stats_ok, _types, loads as _loads
from . import CONNECTOR, GROUP

#: the key our figures travel under in 0.30's AscendStoreKVConnectorStats.data
KEY = "ascend_pool"
_PROM = "_ascend_layerwise_patch_pool_prom"  # AscendStorePromMetrics: our AscendPoolPromMetrics
_METRICS_MOD = f"{STORE}.metrics"
# the metrics classes reached through the connector module that imports them (the same class objects): a
# post-import hook on metrics itself fires while pool_scheduler / pool_worker are still initializing
_CONNECTOR_MOD = CONNECTOR.partition(":")[0]
STATS = f"{_CONNECTOR_MOD}:AscendStoreKVConnectorStats"
PROM = f"{_CONNECTOR_MOD}:AscendStorePromMetrics"
_RECV_030 = f"{STORE}.kv_transfer:KVCacheStoreLayerRecvingThread"
_RECV_COPY = f"{STORE}.pool_worker:KVCacheStoreLayerRecvingThread._batch_copy_with_limits"


def make_get_stats(original):
    """Upstream's stats, with ours under ``KEY`` when there is anything to report."""
    take = pool_events.take
    stats_cls = original.__globals__["AscendStoreKVConnectorStats"]

    @functools.wraps(original)
    def get_kv_connector_stats(self):
        stats = original(self)
        events = take()  # (counts, ages) or None
        sched = self.__dict__.get("connector_scheduler")
        gauges = _gauges(self, sched) if sched is not None else None
        if events is None and gauges is None:
            return stats  # the per-step path: upstream's result, nothing allocated
        counts, ages = events if events is not None else ({}, {})
        ours = {"counts": counts, "gauges": {**ages, **gauges} if gauges else ages}
        if stats is None:
            stats = stats_cls()
        stats.data[KEY] = ours
        return stats

    return get_kv_connector_stats


def _merged(mine: dict | None, theirs: dict) -> dict:
    """``AscendPoolStats.aggregate`` of copies (the dicts may be shared with a logger that read them)."""
    ours = _types().AscendPoolStats(data={"counts": dict((mine or {}).get("counts", {})), "gauges": dict((mine or {}).get("gauges", {}))})
    ours.aggregate(_types().AscendPoolStats(data=theirs))
    return ours.data


def make_aggregate(original):
    @functools.wraps(original)
    def aggregate(self, other):
        theirs = other.data.get(KEY) if other is not None and other is not self else None
        if theirs:
            self.data[KEY] = _merged(self.data.get(KEY), theirs)
        return original(self, other)

    return aggregate


def make_reduce(original):
    @functools.wraps(original)
    def reduce(self):
        out = original(self)
        ours = self.data.get(KEY)
        if ours:
            out.update(_types().AscendPoolStats(data=ours).reduce())
        return out

    return reduce


def make_prom_init(original):
    @functools.wraps(original)
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        original(self, vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.__dict__[_PROM] = _types().AscendPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    return __init__


def make_prom_observe(original):
    @functools.wraps(original)
    def observe(self, transfer_stats_data, engine_idx=0):
        original(self, transfer_stats_data, engine_idx)
        ours = transfer_stats_data.get(KEY)
        prom = self.__dict__.get(_PROM)
        if ours and prom is not None:
            prom.observe(ours, engine_idx)

    return observe


# ----------------------------------------------------------------------------- checks on targets
def _metrics():
    import importlib

    return importlib.import_module(_METRICS_MOD)


def upstream_exports(_original) -> str | None:
    """Fixed upstream when vllm-ascend's AscendStore metrics carry the pool's failures themselves."""
    text = _source(_metrics())
    if "ascend_pool_" in text or "load_fail" in text or "rolled_back" in text:
        return "vllm-ascend's AscendStore metrics export the pool's failures themselves"
    return None


def _get_stats_030_ok(original) -> str | None:
    problem = _get_stats_ok(original) or _expects(
        ["self"], needs=("connector_scheduler.get_stats()", "connector_worker.get_stats()"), globals_=("AscendStoreKVConnectorStats",)
    )(original)
    if problem:
        return problem
    stats = _metrics().AscendStoreKVConnectorStats
    if original.__globals__["AscendStoreKVConnectorStats"] is not stats:
        return "AscendStoreConnector builds another stats class than metrics.AscendStoreKVConnectorStats"
    try:
        stats().data[KEY] = {}
    except Exception as exc:  # noqa: BLE001 - anything but a plain dict of data
        return f"AscendStoreKVConnectorStats().data takes no extra key ({exc!r})"
    return None


def _aggregate_ok(original) -> str | None:
    problem = _expects(["self", "other"], needs=("other.data", "return self"))(original)
    if problem:
        return problem
    if "not self.data" not in _source(_metrics().AscendStoreKVConnectorStats.is_empty):
        return "AscendStoreKVConnectorStats.is_empty no longer reads the whole data dict (an extra key would not count)"
    return None


def _reduce_ok(original) -> str | None:
    problem = _expects(["self"], needs=("reduced",))(original)
    if problem:
        return problem
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import ascend_store_connector

    build = ascend_store_connector.AscendStoreConnector.build_kv_connector_stats
    if "AscendStoreKVConnectorStats(data=data" not in _source(build):
        return "AscendStoreConnector.build_kv_connector_stats no longer wraps the data it gets (the log line's path)"
    return None


def _prom_init_ok(original) -> str | None:
    return _expects(["self", "vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"], needs=("super().__init__",))(original)


def _prom_observe_ok(original) -> str | None:
    problem = _expects(["self", "transfer_stats_data", "engine_idx"], needs=("transfer_stats_data.get",))(original)
    if problem:
        return problem
    from vllm.v1.core.sched.scheduler import Scheduler

    text = _source(Scheduler.make_stats)
    if "kv_connector_stats.to_dict()" not in text and "kv_connector_stats.data" not in text:
        return "vLLM's scheduler no longer hands the connector stats' data dict to the loggers"
    return None


def _handle_030_ok(original) -> str | None:
    problem = _loads.handle_ok(original)
    if problem:
        return problem
    if "res != 0" not in _source(original):
        return "the layerwise receiving thread no longer checks its load copy's result"
    return None


SPECS = (
    GROUP.spec(
        "pool_metrics_groups_030",
        f"{STORE}.pool_worker:KVPoolWorker._build_shared_load_data",
        _loads.make_build_shared_load,
        ranges=V029_030,
        why="the receiving thread learns which KV cache groups hold mamba (GDN) states",
        precondition=_loads.build_shared_ok,
        fixed_upstream=upstream_exports,
        after=("pool_metrics_mamba_groups",),  # vllm-ascend <0.27: never both in range
    ),
    GROUP.spec(
        "pool_metrics_loads_030",
        f"{_RECV_030}._handle_request",
        _loads.make_recv_handle,
        ranges=V029_030,
        why="the mamba state bytes each layerwise load copies from the pool (vllm:ascend_pool_mamba_state_bytes_loaded)",
        precondition=_handle_030_ok,
        fixed_upstream=upstream_exports,
        after=("pool_load_report_copy",),
    ),
    GROUP.spec(
        "pool_metrics_copy_030",
        _RECV_COPY,
        _loads.make_batch_copy,
        ranges=V029_030,
        why="those bytes are counted only when the layer's load copy returned success",
        precondition=_loads.copy_ok,
        fixed_upstream=upstream_exports,
        after=("load_fail_copy", "pool_metrics_load_copy", "pool_load_report_raise"),
    ),
    GROUP.spec(
        "pool_metrics_stats_030",
        f"{CONNECTOR}.get_kv_connector_stats",
        make_get_stats,
        ranges=V029_030,
        why="the pool's counts and gauges travel in vllm-ascend's own AscendStore connector stats (all TP workers)",
        precondition=_get_stats_030_ok,
        fixed_upstream=upstream_exports,
        counters=pool_events.pending,
        after=("pool_metrics_stats",),  # vllm-ascend <0.27: never both in range
    ),
    GROUP.spec(
        "pool_metrics_aggregate_030",
        f"{STATS}.aggregate",
        make_aggregate,
        ranges=V029_030,
        why="vLLM's aggregation over TP workers and a log interval sums our counts (gauges by max) with its own",
        precondition=_aggregate_ok,
        fixed_upstream=upstream_exports,
    ),
    GROUP.spec(
        "pool_metrics_reduce_030",
        f"{STATS}.reduce",
        make_reduce,
        ranges=V029_030,
        why="the same figures in vLLM's periodic KV-transfer log line, after vllm-ascend's own",
        precondition=_reduce_ok,
        fixed_upstream=upstream_exports,
    ),
    GROUP.spec(
        "pool_metrics_prom_030",
        f"{PROM}.__init__",
        make_prom_init,
        ranges=V029_030,
        why="vllm:ascend_pool_* counters and gauges registered next to vllm-ascend's vllm:ascend_store_* metrics",
        precondition=_prom_init_ok,
        fixed_upstream=upstream_exports,
    ),
    GROUP.spec(
        "pool_metrics_observe_030",
        f"{PROM}.observe",
        make_prom_observe,
        ranges=V029_030,
        why="each step's figures reach vllm:ascend_pool_* on /metrics (PrometheusStatLogger)",
        precondition=_prom_observe_ok,
        fixed_upstream=upstream_exports,
    ),
)
