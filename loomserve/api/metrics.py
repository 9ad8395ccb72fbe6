"""Prometheus metrics, one registry per app.

Engine-side numbers (queue sizes, KV blocks, cumulative token counters, per-tier snapshots)
are read at scrape time from the latest stats the core sent (engine.stats()), so the core
never touches prometheus.
Latencies are only visible where tokens reach the client, so the server observes them.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "loomserve"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class EngineStatsCollector(Collector):
    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        s = self.engine.stats()
        labels, values = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_blocks_used", "KV cache blocks held by requests.", s.kv_blocks_used)
        yield gauge("kv_blocks_total", "KV cache blocks in the pool.", s.kv_blocks_total)
        yield gauge("kv_cache_usage_ratio", "Fraction of KV cache blocks held by requests.",
                    s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield counter("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_queried_tokens)
        yield counter("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                      s.prefix_hit_tokens)
        by_source = getattr(s, "prefix_hit_tokens_by_source", None) or \
            {"device": s.prefix_hit_tokens}
        c = CounterMetricFamily(f"{PREFIX}_prefix_cache_hit_tokens_by_source",
                                "Prompt tokens served from the prefix cache, by where the KV "
                                "came from: device, or the KV tier it was loaded from.",
                                labels=["model_name", "source"])
        for source, n in sorted(by_source.items()):
            c.add_metric([self.model_name, source], n)
        yield c
        yield counter("prompt_tokens", "Prefill tokens requested.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        yield counter("num_preemptions", "Requests preempted to free KV cache.",
                      s.num_preemptions)
        c = CounterMetricFamily(f"{PREFIX}_num_preemptions_by_cause",
                                "Requests preempted to free KV cache, by cause: decode_blocks "
                                "(a decode step found no block), prefill_blocks (a prefill "
                                "chunk found none).", labels=["model_name", "cause"])
        causes = {"decode_blocks": 0, "prefill_blocks": 0,
                  **(getattr(s, "num_preemptions_by_cause", None) or {})}
        for cause, n in sorted(causes.items()):
            c.add_metric([self.model_name, cause], n)
        yield c
        yield gauge("target_step_seconds", "Step-time target of the latest step (0: none).",
                    getattr(s, "target_step_ms", 0.0) / 1000.0)
        q = GaugeMetricFamily(f"{PREFIX}_step_cost_relative_error",
                              "Step cost model: relative error of the predicted step time over "
                              "recent steps, by quantile.", labels=["model_name", "quantile"])
        q.add_metric([self.model_name, "0.5"], getattr(s, "step_cost_error_p50", 0.0))
        q.add_metric([self.model_name, "0.9"], getattr(s, "step_cost_error_p90", 0.0))
        yield q
        yield counter("step_cost_samples", "Steps the step cost model learned from.",
                      getattr(s, "step_cost_samples", 0))
        yield counter("num_requests_rejected", "Requests refused with HTTP 429 because the "
                      "waiting queue was full (--max-waiting-requests).", s.num_rejected)


class _TierSnapshot:
    """A tier's snapshot as shipped by the core, shaped like TierStats for the collector."""

    def __init__(self, snap: dict) -> None:
        from loomserve.kv.tiers.stats import Histogram
        self._snap = {**snap, "latency": {op: Histogram(tuple(h["bounds"]), list(h["counts"]),
                                                        h["total"], h["count"])
                                          for op, h in snap["latency"].items()}}

    def snapshot(self) -> dict:
        return self._snap


def tier_stats(stats) -> list[_TierSnapshot]:
    return [_TierSnapshot(s) for s in stats.tier_snapshots]


class ServerMetrics:
    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(engine, model_name))
        if engine.ready.tier_names:  # per tier: hits, misses, bytes moved, latency, health
            from loomserve.kv.tiers import prometheus_collector
            self.registry.register(prometheus_collector(lambda: tier_stats(engine.stats()),
                                                        prefix=f"{PREFIX}_tier"))
        self.model_name = model_name
        r = engine.ready  # the KV pool's shape, as vLLM's cache_config_info gives it
        Gauge(f"{PREFIX}_cache_config_info", "The KV cache's configuration (value 1): block "
              "size, the pages' dtype, and the blocks and tokens the pool holds.",
              labelnames=["model_name", "block_size", "cache_dtype", "num_blocks",
                          "capacity_tokens"], registry=self.registry).labels(
            model_name, str(r.block_size), r.kv_cache_dtype, str(r.kv_blocks_total),
            str(r.kv_capacity_tokens)).set(1)
        kw = dict(labelnames=["model_name"], registry=self.registry)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time from request arrival to the first output token.",
                              buckets=_LATENCY_BUCKETS, **kw).labels(model_name)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Time between consecutive output tokens as they stream out.",
                             buckets=_LATENCY_BUCKETS, **kw).labels(model_name)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "Time from request arrival to its last token.",
                             buckets=_E2E_BUCKETS, **kw).labels(model_name)
        self._finished = Counter(f"{PREFIX}_request_success",
                                 "Requests finished, by finish reason.",
                                 labelnames=["model_name", "finished_reason"],
                                 registry=self.registry)

    def tracker(self) -> "RequestTimer":
        return RequestTimer(self)

    def finished(self, reason: str | None) -> None:
        self._finished.labels(self.model_name, reason or "unknown").inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Observes one request's latencies as its outputs reach the server."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.last: float | None = None

    def on_output(self, num_new_tokens: int, finished: bool, finish_reason: str | None) -> None:
        now = time.monotonic()
        if num_new_tokens > 0:
            if self.last is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                gap = (now - self.last) / num_new_tokens
                for _ in range(num_new_tokens):
                    self.metrics.itl.observe(gap)
            self.last = now
        if finished:
            self.metrics.e2e.observe(now - self.arrival)
            self.metrics.finished(finish_reason)
