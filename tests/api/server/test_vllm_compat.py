"""loomserve operated as vLLM: the `vllm:` metric families (names, labels, bucket edges) and
the Grafana dashboard in deploy/ against a live server, /tokenize, /detokenize, /version and
/v1/models in vLLM's shapes, JSON log lines."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loomserve.api.log_format import JSONFormatter
from loomserve.api.vllm_metrics import (
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    buckets_1_2_5,
)

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "loomserve.json"
# Families a few finished requests must have moved (the rest must exist: a gauge may read 0).
MOVED = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
         "vllm:prefix_cache_queries_total", "vllm:request_success_total")


@pytest.fixture(scope="module")
def scraped(server):
    """The server's /metrics after a few requests (one streamed), as {sample name: [(labels,
    value)]}, plus the raw text."""
    for i, stream in enumerate((False, False, True)):
        body = {"model": server.model, "prompt": f"Count with me: {i} 1 2 3", "max_tokens": 4,
                "temperature": 0, "stream": stream}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    server.wait_idle()
    text = httpx.get(server.url + "/metrics", timeout=10).text
    samples: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples, text


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v.get("definition")]
    return exprs


def metric_names(expr: str) -> set[str]:
    """Series names a PromQL expression selects (names of functions and labels aside)."""
    return set(re.findall(r"\b(vllm:[A-Za-z0-9_:]+)", expr))


def test_dashboard_queries_only_vllm_names():
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    for e in exprs:
        names = metric_names(e)
        assert names, e  # every query selects a vllm: series...
        bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", e)
        others = set(re.findall(r"\b([a-z_]+:?[a-z_:]*)(?=\s*[{\[])", bare)) - names
        assert not any(":" in o or o.startswith("loomserve") for o in others), e  # ...only


def test_every_dashboard_series_exists_with_data(scraped, server):
    samples, _ = scraped
    names = set().union(*(metric_names(e) for e in dashboard_exprs()))
    assert len(names) >= 18
    for name in sorted(names):
        rows = [(labels, v) for labels, v in samples.get(name, [])
                if labels.get("model_name") == server.model]
        assert rows, f"{name}: no series for model_name={server.model}"
        if name.endswith(("_count", "_sum")) or name in MOVED:
            assert sum(v for _, v in rows) > 0, f"{name} has no data"
        if name.endswith("_bucket"):
            assert max(v for _, v in rows) > 0, f"{name}: every bucket empty"


def test_vllm_families_names_labels_and_buckets(scraped, server):
    samples, text = scraped
    vllm = {n: rows for n, rows in samples.items() if n.startswith("vllm:")}
    for n, rows in vllm.items():
        for labels, _ in rows:
            assert labels.get("engine") == "0", n
            if n != "vllm:cache_config_info":
                assert labels.get("model_name") == server.model, n
    for counter in ("prompt_tokens", "generation_tokens", "prefix_cache_queries",
                    "prefix_cache_hits", "num_preemptions", "request_success"):
        assert f"# TYPE vllm:{counter}_total counter" in text  # prometheus_client 0.0.4 text
        assert f"vllm:{counter}_total" in vllm
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                  "gpu_cache_usage_perc"):
        assert f"# TYPE vllm:{gauge} gauge" in text
    les = lambda n: [float(lab["le"]) for lab, _ in vllm[n + "_bucket"]]  # noqa: E731
    assert les("vllm:time_to_first_token_seconds")[:-1] == list(TTFT_BUCKETS)
    assert les("vllm:e2e_request_latency_seconds")[:-1] == list(REQUEST_LATENCY_BUCKETS)
    assert les("vllm:request_prompt_tokens")[:-1] == list(
        buckets_1_2_5(server.engine.max_model_len))
    # per request: the token histograms count exactly the requests that finished
    ok = sum(v for lab, v in vllm["vllm:request_success_total"])
    assert vllm["vllm:request_prompt_tokens_count"][0][1] == ok
    assert vllm["vllm:request_generation_tokens_sum"][0][1] >= 4 * 3
    # loomserve's own families stay beside them
    assert "loomserve_prompt_tokens_total" in samples


def test_spec_decode_families_only_when_speculating():
    from prometheus_client import CollectorRegistry, generate_latest

    from loomserve.api.vllm_metrics import VLLMStatsCollector
    from loomserve.engine.messages import EngineStats

    def scrape(stats: EngineStats) -> dict:
        engine = type("Engine", (), {"stats": lambda self: stats})()
        r = CollectorRegistry()
        r.register(VLLMStatsCollector(engine, "m"))
        return {(s.name, s.labels.get("position")): s.value
                for f in text_string_to_metric_families(generate_latest(r).decode())
                for s in f.samples if "spec_decode" in s.name}

    assert scrape(EngineStats()) == {}
    got = scrape(EngineStats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=9,
                             spec_decode_num_accepted_tokens=5,
                             spec_decode_num_accepted_tokens_per_pos=[3, 2]))
    assert got == {("vllm:spec_decode_num_drafts_total", None): 3,
                   ("vllm:spec_decode_num_draft_tokens_total", None): 9,
                   ("vllm:spec_decode_num_accepted_tokens_total", None): 5,
                   ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "0"): 3,
                   ("vllm:spec_decode_num_accepted_tokens_per_pos_total", "1"): 2}


def test_buckets_1_2_5():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


# /tokenize /detokenize /version /v1/models -------------------------------------------------

def test_tokenize_prompt_and_detokenize(server):
    tok = server.engine.tokenizer
    r = httpx.post(server.url + "/tokenize", json={"model": server.model, "prompt": "Hello world",
                                                    "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Hello world", add_special_tokens=True)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.engine.max_model_len
    assert len(body["token_strs"]) == body["count"]
    bare = httpx.post(server.url + "/tokenize",
                      json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    assert bare["token_strs"] is None
    r = httpx.post(server.url + "/detokenize", json={"tokens": bare["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello world"}


def test_tokenize_messages_is_the_chat_prompt(server):
    """The ids /tokenize gives for messages are the prompt a chat completion runs."""
    messages = [{"role": "user", "content": "What is two plus two?"}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": messages, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
])
def test_tokenize_errors_in_the_api_shape(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_version_and_models(server):
    v = httpx.get(server.url + "/version").json()["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*|unknown", v)
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["id"] == server.model and card["object"] == "model"
    assert card["max_model_len"] == server.engine.max_model_len
    assert card["root"] and card["parent"] is None and card["owned_by"]


# logs and tracing off -----------------------------------------------------------------------

def test_json_log_lines_parse():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JSONFormatter())
    log = logging.getLogger("loomserve.requests.test")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("request %s finished", "r1", extra={"request_id": "r1", "prompt_tokens": 7,
                                                        "latency_s": 0.5})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "request r1 finished" and first["level"] == "WARNING"
    assert first["logger"] == "loomserve.requests.test" and first["timestamp"].endswith("+00:00")
    assert (first["request_id"], first["prompt_tokens"], first["latency_s"]) == ("r1", 7, 0.5)
    assert "RuntimeError: boom" in second["exc_info"]


def test_tracing_off_imports_no_sdk():
    """Without --otlp-traces-endpoint, neither the server nor the router imports the SDK."""
    code = ("import sys; import loomserve.cli, loomserve.api.app, loomserve.api.serve, "
            "loomserve.control.router.app, loomserve.control.router.cli; "
            "print([m for m in sys.modules if m.startswith('opentelemetry.sdk')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
