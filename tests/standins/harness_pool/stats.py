"""Connector stats as vLLM's front end sees them (issue 26): :class:`StatsTap`."""

from __future__ import annotations

from .instance import PoolInstance


class StatsTap:
    """Turns ``inst``'s scheduler's ``log_stats`` on and hands every ``SchedulerStats`` its
    ``update_from_output`` makes to vLLM's own loggers: a ``PrometheusStatLogger`` whose metrics live
    in a registry of their own (``self.registry``, never vLLM's global one) and the
    ``KVConnectorLogging`` behind the "KV Transfer metrics" log line (``log_lines()``)."""

    def __init__(self, inst: PoolInstance):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
        from vllm.v1.metrics.loggers import PrometheusStatLogger
        from vllm.v1.metrics.stats import PrefixCacheStats

        self.registry = registry = CollectorRegistry()

        def own(cls):
            def __init__(self, *args, **kwargs):
                kwargs["registry"] = registry
                cls.__init__(self, *args, **kwargs)

            return type(cls.__name__, (cls,), {"__init__": __init__})

        metric = {"_gauge_cls": own(Gauge), "_counter_cls": own(Counter), "_histogram_cls": own(Histogram)}
        prom_cls = type("OwnKVConnectorProm", (KVConnectorProm,), dict(metric))
        logger_cls = type("OwnPrometheusStatLogger", (PrometheusStatLogger,), {**metric, "_kv_connector_cls": prom_cls})
        cfg = inst.configs[0]
        self.prom = logger_cls(cfg)
        self.logging = KVConnectorLogging(cfg.kv_transfer_config)
        self.stats: list = []  # every SchedulerStats, in order
        self.lines: list[str] = []
        sched = inst.scheduler
        sched.log_stats = True
        sched.kv_cache_manager.log_stats = True
        sched.kv_cache_manager.prefix_cache_stats = PrefixCacheStats()
        update = sched.update_from_output

        def update_from_output(scheduler_output, model_runner_output):
            outputs = update(scheduler_output, model_runner_output)
            for out in outputs.values():
                if out.scheduler_stats is not None:
                    self.stats.append(out.scheduler_stats)
                    self.prom.record(out.scheduler_stats, None, engine_idx=0)
                    if out.scheduler_stats.kv_connector_stats:
                        self.logging.observe(out.scheduler_stats.kv_connector_stats)
            return outputs

        sched.update_from_output = update_from_output

    def log_lines(self) -> list[str]:
        """Log the interval's "KV Transfer metrics" line as vLLM's LoggingStatLogger.log does; every line so far."""
        self.logging.log(log_fn=lambda fmt, *args: self.lines.append(fmt % args))
        return self.lines

    def scrape(self, prefix: str = "vllm:") -> dict[str, float]:
        """``generate_latest`` of the own registry: ``{'name{labels}': value}`` for samples under ``prefix``."""
        from prometheus_client import generate_latest

        out = {}
        for line in generate_latest(self.registry).decode().splitlines():
            if line.startswith(prefix):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out
