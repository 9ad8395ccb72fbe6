"""The served hit split by source, scraped from the server's Prometheus /metrics.

Where the server exports loomserve_prefix_cache_hit_tokens_by_source_total (loomserve does;
llama-server and vLLM do not), /metrics is scraped before the first and after the last request
and the delta is reported per source (device, host, disk, mooncake/redis; see metrics.py).
Behind a router, `--metrics-url` lists the instances whose counters are summed.
The speculative-decoding counters (loomserve_spec_decode_*) are scraped the same way; their
delta gives the run's acceptance rate and mean acceptance length (`metrics.spec_decode`).

Invariants:
- a missing metric, a failed scrape or a counter that went back (a restart) gives None, never an
  error: the split is then simply absent from the result;
- counters are summed over model names and over instances.
"""

from __future__ import annotations

from loomserve.bench.replay.transport import Transport

__all__ = ["HIT_SOURCE_METRIC", "parse_hit_tokens_by_source", "scrape_hit_tokens_by_source",
           "counter_delta", "parse_spec_decode", "scrape_spec_decode", "spec_decode_summary"]


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
    return _summed(await _metrics_texts(transport, urls), parse_hit_tokens_by_source)


SPEC_DECODE_METRICS = {"drafts": "loomserve_spec_decode_num_drafts",
                       "draft_tokens": "loomserve_spec_decode_num_draft_tokens",
                       "accepted_tokens": "loomserve_spec_decode_num_accepted_tokens"}


def parse_spec_decode(text: str) -> dict[str, float] | None:
    """The speculative-decoding counters (drafts, draft_tokens, accepted_tokens) summed over
    model names; None when the server does not speculate or the text does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {v: k for k, v in SPEC_DECODE_METRICS.items()}
    out: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                key = names.get(sample.name.removesuffix("_total"))
                if key is not None:
                    out[key] = out.get(key, 0.0) + float(sample.value)
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return out if len(out) == len(names) else None


async def scrape_spec_decode(transport: Transport,
                             urls: list[str] | None = None) -> dict[str, float] | None:
    """parse_spec_decode over the endpoint's /metrics, or summed over `urls`."""
    return _summed(await _metrics_texts(transport, urls), parse_spec_decode)


def spec_decode_summary(delta: dict[str, float] | None) -> dict | None:
    """A run's counter deltas with vLLM's derived figures: the acceptance rate (accepted per
    draft token) and the mean acceptance length (tokens a verified step emits: 1 + accepted per
    draft)."""
    if not delta or not delta.get("drafts"):
        return None
    return {**delta,
            "acceptance_rate": delta["accepted_tokens"] / delta["draft_tokens"]
            if delta.get("draft_tokens") else None,
            "mean_acceptance_length": 1.0 + delta["accepted_tokens"] / delta["drafts"]}


def _summed(texts: list[str] | None, parse) -> dict[str, float] | None:
    if texts is None:
        return None
    total: dict[str, float] = {}
    for text in texts:
        part = parse(text)
        if part is None:
            return None
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + v
    return total


async def _metrics_texts(transport: Transport, urls: list[str] | None) -> list[str] | None:
    """The /metrics text of the endpoint, or of each of `urls`; None when a scrape fails."""
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
    return texts


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
