"""The layerwise pool's health on vLLM's /metrics and in its periodic KV-transfer log line (issue 26).

Target   vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector
         .AscendStoreConnector.get_kv_connector_stats, and its class methods
         build_kv_connector_stats and build_prom_metrics (all three inherited from vLLM's
         KVConnectorBase_V1, where they return None); for the mamba state bytes loaded (loads.py):
         pool_worker:KVPoolWorker._build_shared_load_data and the layerwise receiving thread's
         KVCacheStoreLayerRecvingThread._handle_request / ._batch_copy_with_limits.
Versions vLLM >=0.25.0,<0.27; vllm-ascend >=0.25.1,<0.27 (base releases). On vllm-ascend 0.30.0rc2
         (vLLM 0.29 / 0.30), which has a stats path of its own, the group's ``*_030`` members (v030.py)
         extend that path instead (issue 34).
Why      Everything this library catches (failed / raising / late loads, requests rolled back, pool
         keys finished as failed, stuck sends, saves shed, blocks held by open send events) is only
         in a log line or in ``status()`` inside the process. vLLM already carries connector stats
         from every worker to the scheduler (``KVOutputAggregator``), into its "KV Transfer
         metrics" log line (``KVConnectorLogging``) and onto /metrics (``KVConnectorProm``, called
         by ``PrometheusStatLogger``) -- for a connector that implements the three methods;
         AscendStoreConnector implements none of them.
How      The other groups bump plain counters in ``ascend_layerwise_patch.pool_events`` (a neutral
         module: a group never imports another group) where they act. Once per step every
         connector half drains its process's counts (one dict truth test when nothing happened)
         into an ``AscendPoolStats`` (``_pool_metrics_types``): a worker's travel to the scheduler
         in its ModelRunnerOutput and are summed over the TP workers by vLLM's aggregator; the
         scheduler half adds its own counts and the two send gauges (references held by open
         send events, open events; reported when they change). ``build_kv_connector_stats``
         rebuilds the stats for vLLM's log line (counts summed over the interval, gauges as the
         interval's peak); ``build_prom_metrics`` registers ``vllm:ascend_pool_*`` counters and
         gauges with vLLM's ``model_name`` / ``engine`` labels (the README and docs/metrics.md list them).
         Two figures come from the workers themselves: the age of the oldest stuck send (a gauge:
         send_integrity registers the stuck item with ``pool_events.watch_age``; every drain reads
         its live start, so it falls to 0 the step after the copy returns; max over TP workers) and
         the mamba state bytes loaded (a count bumped by loads.py when a layer's load copy returned 0).
         ``ASCEND_LAYERWISE_PATCH_SKIP=pool_metrics`` leaves the three methods as they are.
Removal  When AscendStoreConnector implements get_kv_connector_stats itself (detected: the group
         then skips itself; its figures would then be upstream's).
"""

from __future__ import annotations

import functools

from ... import pool_events
from .._checks import Group
from .._ranges import V025_026, V029_030
from .._checks import source as _source
from .._targets import STORE
from . import loads as _loads

CONNECTOR = f"{STORE}.ascend_store_connector:AscendStoreConnector"
_LAST = "_ascend_layerwise_patch_gauges"  # scheduler half: the gauges last reported


def _types():
    from . import stats_types as _pool_metrics_types

    return _pool_metrics_types


def _gauges(self, sched) -> dict[str, int] | None:
    """The scheduler's send gauges while any send event is open (every step: each log interval in
    which a send holds blocks shows them, also when nothing changed), zeros once when the last one
    closed, else None (nothing open, nothing open last time: the per-step path allocates nothing).

    Held blocks are only summed again when the set of open events changed (its size, oldest or newest
    id: events open and close as a whole, their block lists are not edited in place)."""
    events = sched.sending_events
    last = self.__dict__.get(_LAST)  # (events' mark, (held, open)) last reported
    if not events:
        if last is None or last[1] == (0, 0):
            return None
        self.__dict__[_LAST] = (None, (0, 0))
        return {"send_held_blocks": 0, "send_open_events": 0}
    mark = (len(events), next(iter(events)), next(reversed(events)))
    if last is not None and last[0] == mark:
        now = last[1]
    else:
        now = (sum(len(ids) for ids in sched.sending_blocks.values()), len(events))
        self.__dict__[_LAST] = (mark, now)
    return {"send_held_blocks": now[0], "send_open_events": now[1]}


def make_get_stats(original):
    # upstream's (KVConnectorBase_V1's) returns None: a step with nothing to report returns None too
    take = pool_events.take

    @functools.wraps(original)
    def get_kv_connector_stats(self):
        events = take()  # (counts, ages) or None
        sched = self.__dict__.get("connector_scheduler")
        gauges = _gauges(self, sched) if sched is not None else None
        if events is None:
            if gauges is None:
                return None
            return _types().AscendPoolStats(data={"counts": {}, "gauges": gauges})
        counts, ages = events
        return _types().AscendPoolStats(data={"counts": counts, "gauges": {**ages, **gauges} if gauges else ages})

    return get_kv_connector_stats


