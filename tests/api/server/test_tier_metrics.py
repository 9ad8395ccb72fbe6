"""/metrics with KV tiers: per-tier counters and health, and prefix hits split by source."""

import random

import httpx

from tests.api.server.conftest import running_server
from tests.api.server.test_metrics import scrape

PAGE = 8192  # tiny-llama, float32, 16-token blocks


def labelled(server, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].split("} ")
            out[labels] = float(value)
    return out


def complete(server, prompt):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"model": server.model, "prompt": prompt, "max_tokens": 4,
                         "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_tier_metrics_and_hits_by_source():
    rng = random.Random(3)
    a = [rng.randrange(3, 400) for _ in range(100)]
    others = [[rng.randrange(3, 400) for _ in range(100)] for _ in range(4)]
    with running_server(kv_cache_memory=str(16 * PAGE), host_cache_memory=str(64 * PAGE)) as srv:
        assert srv.engine.ready.tier_names == ["host"]
        first = complete(srv, a)
        for p in others:
            complete(srv, p)
        again = complete(srv, a)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        srv.wait_idle()
        values = scrape(srv)
        for name in ("loomserve_tier_hits_total", "loomserve_tier_misses_total",
                     "loomserve_tier_bytes_read_total", "loomserve_tier_bytes_written_total",
                     "loomserve_tier_healthy", "loomserve_tier_get_seconds_count"):
            assert name in values, name
        by_source = labelled(srv, "loomserve_prefix_cache_hit_tokens_by_source_total")
        host = [v for k, v in by_source.items() if 'source="host"' in k]
        assert host == [96.0]
        assert sum(by_source.values()) <= values["loomserve_prefix_cache_hit_tokens_total"]
        assert labelled(srv, "loomserve_tier_healthy") == {'tier="host"': 1.0}
