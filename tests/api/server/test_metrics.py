"""/metrics: engine gauges and counters read at scrape time, latency histograms from the server."""

import re

import httpx

NAMES = [
    "loomserve_num_requests_running", "loomserve_num_requests_waiting",
    "loomserve_kv_blocks_used", "loomserve_kv_blocks_total",
    "loomserve_prefix_cache_queried_tokens_total", "loomserve_prefix_cache_hit_tokens_total",
    "loomserve_prompt_tokens_total", "loomserve_generation_tokens_total",
    "loomserve_num_preemptions_total",
    "loomserve_time_to_first_token_seconds_count", "loomserve_inter_token_latency_seconds_count",
    "loomserve_e2e_request_latency_seconds_count",
]


def scrape(server) -> dict[str, float]:
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for line in r.text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if m and 'le="' not in (m.group(2) or ""):
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return values


def test_metrics_present_and_counting(client, server):
    before = scrape(server)
    missing = [n for n in NAMES if n not in before]
    assert not missing, missing
    assert before["loomserve_kv_blocks_total"] > 0
    prompt = list(range(10, 10 + 3 * server.engine.config.cache.block_size + 1))
    for _ in range(2):
        client.completions.create(model=server.model, prompt=prompt, max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    # 32 streamed tokens: the output path may coalesce tokens that arrive together, and with 5
    # all of them once arrived in one chunk (no inter-token gap observed: a flaky count).
    list(client.completions.create(model=server.model, prompt="streamed", max_tokens=32,
                                   stream=True, extra_body={"ignore_eos": True}))
    server.wait_idle()
    after = scrape(server)
    assert after["loomserve_prompt_tokens_total"] >= before["loomserve_prompt_tokens_total"] + 2 * len(prompt)
    assert after["loomserve_generation_tokens_total"] >= before["loomserve_generation_tokens_total"] + 15
    assert after["loomserve_prefix_cache_queried_tokens_total"] > before["loomserve_prefix_cache_queried_tokens_total"]
    assert after["loomserve_prefix_cache_hit_tokens_total"] > before["loomserve_prefix_cache_hit_tokens_total"]
    for h in ("time_to_first_token", "e2e_request_latency"):
        assert after[f"loomserve_{h}_seconds_count"] == before[f"loomserve_{h}_seconds_count"] + 3
    assert after["loomserve_inter_token_latency_seconds_count"] >= before["loomserve_inter_token_latency_seconds_count"] + 1
    assert after["loomserve_request_success_total"] >= before.get("loomserve_request_success_total", 0) + 3
    assert after["loomserve_num_requests_running"] == 0 and after["loomserve_kv_blocks_used"] == 0


def test_cache_config_info_names_the_pages_dtype():
    """loomserve_cache_config_info (as vLLM's cache_config_info): value 1, labels giving the
    block size, the resolved KV dtype and the pool's size; a bf16 cache under fp32 weights says
    bfloat16 and holds twice the blocks of the same --kv-cache-memory."""
    from tests.api.server.conftest import running_server

    blocks = {}
    for kvd in ("auto", "bfloat16"):
        with running_server(kv_cache_dtype=kvd) as srv:
            text = httpx.get(srv.url + "/metrics").text
            line = next(ln for ln in text.splitlines() if ln.startswith("loomserve_cache_config_info{"))
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            assert line.endswith(" 1.0") and labels["block_size"] == str(srv.engine.ready.block_size)
            assert labels["cache_dtype"] == ("float32" if kvd == "auto" else "bfloat16")
            blocks[kvd] = int(labels["num_blocks"])
            assert int(labels["capacity_tokens"]) == blocks[kvd] * int(labels["block_size"])
    assert blocks["bfloat16"] == 2 * blocks["auto"]
