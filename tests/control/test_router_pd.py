"""The router's prefill/decode decision against real instances: a prefill-role and a
decode-role `loomserve serve` (Mooncake Transfer Engine over TCP, KV events on the decode
side), the router with a low --pd-threshold-tokens. A cold long prompt is disaggregated (the
decode instance answers from the imported prefix); the same session's next turn, mostly
cached on the decode instance, goes straight to it; a short prompt never leaves it; with the
prefill instance dead, long prompts are computed on the decode side.

All three trace to an OTLP/HTTP receiver the test runs (--otlp-traces-endpoint): one
disaggregated request is one trace across router, prefill and decode. The decode instance
logs JSON (--log-format json)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.control.otlp_receiver import start_receiver
from tests.control.test_router_servers import (
    START_TIMEOUT_S,
    TINY_LLAMA,
    Cluster,
    Proc,
    free_port,
    spawn,
    wait_for,
)

pytest.importorskip("mooncake.engine")

THRESHOLD = 48
PROMPT = "Tell me about the quick brown fox that jumps over the lazy dog. " * 6
TRACED_PROMPT = "Describe the slow grey cat asleep under the old red barn door. " * 3
CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-pd")
    procs: list[Proc] = []
    receiver = start_receiver()
    tracing = ["--otlp-traces-endpoint", receiver.url]
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # spans exported within 0.1 s, not 5 s
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            log = str(logs / f"{role}.log")
            args = ["serve", TINY_LLAMA, "--port", str(port), "--dtype", "float32",
                    "--kv-cache-memory", "4MiB", "--role", role, *tracing,
                    "--kv-transfer-backend", "mooncake", "--kv-transfer-timeout", "5"]
            if role == "decode":
                args += ["--kv-events-endpoint", "tcp://127.0.0.1:0", "--log-level", "info",
                         "--log-format", "json"]
            else:
                args += ["--log-level", "warning"]
            procs.append(Proc(f"http://127.0.0.1:{port}", spawn(args, log, env), log))
        port = free_port()
        args = ["router", "--port", str(port), "--log-level", "warning",
                "--pd-threshold-tokens", str(THRESHOLD), *tracing]
        for p in procs:
            args += ["--instance", p.url]
        procs.append(Proc(f"http://127.0.0.1:{port}", spawn(args, str(logs / "router.log"),
                                                            env), str(logs / "router.log")))
        c = Cluster(procs[2].url, procs[:2])
        c.receiver = receiver

        def ready():
            h = c.health()
            return h["tokenizer"] and all(r["up"] for r in h["instances"])
        wait_for(ready, START_TIMEOUT_S, "prefill and decode instances up", procs)
        yield c
    finally:
        for p in procs:
            p.kill()
            p.proc.wait(timeout=10)
        receiver.shutdown()


def pd_count(c: Cluster, decision: str) -> float:
    for line in httpx.get(c.router + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f'loomserve_router_pd_decisions_total{{decision="{decision}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def ask(c: Cluster, messages: list[dict], session: str | None = None) -> httpx.Response:
    r = httpx.post(c.router + "/v1/chat/completions", timeout=60,
                   headers={"x-session-id": session} if session else {},
                   json={"model": "tiny-llama", "messages": messages, "max_tokens": 6,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_cold_long_prompt_is_disaggregated_warm_turn_is_not(pd):
    prefill, decode = pd.instances
    first = [{"role": "user", "content": PROMPT}]
    r = ask(pd, first, "agent")
    assert r.headers["x-loomserve-instance"] == decode.name
    assert r.headers["x-loomserve-prefill"] == prefill.name
    assert pd_count(pd, "disaggregated") == 1
    usage = r.json()["usage"]
    # The decode leg imported the prompt; the client's usage says what the prompt cost: the
    # prefill leg's cached tokens and miss causes (a cold prompt: all of it computed there).
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] == 0
    assert sum(details["miss_causes"].values()) == usage["prompt_tokens"]
    assert details["miss_causes"]["first_sight"] > THRESHOLD
    # the decode instance's KV events tell the router what it now holds
    wait_for(lambda: pd.row(decode.name)["cached_blocks"] * 16 > usage["prompt_tokens"] - 16,
             30, "the decode instance's KV events")
    local = pd_count(pd, "local")
    ask(pd, first + [{"role": "assistant", "content": r.json()["choices"][0]["message"][
        "content"]}, {"role": "user", "content": "Go on"}], "agent")
    assert pd_count(pd, "local") == local + 1 and pd_count(pd, "disaggregated") == 1
    ask(pd, [{"role": "user", "content": "Hi"}])
    assert pd_count(pd, "local") == local + 2


def test_one_trace_spans_router_prefill_and_decode(pd):
    """The client's traceparent parents the router's span; each instance's request span is
    the child of the router's leg span that sent it; the decode leg's kv_transfer span links
    to the prefill instance's; the phases tile each request span."""
    prefill_inst, decode_inst = pd.instances
    r = httpx.post(pd.router + "/v1/chat/completions", timeout=60,
                   headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
                   json={"model": "tiny-llama", "max_tokens": 6, "temperature": 0,
                         "messages": [{"role": "user", "content": TRACED_PROMPT}]})
    assert r.status_code == 200, r.text
    assert r.headers["x-loomserve-prefill"] == prefill_inst.name  # disaggregated

    def spans() -> list[dict]:
        with pd.receiver.lock:
            return [s for s in pd.receiver.spans if s["trace"] == CLIENT_TRACE]

    def complete() -> bool:
        names = [s["name"] for s in spans()]
        return names.count("request") == 3 and names.count("decode") == 2 \
            and "kv_transfer" in names
    wait_for(complete, 30, "the router's, the prefill's and the decode's spans")
    got = spans()

    def one(service: str, name: str, parent: str) -> dict:
        found = [s for s in got if (s["service"], s["name"], s["parent"]) ==
                 (service, name, parent)]
        assert len(found) == 1, (service, name, [(s["service"], s["name"]) for s in got])
        return found[0]

    root = one("loomserve-router", "request", CLIENT_SPAN)
    assert root["attrs"]["http.response.status_code"] == 200
    prefill = one("loomserve", "request",
                  one("loomserve-router", "prefill_leg", root["id"])["id"])
    decode = one("loomserve", "request", one("loomserve-router", "decode_leg", root["id"])["id"])
    assert len(got) == 3 + 4 + 4  # router: request, two legs; per instance: request, 3 phases
    usage = r.json()["usage"]
    assert prefill["attrs"]["gen_ai.usage.completion_tokens"] == 1
    assert decode["attrs"]["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert decode["attrs"]["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    # the decode leg counts its imported prefix as cached; the client's usage has the
    # prefill leg's cached tokens and causes (router: miss_causes.PrefillLeg), which sum to
    # the rest; each instance's span carries its own leg's causes
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert decode["attrs"]["gen_ai.usage.cached_tokens"] > THRESHOLD > cached
    assert prefill["attrs"]["gen_ai.usage.cached_tokens"] == cached

    def miss(span: dict) -> dict:
        key = "loomserve.prefix_cache.miss_tokens."
        return {k[len(key):]: v for k, v in span["attrs"].items() if k.startswith(key)}
    # the router's span carries the client's causes (the prefill leg's, with any of the
    # router's own moved in: the same total)
    assert miss(root) == usage["prompt_tokens_details"]["miss_causes"]
    assert sum(miss(prefill).values()) == sum(miss(root).values()) == \
        usage["prompt_tokens"] - cached
    assert miss(prefill)["first_sight"] > THRESHOLD
    assert sum(miss(decode).values()) == \
        usage["prompt_tokens"] - decode["attrs"]["gen_ai.usage.cached_tokens"] > 0
    assert decode["attrs"]["gen_ai.request.id"] == r.json()["id"]
    for req, first in ((prefill, "queue"), (decode, "kv_transfer")):
        phases = [one("loomserve", n, req["id"]) for n in (first, "prefill", "decode")]
        assert all(p["start"] <= p["end"] for p in phases)
        assert req["start"] <= phases[0]["start"] and phases[-1]["end"] <= req["end"]
        assert phases[0]["end"] == phases[1]["start"] and phases[1]["end"] == phases[2]["start"]
    transfer = one("loomserve", "kv_transfer", decode["id"])
    assert transfer["links"] == [(CLIENT_TRACE, prefill["id"])]

    # the decode instance's log: JSON lines, one request line for this request
    lines = [json.loads(line) for line in open(decode_inst.log) if line.startswith("{")]
    assert lines and all({"timestamp", "level", "logger", "message"} <= set(x) for x in lines)
    logged = [x for x in lines if x["logger"] == "loomserve.requests"
              and x.get("request_id") == decode["attrs"]["gen_ai.request.id"]]
    assert len(logged) == 1, lines[-5:]
    assert (logged[0]["prompt_tokens"], logged[0]["cached_tokens"],
            logged[0]["output_tokens"]) == (usage["prompt_tokens"],
                                            decode["attrs"]["gen_ai.usage.cached_tokens"],
                                            usage["completion_tokens"])
    assert logged[0]["latency_s"] > 0 and logged[0]["session_id"] is None
    # the engine core's own lines (its process) are JSON too, labelled with their component
    core = [x for x in lines if x.get("component") == "core"]
    assert any(x["message"].startswith("KV events: PUB") for x in core), lines[:10]
    assert not any("[core]: " in line for line in open(decode_inst.log))


def test_prefill_instance_dead_long_prompts_computed_on_decode(pd):
    prefill, decode = pd.instances
    prefill.kill()
    wait_for(lambda: not pd.row(prefill.name)["up"], 5, "the prefill instance marked down")
    r = ask(pd, [{"role": "user", "content": PROMPT + " Another one."}])
    assert r.headers["x-loomserve-instance"] == decode.name
    assert r.json()["usage"]["completion_tokens"] == 6
