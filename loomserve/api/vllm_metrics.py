"""The `vllm:` metric families, beside loomserve's own, so vLLM's Grafana dashboard, llm-d's
scorers and Dynamo's planner read a loomserve instance unchanged.

Names, types, labels (model_name, engine) and bucket edges are vLLM v1's
(vllm/v1/metrics/loggers.py); prometheus_client appends `_total` to counters as vLLM's does,
so `vllm:prompt_tokens` is scraped as `vllm:prompt_tokens_total`. Colons are legal in
Prometheus metric names (reserved for recording rules by convention, which vLLM ignores).
Engine-wide numbers come from the core's stats snapshot at scrape time; per-request ones
(latencies, token counts) are observed by the server when a request finishes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

V = "vllm:"
LABELS = ["model_name", "engine"]
ENGINE = "0"  # one engine index: data-parallel cores report one aggregated snapshot

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)

# Spec-decode counters: the core's stats fields, named as vLLM's families.
SPEC_DECODE = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
               "spec_decode_num_accepted_tokens")


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class VLLMStatsCollector(Collector):
    """Engine-wide `vllm:` gauges and counters from engine.stats() at each scrape."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.values = [model_name, ENGINE]

    def _family(self, cls, name: str, doc: str, value: float):
        f = cls(V + name, doc, labels=LABELS)
        f.add_metric(self.values, value)
        return f

    def collect(self):
        s = self.engine.stats()
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(g, "num_requests_running", "Number of requests in model execution "
                           "batches.", s.num_running)
        yield self._family(g, "num_requests_waiting", "Number of requests waiting to be "
                           "processed.", s.num_waiting)
        yield self._family(g, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent "
                           "usage.", usage)
        yield self._family(g, "gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent "
                           "usage. DEPRECATED: use vllm:kv_cache_usage_perc.", usage)
        yield self._family(c, "prefix_cache_queries", "Prefix cache queries, in terms of "
                           "number of queried tokens.", s.prefix_queried_tokens)
        yield self._family(c, "prefix_cache_hits", "Prefix cache hits, in terms of number of "
                           "cached tokens.", s.prefix_hit_tokens)
        yield self._family(c, "num_preemptions", "Cumulative number of preemption from the "
                           "engine.", s.num_preemptions)
        yield self._family(c, "prompt_tokens", "Number of prefill tokens processed.",
                           s.prompt_tokens)
        yield self._family(c, "generation_tokens", "Number of generation tokens processed.",
                           s.generation_tokens)
        yield from self._spec_decode(s)

    def _spec_decode(self, s):
        """vLLM's spec-decode counters, beside loomserve_spec_decode_*: only when the engine
        speculates (its per-position list is non-empty)."""
        per_pos = getattr(s, "spec_decode_num_accepted_tokens_per_pos", None)
        if not per_pos:
            return
        for name in SPEC_DECODE:
            yield self._family(CounterMetricFamily, name, "Speculative decoding: "
                               f"{name.removeprefix('spec_decode_').replace('_', ' ')}.",
                               getattr(s, name, 0))
        f = CounterMetricFamily(V + "spec_decode_num_accepted_tokens_per_pos",
                                "Accepted draft tokens, by draft position.",
                                labels=LABELS + ["position"])
        for pos, n in enumerate(per_pos):
            f.add_metric(self.values + [str(pos)], n)
        yield f


class Renamed(Collector):
    """Another metric's samples under a second name (its suffixes kept)."""

    def __init__(self, source, name: str, doc: str) -> None:
        self.source, self.name, self.doc = source, name, doc

    def collect(self):
        for fam in self.source.collect():
            out = Metric(self.name, self.doc, fam.type)
            for s in fam.samples:
                out.add_sample(self.name + s.name[len(fam.name):], s.labels, s.value,
                               s.timestamp, s.exemplar)
            yield out


class VLLMRequestMetrics:
    """Per-request `vllm:` histograms and the finished-request counter."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        kw = dict(labelnames=LABELS, registry=registry)
        values = (model_name, ENGINE)
        tokens = buckets_1_2_5(max(1, max_model_len))

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(V + name, doc, buckets=buckets, **kw).labels(*values)

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in "
                         "seconds.", TTFT_BUCKETS)
        itl = Histogram(V + "inter_token_latency_seconds", "Histogram of inter-token latency "
                        "in seconds.", buckets=TPOT_BUCKETS, **kw)
        self.itl = itl.labels(*values)
        # The same observations as vllm:time_per_output_token_seconds (vLLM's older name, which
        # its dashboard reads): renamed at scrape time, not observed twice per token.
        registry.register(Renamed(itl, V + "time_per_output_token_seconds",
                                  "Histogram of time per output token in seconds (per token, "
                                  "as vllm:inter_token_latency_seconds)."))
        self.request_tpot = hist("request_time_per_output_token_seconds", "Histogram of "
                                 "time_per_output_token_seconds per request.", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of e2e request latency in "
                        "seconds.", REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Histogram of time spent in WAITING "
                          "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "Histogram of time spent in "
                              "RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Histogram of time spent in PREFILL "
                            "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Histogram of time spent in DECODE "
                           "phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens "
                                  "processed.", tokens)
        self.generation_tokens = hist("request_generation_tokens", "Number of generation tokens "
                                      "processed.", tokens)
        self.max_tokens = hist("request_params_max_tokens", "Histogram of the max_tokens "
                               "request parameter.", tokens)
        self.n = hist("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self._success = Counter(V + "request_success", "Count of successfully processed "
                                "requests.", labelnames=LABELS + ["finished_reason"],
                                registry=registry)
        self._values = values

    def tokens(self, num_new: int, gap_s: float | None) -> None:
        """num_new tokens reached the client, gap_s after the previous ones (None: first)."""
        if gap_s is None:
            return
        per_token = gap_s / num_new
        for _ in range(num_new):
            self.itl.observe(per_token)

    def finished(self, t, finish_reason: str | None) -> None:
        """One finished request's timing (metrics.RequestTiming)."""
        self._success.labels(*self._values, finish_reason or "unknown").inc()
        self.e2e.observe(t.e2e_s)
        self.queue.observe(t.queue_s)
        self.prefill.observe(t.prefill_s)
        self.decode.observe(t.decode_s)
        self.inference.observe(t.prefill_s + t.decode_s)
        if t.ttft_s is not None:
            self.ttft.observe(t.ttft_s)
        if t.output_tokens > 1:
            self.request_tpot.observe(t.decode_s / (t.output_tokens - 1))
        self.prompt_tokens.observe(t.prompt_tokens)
        self.generation_tokens.observe(t.output_tokens)
        if t.max_tokens is not None:
            self.max_tokens.observe(t.max_tokens)
        if t.n:  # 0: a sibling sample of an n > 1 request (sample 0 records n)
            self.n.observe(t.n)
