"""The served hit rate split by source (device, host tier, ...) in `bench agentx` results:
scraped from the server's /metrics before and after the replay. Against a real loomserve
server with a host tier and a device pool too small for the live sessions, and absent (no
error) against a server without the metric."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from loomserve.bench import replay as replay_mod
from loomserve.bench import report
from loomserve.bench.metrics import RequestRecord, compute_metrics
from loomserve.bench.trace import load_traces
from tests.api.server.conftest import running_server

PAGE = 8192  # tiny-llama, float32, 16-token blocks: bytes per block


def weka(sid: str, turns: int, shared: int, grow: int = 1, gap: float = 2.0) -> dict:
    """A growing-context session: each turn appends `grow` blocks to the last prompt."""
    reqs, ids, nxt = [], [10_000 + i for i in range(shared)], 1
    for k in range(turns):
        ids = ids + list(range(nxt, nxt + grow))
        nxt += grow
        reqs.append({"t": gap * k, "type": "s", "model": "m", "in": 64 * len(ids), "out": 4,
                     "hash_ids": list(ids), "api_time": 0.2, "think_time": 0.0})
    return {"id": sid, "models": ["m"], "block_size": 64, "hash_id_scope": "local",
            "requests": reqs}


def write_traces(folder, n: int, turns: int, shared: int) -> list:
    folder.mkdir(exist_ok=True)
    for i in range(n):
        (folder / f"s{i}.json").write_text(json.dumps(weka(f"s{i}", turns, shared)))
    return load_traces([str(folder)])


def replay_args(endpoint: str, traces: str, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    replay_mod.add_arguments(p)
    return p.parse_args(["--endpoint", endpoint, "--traces", traces, "--no-progress",
                         "--records", *extra])


def scrape(url: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].split("} ")
            out[labels] = float(value)
    return out


def test_split_sums_to_served_hits_with_a_host_share(tmp_path):
    sessions = write_traces(tmp_path / "traces", n=6, turns=7, shared=2)
    # 24 device blocks (384 tokens) for 4 live sessions of up to 10 blocks each: prefixes leave
    # the device between turns and come back from host memory. One request running and one
    # loading (10 blocks each) always fit, so nothing is preempted (the server counts a
    # re-admitted request's hits again, the usage does not).
    with running_server(kv_cache_memory=str(24 * PAGE), host_cache_memory=str(512 * PAGE),
                        max_num_seqs=1, tier_max_inflight=1) as srv:
        args = replay_args(srv.url, str(tmp_path / "traces"), "--concurrency", "4",
                           "--duration", "6", "--scale", "16", "--time-scale", "0.05",
                           "--seed", "3", "--max-output", "4")
        preempt_before = sum(scrape(srv.url, "loomserve_num_preemptions_total").values())
        res = asyncio.run(replay_mod.run_replay(args, sessions))
        preempted = sum(scrape(srv.url, "loomserve_num_preemptions_total").values()) \
            - preempt_before
        healthy = scrape(srv.url, "loomserve_tier_healthy")
    m = res["metrics"]
    assert m["requests"]["errors"] == 0 and m["requests"]["ok"] >= 12, m["requests"]
    by_share = m["hit_rate"]["by_source"]
    by_tokens = m["tokens"]["cached_by_source"]
    scrape_info = m["hit_source_scrape"]
    assert set(by_share) == set(by_tokens) >= {"device", "host"}
    # the server's own delta (every request of the replay, primers included) is exactly the
    # usage's cached tokens: each admitted request is counted once, by where its KV came from
    all_cached = sum(r["cached_tokens"] or 0 for r in res["records"] if r["error"] is None)
    assert preempted == 0, "a preemption re-counts hits on the server; the test wants none"
    assert scrape_info["server_delta_total"] == all_cached
    # attributed to the measured requests: the split sums to the served hit tokens and rate
    assert sum(by_tokens.values()) == pytest.approx(m["tokens"]["cached"])
    assert sum(by_share.values()) == pytest.approx(m["hit_rate"]["served"])
    assert by_tokens["host"] > 0 and by_share["host"] > 0, by_share
    assert healthy == {'tier="host"': 1.0}
    text = report.summary_table(res)
    assert "hit rate from host" in text and "hit rate from device" in text
    # compare shows the split, with ratios, also beside a run that has none
    other = json.loads(json.dumps(res))
    del other["metrics"]["hit_rate"]["by_source"], other["metrics"]["tokens"]["cached_by_source"]
    cmp = report.compare([res, other], ["tiers", "plain"])
    rows = {r["metric"]: r for r in cmp["rows"]}
    assert rows["hit rate from host"]["values"] == [by_share["host"], None]
    assert "hit rate from host" in report.compare_table(cmp)


def test_split_absent_without_the_metric(tmp_path):
    """A server whose /metrics lacks the counter (llama-server, vLLM) or has no /metrics."""
    assert replay_mod.parse_hit_tokens_by_source(
        "# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total 12.0\n") is None
    assert replay_mod.parse_hit_tokens_by_source("not prometheus {{{") is None
    text = ('# TYPE loomserve_prefix_cache_hit_tokens_by_source_total counter\n'
            'loomserve_prefix_cache_hit_tokens_by_source_total{model_name="a",source="device"} 5\n'
            'loomserve_prefix_cache_hit_tokens_by_source_total{model_name="b",source="device"} 2\n'
            'loomserve_prefix_cache_hit_tokens_by_source_total{model_name="a",source="redis"} 3\n')
    assert replay_mod.parse_hit_tokens_by_source(text) == {"device": 7.0, "redis": 3.0}
    assert replay_mod.counter_delta({"device": 7.0}, {"device": 9.0, "host": 4.0}) == \
        {"device": 2.0, "host": 4.0}
    assert replay_mod.counter_delta({"device": 7.0}, {"device": 1.0}) is None  # restarted
    assert replay_mod.counter_delta(None, {"device": 1.0}) is None

    class NoMetrics:
        async def request_json(self, method, path, body=None):
            return 404, "not found"

    assert asyncio.run(replay_mod.scrape_hit_tokens_by_source(NoMetrics())) is None
    recs = [RequestRecord(send_time=0, end_time=1, prompt_tokens=100, cached_tokens=40,
                          output_tokens=1)]
    m = compute_metrics(recs)
    assert "by_source" not in m["hit_rate"] and "hit_source_scrape" not in m
    res = {"metrics": m, "config": {}}
    assert "hit rate from" not in report.summary_table(res)
    assert not any(r["metric"].startswith("hit rate from")
                   for r in report.compare([res, res])["rows"])
    # with a delta that counts more than the usage (a primer hit): attributed pro rata
    m = compute_metrics(recs + [RequestRecord(send_time=0, end_time=1, prompt_tokens=50,
                                              cached_tokens=10, primer=True)],
                        hit_tokens_by_source={"device": 30.0, "host": 20.0})
    assert m["tokens"]["cached_by_source"] == {"device": 24.0, "host": 16.0}
    assert m["hit_rate"]["by_source"] == {"device": 0.24, "host": 0.16}
    assert m["hit_source_scrape"]["exact"] is False
    assert m["hit_source_scrape"]["replay_cached_tokens_all"] == 50
