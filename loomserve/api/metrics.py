"""Prometheus metrics, one registry per app.

Engine-side numbers (queue sizes, KV blocks, cumulative token counters, per-tier snapshots)
are read at scrape time from the latest stats the core sent (engine.stats()), so the core
never touches prometheus.
Latencies are only visible where tokens reach the client, so the server observes them.
Every family is also exported under vLLM's name (vllm_metrics.py); a finished request's
timing feeds those histograms, its trace (tracing.py) and the request log.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

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

from loomserve.api.vllm_metrics import VLLMRequestMetrics, VLLMStatsCollector
from loomserve.kv.miss_causes import CAUSES

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
        yield from self.spec_decode(s, counter)

    def spec_decode(self, s, counter):
        """vLLM's spec_decode_* families, only when the engine speculates."""
        per_pos = getattr(s, "spec_decode_num_accepted_tokens_per_pos", None)
        if not per_pos:
            return
        yield counter("spec_decode_num_drafts", "Speculative decoding: drafts verified (one "
                      "request's drafts in one step).", s.spec_decode_num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens "
                      "verified.", s.spec_decode_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens "
                      "accepted.", s.spec_decode_num_accepted_tokens)
        c = CounterMetricFamily(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
                                "Speculative decoding: draft tokens accepted, by position in "
                                "the draft (0: the first).", labels=["model_name", "position"])
        for pos, n in enumerate(per_pos):
            c.add_metric([self.model_name, str(pos)], n)
        yield c


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
        self.registry.register(VLLMStatsCollector(engine, model_name))
        self.vllm = VLLMRequestMetrics(self.registry, model_name, engine.max_model_len)
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
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              labelnames=["block_size", "cache_dtype", "num_gpu_blocks", "engine"],
              registry=self.registry).labels(str(r.block_size), r.kv_cache_dtype,
                                             str(r.kv_blocks_total), "0").set(1)
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
        self._miss = Counter(f"{PREFIX}_prefix_cache_miss_tokens",
                             "Uncached prompt tokens of finished requests, by why they missed "
                             "(loomserve.kv.miss_causes); they sum to prompt - cached tokens.",
                             labelnames=["model_name", "cause"], registry=self.registry)
        for cause in CAUSES:  # present at 0, so dashboards see every series
            self._miss.labels(model_name, cause)

    def tracker(self, request_id: str | None = None, *, session_id: str | None = None,
                max_tokens: int | None = None, n: int = 1, trace=None) -> "RequestTimer":
        return RequestTimer(self, request_id, session_id=session_id, max_tokens=max_tokens,
                            n=n, trace=trace)

    def finished(self, reason: str | None) -> None:
        self._finished.labels(self.model_name, reason or "unknown").inc()

    def missed(self, causes: dict[str, int]) -> None:
        for cause, tokens in causes.items():
            self._miss.labels(self.model_name, cause).inc(tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


request_log = logging.getLogger("loomserve.requests")


@dataclass
class RequestTiming:
    """One finished request, as the server saw it (seconds). queue_s: the core's wait before
    admission (on a decode leg it holds the KV pull); prefill_s: admission to the first token;
    decode_s: first token to the last; prefill_s + queue_s + decode_s == e2e_s."""

    arrival_ns: int  # wall clock, for spans
    e2e_s: float
    queue_s: float
    prefill_s: float
    decode_s: float
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    tier_cached_tokens: int
    output_tokens: int
    max_tokens: int | None
    n: int


class RequestTimer:
    """Observes one request's latencies as its outputs reach the server; at its finished output,
    records it once: vLLM's histograms, its trace (when traced), a request log line."""

    def __init__(self, metrics: ServerMetrics, request_id: str | None = None, *,
                 session_id: str | None = None, max_tokens: int | None = None, n: int = 1,
                 trace=None) -> None:
        self.metrics = metrics
        self.request_id, self.session_id = request_id, session_id
        self.max_tokens, self.n, self.trace = max_tokens, n, trace
        self.arrival = time.monotonic()
        self.arrival_ns = time.time_ns()
        self.first: float | None = None
        self.last: float | None = None
        self.done = False
        self.divergence = None  # api.prompt_diff.Divergence from the session's last prompt

    def observe(self, out) -> None:
        """One RequestOutput as it reached the server."""
        self.on_output(len(out.new_token_ids), out.finished, out.finish_reason)
        if out.finished and not self.done:
            self.done = True
            self._record(out)

    def on_output(self, num_new_tokens: int, finished: bool, finish_reason: str | None) -> None:
        now = time.monotonic()
        m = self.metrics
        if num_new_tokens > 0:
            if self.last is None:
                self.first = now
                m.ttft.observe(now - self.arrival)
                m.vllm.tokens(num_new_tokens, None)
            else:
                gap = (now - self.last) / num_new_tokens
                for _ in range(num_new_tokens):
                    m.itl.observe(gap)
                m.vllm.tokens(num_new_tokens, now - self.last)
            self.last = now
        if finished:
            self.end = now
            m.e2e.observe(now - self.arrival)
            m.finished(finish_reason)

    def timing(self, out) -> RequestTiming:
        e2e = self.end - self.arrival
        first = self.first if self.first is not None else self.end
        queue = min(max(out.queued_s or 0.0, 0.0), first - self.arrival)
        return RequestTiming(
            self.arrival_ns, e2e, queue, first - self.arrival - queue, self.end - first,
            None if self.first is None else self.first - self.arrival,
            len(out.prompt_token_ids), out.num_cached_tokens, out.num_tier_cached_tokens,
            len(out.token_ids), self.max_tokens, self.n)

    def _log_miss(self, t: RequestTiming, miss: dict, detail: dict) -> None:
        """The debug-level line: why the uncached prompt tokens missed, and where the prompt
        stopped extending the session's previous one (text side)."""
        div = self.divergence.as_dict() if self.divergence is not None else None
        request_log.debug(
            "request %s missed %d prompt tokens: %s %s%s", self.request_id,
            t.prompt_tokens - t.cached_tokens, miss, detail,
            "" if div is None else f" prompt diverged: {div}", extra={
                "request_id": self.request_id, "session_id": self.session_id,
                "miss_causes": miss, "miss_detail": detail, "prompt_divergence": div})

    def _record(self, out) -> None:
        t = self.timing(out)
        self.metrics.vllm.finished(t, out.finish_reason)
        miss = getattr(out, "miss_causes", None)
        if miss:
            self.metrics.missed(miss)
            if request_log.isEnabledFor(logging.DEBUG):
                self._log_miss(t, miss, getattr(out, "miss_detail", None) or {})
        if self.trace is not None:
            self.trace.finish(t, out)
        if request_log.isEnabledFor(logging.INFO):
            request_log.info(
                "request %s finished (%s): prompt %d tokens (%d cached), output %d tokens, "
                "%.3f s", self.request_id, out.finish_reason, t.prompt_tokens, t.cached_tokens,
                t.output_tokens, t.e2e_s, extra={
                    "request_id": self.request_id, "session_id": self.session_id,
                    "finish_reason": out.finish_reason, "prompt_tokens": t.prompt_tokens,
                    "cached_tokens": t.cached_tokens, "output_tokens": t.output_tokens,
                    "latency_s": round(t.e2e_s, 6),
                    "ttft_s": None if t.ttft_s is None else round(t.ttft_s, 6)})
