"""Per-tier counters and latency histograms in plain objects; Prometheus exposition optional.

The tiers update these from their worker threads; readers take `snapshot()`. The Prometheus
collector reads snapshots at scrape time, so no tier code imports prometheus_client.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)


@dataclass
class Histogram:
    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.total += v
        self.count += 1

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (inf past the last bound)."""
        if not self.count:
            return 0.0
        target = q * self.count
        run = 0
        for i, c in enumerate(self.counts):
            run += c
            if run >= target:
                return self.bounds[i] if i < len(self.bounds) else float("inf")
        return float("inf")

    def copy(self) -> "Histogram":
        return Histogram(self.bounds, list(self.counts), self.total, self.count)


_COUNTERS = ("hits", "misses", "errors", "timeouts", "corrupt", "stores", "store_fails",
             "store_drops", "evictions", "bytes_read", "bytes_written", "skipped_unhealthy")
_OPS = ("contains", "get", "put")


class TierStats:
    """hits/misses per key looked up or loaded; bytes moved; latency per batch op."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.latency = {op: Histogram() for op in _OPS}
        self.healthy = True

    def add(self, **deltas: int) -> None:
        with self._lock:
            c = self.counters
            for k, v in deltas.items():
                c[k] += v

    def observe(self, op: str, seconds: float) -> None:
        with self._lock:
            self.latency[op].observe(seconds)

    def __getattr__(self, name: str):
        c = self.__dict__.get("counters")
        if c is not None and name in c:
            return c[name]
        raise AttributeError(name)

    def snapshot(self) -> dict:
        with self._lock:
            return {"tier": self.name, "healthy": self.healthy, **self.counters,
                    "latency": {op: h.copy() for op, h in self.latency.items()}}

    def bandwidth(self, op: str = "get") -> float | None:
        """Observed bytes/s of `op` (get: bytes_read, put: bytes_written), None before any."""
        with self._lock:
            h = self.latency[op]
            moved = self.counters["bytes_read" if op == "get" else "bytes_written"]
            return moved / h.total if h.total > 0 and moved else None


def prometheus_collector(stats_source, prefix: str = "loomserve_tier"):
    """A prometheus_client Collector over `stats_source()` -> iterable of TierStats (e.g.
    `lambda: store.stats()`), for `registry.register(...)` by the server."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.registry import Collector

    class TierCollector(Collector):
        def collect(self):
            snaps = [s.snapshot() for s in stats_source()]
            for name in _COUNTERS:
                c = CounterMetricFamily(f"{prefix}_{name}", f"tier {name.replace('_', ' ')}",
                                        labels=["tier"])
                for s in snaps:
                    c.add_metric([s["tier"]], s[name])
                yield c
            g = GaugeMetricFamily(f"{prefix}_healthy", "1 when the tier is usable", labels=["tier"])
            for s in snaps:
                g.add_metric([s["tier"]], 1.0 if s["healthy"] else 0.0)
            yield g
            for op in _OPS:
                h = HistogramMetricFamily(f"{prefix}_{op}_seconds", f"tier {op} batch latency",
                                          labels=["tier"])
                for s in snaps:
                    hist = s["latency"][op]
                    run, buckets = 0, []
                    for b, c in zip(list(hist.bounds) + [float("inf")], hist.counts):
                        run += c
                        buckets.append((str(b) if b != float("inf") else "+Inf", run))
                    h.add_metric([s["tier"]], buckets, hist.total)
                yield h

    return TierCollector()
