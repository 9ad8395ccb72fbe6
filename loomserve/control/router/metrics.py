"""The router's Prometheus metrics, in a registry of its own (a process may hold several
routers in tests). Gauges of instance state are refreshed at each scrape (`refresh`)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from loomserve.kv.miss_causes import ALL_CAUSES

_P = "loomserve_router_"
OVERLAP_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
DECISION_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(_P + "requests", "Requests routed, by instance and by why it "
                                "went there (policies.REASONS)",
                                ["instance", "reason"], registry=r)
        self.overlap = Histogram(_P + "overlap_blocks", "Prompt blocks cached on the chosen "
                                 "instance, for requests whose prompt was looked up",
                                 ["instance"], buckets=OVERLAP_BUCKETS, registry=r)
        self.decision = Histogram(_P + "decision_seconds", "Time to choose an instance "
                                  "(tokenization, index lookup, cost)",
                                  buckets=DECISION_BUCKETS, registry=r)
        self.pd = Counter(_P + "pd_decisions", "Prefill/decode decisions: local (below the "
                          "threshold or no prefill instance), disaggregated, prefill_failed "
                          "(decode leg computed the prompt itself)", ["decision"], registry=r)
        self.errors = Counter(_P + "errors", "Requests that failed at the router, by kind",
                              ["kind"], registry=r)
        self.up = Gauge(_P + "instance_up", "1 while the instance passes health checks",
                        ["instance", "role"], registry=r)
        self.active_requests = Gauge(_P + "active_requests", "Requests in flight",
                                     ["instance"], registry=r)
        self.active_blocks = Gauge(_P + "active_blocks", "KV blocks held by requests in flight "
                                   "(router's estimate)", ["instance"], registry=r)
        self.active_blocks_avg = Gauge(_P + "active_blocks_avg", "Active blocks averaged over "
                                       "~30 s (what a sustained overload is judged on)",
                                       ["instance"], registry=r)
        self.cached_blocks = Gauge(_P + "indexed_blocks", "Blocks the KV index holds for the "
                                   "instance (from its KV events)", ["instance"], registry=r)
        self.sessions = Gauge(_P + "sessions", "Sessions the policy keeps a home for",
                              registry=r)
        # The instances' name: with the router's causes moved in (control.router.miss_causes).
        self.miss = Counter("loomserve_prefix_cache_miss_tokens", "Uncached prompt tokens of "
                            "relayed responses, by why they missed (the instance's causes, "
                            "with placed_elsewhere, session_moved and index_stale from the "
                            "router)", ["cause"], registry=r)
        for cause in ALL_CAUSES:
            self.miss.labels(cause)

    def refresh(self, instances, index, policy) -> None:
        for i in instances.instances:
            self.up.labels(i.name, i.role).set(1 if i.up else 0)
            self.active_requests.labels(i.name).set(i.active_requests)
            self.active_blocks.labels(i.name).set(i.active_blocks)
            self.active_blocks_avg.labels(i.name).set(i.load.average())
            self.cached_blocks.labels(i.name).set(index.blocks_of(i.name))
        self.sessions.set(policy.sessions())

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
