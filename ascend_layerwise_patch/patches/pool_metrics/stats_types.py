"""The ``pool_metrics`` group's KVConnectorStats and KVConnectorPromMetrics subclasses.

Imported only by that group's replacements (it imports vLLM's metrics module, and with it
prometheus_client). At module level so that a worker's stats pickle by name on their way to the
scheduler process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

#: gauge keys: aggregated by max (over TP workers, the scheduler; over a log interval: the peak)
GAUGES = ("send_held_blocks", "send_open_events", "oldest_stuck_send_age_seconds")

#: (counter key or keys -> label value, metric name, help). ``vllm:`` + name, engine label as vLLM's.
COUNTERS = (
    (
        {"load_failed": "failed", "load_raised": "raised", "load_late": "late"},
        "vllm:ascend_pool_load_failures",
        "Layerwise KV pool loads that failed, by kind: failed (the store returned an error), raised "
        "(the store raised), late (a layer's load wait timed out); counted per worker copy / wait.",
    ),
    ("requests_rolled_back", "vllm:ascend_pool_requests_rolled_back",
     "Requests preempted to recompute from the longest resumable prefix after a failed KV pool load."),
    ("pool_keys_failed", "vllm:ascend_pool_keys_failed",
     "Pool keys finished as failed instead of published (a layer copy missing or raised, or the "
     "step's load failed)."),
    ("stuck_sends", "vllm:ascend_pool_stuck_sends",
     "Layerwise KV sends found still in flight past save_kv_layer's wait (their blocks stay held)."),
    ("saves_shed", "vllm:ascend_pool_saves_shed",
     "Request saves to the KV pool shed because the send backlog passed its bound."),
    ("tokens_recomputed", "vllm:ascend_pool_tokens_recomputed",
     "Tokens computed again by requests rolled back after a failed KV pool load."),
    ("hits_cut_back", "vllm:ascend_pool_hits_cut_back",
     "Layerwise pool hit checks cut back to the last block where every mamba group's state is saved."),
    ("mamba_state_bytes_loaded", "vllm:ascend_pool_mamba_state_bytes_loaded",
     "Bytes of mamba (GDN state) blocks copied from the KV pool to the device by layerwise loads that "
     "succeeded, summed over TP workers (each loads its own share)."),
)
GAUGE_HELP = {
    "send_held_blocks": ("vllm:ascend_pool_send_held_blocks",
                         "Block references held by open layerwise KV pool send events (scheduler)."),
    "send_open_events": ("vllm:ascend_pool_send_open_events",
                         "Layerwise KV pool send events not yet reported complete by every worker."),
    "oldest_stuck_send_age_seconds": (
        "vllm:ascend_pool_oldest_stuck_send_age_seconds",
        "Seconds the oldest layerwise KV send still in flight past save_kv_layer's wait has been in flight "
        "(its blocks stay held); max over TP workers; 0 when no send is stuck."),
}


@dataclass
class AscendPoolStats(KVConnectorStats):
    """``data``: ``{"counts": {key: int}, "gauges": {key: number}}``. Counts add up (over TP workers and
    over a log interval); gauges (the scheduler's send gauges, the workers' stuck-send age) aggregate
    by max."""

    def __post_init__(self):
        self.data.setdefault("counts", {})
        self.data.setdefault("gauges", {})

    def reset(self):
        self.data = {"counts": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is None or other is self:
            return self
        counts, gauges = self.data["counts"], self.data["gauges"]
        for key, n in other.data.get("counts", {}).items():
            counts[key] = counts.get(key, 0) + n
        for key, v in other.data.get("gauges", {}).items():
            gauges[key] = max(gauges.get(key, v), v)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, n in sorted(self.data["counts"].items()):
            out[key] = n
        for key, v in sorted(self.data["gauges"].items()):
            out[key + "_peak"] = v
        return out

    def is_empty(self) -> bool:
        return not self.data["counts"] and not self.data["gauges"]


class AscendPoolPromMetrics(KVConnectorPromMetrics):
    """One Counter per figure (load failures with a ``kind`` label) and the send gauges, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}  # count key -> engine -> labelled child
        for keys, name, doc in COUNTERS:
            if isinstance(keys, dict):
                metric = self._counter_cls(name=name, documentation=doc, labelnames=[*labelnames, "kind"])
                for key, kind in keys.items():
                    self._counters[key] = {
                        idx: metric.labels(*values, kind) for idx, values in per_engine_labelvalues.items()
                    }
            else:
                metric = self._counter_cls(name=name, documentation=doc, labelnames=list(labelnames))
                self._counters[keys] = {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}
        self._gauges: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in GAUGE_HELP.items():
            metric = self._gauge_cls(name=name, documentation=doc, labelnames=list(labelnames), multiprocess_mode="mostrecent")
            self._gauges[key] = {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, n in transfer_stats_data.get("counts", {}).items():
            per_engine = self._counters.get(key)
            if per_engine is not None and n:
                per_engine[engine_idx].inc(n)
        for key, v in transfer_stats_data.get("gauges", {}).items():
            per_engine = self._gauges.get(key)
            if per_engine is not None:
                per_engine[engine_idx].set(v)