class _ClassMethod(classmethod):
    """A class method the registry can tag (``classmethod.__wrapped__`` is read-only)."""

    __wrapped__ = None


def make_build_stats(original):
    def build_kv_connector_stats(cls, data=None):
        data = data or {}  # copied: the accumulator vLLM's log line keeps adds into its own dicts
        return _types().AscendPoolStats(data={"counts": dict(data.get("counts", {})), "gauges": dict(data.get("gauges", {}))})

    return _ClassMethod(build_kv_connector_stats)


def make_build_prom(original):
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return _types().AscendPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    return _ClassMethod(build_prom_metrics)


# ----------------------------------------------------------------------------- checks on targets
def _connector():
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import ascend_store_connector

    return ascend_store_connector.AscendStoreConnector


def _defines(name: str):
    def check(_original) -> str | None:
        if name in vars(_connector()):
            return f"AscendStoreConnector defines {name} itself"
        return None

    return check


def _get_stats_ok(original) -> str | None:
    import inspect

    if list(inspect.signature(original).parameters) != ["self"]:
        return "get_kv_connector_stats takes more than self"
    from vllm.v1.core.sched.scheduler import Scheduler

    if "get_kv_connector_stats" not in _source(Scheduler.update_from_output):
        return "vLLM's scheduler no longer collects get_kv_connector_stats"
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import pool_scheduler

    init = _source(pool_scheduler.KVPoolScheduler.__init__)
    if "sending_events" not in init or "sending_blocks" not in init:
        return "KVPoolScheduler no longer keeps sending_events / sending_blocks"
    return None


def _classmethod_ok(params: list[str], caller: str, module: str):
    def check(original) -> str | None:
        import importlib
        import inspect

        func = getattr(original, "__func__", None)
        if func is None:
            return f"{original!r} is no longer a class method"
        got = list(inspect.signature(func).parameters)
        if got != params:
            return f"{func.__qualname__} parameters are {got}, expected {params}"
        if func.__name__ not in _source(importlib.import_module(module)):
            return f"{module} no longer calls {func.__name__} ({caller})"
        return None

    return check


_RECV = f"{STORE}.pool_worker:KVCacheStoreLayerRecvingThread"
_METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"

GROUP = Group(
    "pool_metrics",
    V025_026,
    risk="the pool's failures stay off /metrics and the KV-transfer log line",
    # vllm-ascend 0.30.0rc2 (vLLM 0.29 / 0.30): the same figures through its own connector stats
    ported_to=((V029_030, "group pool_metrics' *_030 members (pool_metrics/v030.py)"),),
)


SPECS = (
    GROUP.spec(
        "pool_metrics_stats",
        f"{CONNECTOR}.get_kv_connector_stats",
        make_get_stats,
        why="the pool's failure counts and send gauges travel as vLLM connector stats (all TP workers)",
        precondition=_get_stats_ok,
        fixed_upstream=_defines("get_kv_connector_stats"),
        counters=pool_events.pending,
    ),
    GROUP.spec(
        "pool_metrics_log",
        f"{CONNECTOR}.build_kv_connector_stats",
        make_build_stats,
        why="the same figures in vLLM's periodic KV-transfer log line",
        precondition=_classmethod_ok(["cls", "data"], "KVConnectorLogging", _METRICS),
        fixed_upstream=_defines("build_kv_connector_stats"),
    ),
    GROUP.spec(
        "pool_metrics_prom",
        f"{CONNECTOR}.build_prom_metrics",
        make_build_prom,
        why="vllm:ascend_pool_* counters and gauges on vLLM's /metrics (PrometheusStatLogger)",
        precondition=_classmethod_ok(
            ["cls", "vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"], "KVConnectorProm", _METRICS
        ),
        fixed_upstream=_defines("build_prom_metrics"),
    ),
    # worker (loads.py): the mamba state bytes a layer's successful load copy moved. The worker names
    # its mamba groups to its receiving thread; the thread's wrappers are stacked on load_failures'
    # (0.25; out of range on 0.26)
    GROUP.spec(
        "pool_metrics_mamba_groups",
        f"{STORE}.pool_worker:KVPoolWorker._build_shared_load_data",
        _loads.make_build_shared_load,
        why="the receiving thread learns which KV cache groups hold mamba (GDN) states",
        precondition=_loads.build_shared_ok,
        fixed_upstream=_defines("get_kv_connector_stats"),
    ),
    GROUP.spec(
        "pool_metrics_mamba_loads",
        f"{_RECV}._handle_request",
        _loads.make_recv_handle,
        why="the mamba state bytes each layerwise load copies from the pool (vllm:ascend_pool_mamba_state_bytes_loaded)",
        precondition=_loads.handle_ok,
        fixed_upstream=_defines("get_kv_connector_stats"),
        after=("load_fail_thread",),
    ),
    GROUP.spec(
        "pool_metrics_load_copy",
        f"{_RECV}._batch_copy_with_limits",
        _loads.make_batch_copy,
        why="those bytes are counted only when the layer's load copy returned success",
        precondition=_loads.copy_ok,
        fixed_upstream=_defines("get_kv_connector_stats"),
        after=("load_fail_copy",),
    ),
)
