"""The served hit split by source, scraped from the server's Prometheus /metrics.

Where the server exports loomserve_prefix_cache_hit_tokens_by_source_total (loomserve does;
llama-server and vLLM do not), /metrics is scraped before the first and after the last request
and the delta is reported per source (device, host, disk, mooncake/redis; see metrics.py).
Behind a router, `--metrics-url` lists the instances whose counters are summed.

Invariants:
- a missing metric, a failed scrape or a counter that went back (a restart) gives None, never an
  error: the split is then simply absent from the result;
- counters are summed over model names and over instances.
"""

from __future__ import annotations

from loomserve.bench.replay.transport import Transport

__all__ = ["HIT_SOURCE_METRIC", "parse_hit_tokens_by_source", "scrape_hit_tokens_by_source",
           "counter_delta"]


HIT_SOURCE_METRIC = "loomserve_prefix_cache_hit_tokens_by_source"


def parse_hit_tokens_by_source(text: str) -> dict[str, float] | None:
    """Prompt tokens served from the prefix cache per source ({"device": .., "host": ..}), summed
    over model names, from Prometheus text; None when the metric is not there (not loomserve)
    or the text does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] | None = None
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name != HIT_SOURCE_METRIC:
                continue
            for sample in fam.samples:
                source = sample.labels.get("source")
                if source is None or sample.name not in (HIT_SOURCE_METRIC + "_total",
                                                         HIT_SOURCE_METRIC):
                    continue  # e.g. a _created sample
                out = out if out is not None else {}
                out[source] = out.get(source, 0.0) + float(sample.value)
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return out


async def scrape_hit_tokens_by_source(transport: Transport,
                                      urls: list[str] | None = None) -> dict[str, float] | None:
    """The hit-token counters of the endpoint's /metrics, or summed over `urls` (the instances
    behind a router: each URL is a server root or its /metrics). None when any scrape fails or
    lacks the metric."""
    texts: list[str] = []
    try:
        if not urls:
            status, body = await transport.request_json("GET", "/metrics")
            if status != 200 or not isinstance(body, str):
                return None
            texts.append(body)
        else:
            import httpx

            async with httpx.AsyncClient(timeout=10.0) as client:
                for url in urls:
                    url = url.rstrip("/")
                    resp = await client.get(url if url.endswith("/metrics") else url + "/metrics")
                    if resp.status_code != 200:
                        return None
                    texts.append(resp.text)
    except Exception:  # noqa: BLE001 - no metrics is not an error of the replay
        return None
    total: dict[str, float] = {}
    for text in texts:
        part = parse_hit_tokens_by_source(text)
        if part is None:
            return None
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + v
    return total


def counter_delta(before: dict[str, float] | None,
                  after: dict[str, float] | None) -> dict[str, float] | None:
    """after - before per source; None when either is missing or a counter went back (the
    server restarted meanwhile)."""
    if before is None or after is None:
        return None
    out = {k: v - before.get(k, 0.0) for k, v in after.items()}
    if any(v < 0 for v in out.values()) or any(k not in after for k in before):
        return None
    return out
