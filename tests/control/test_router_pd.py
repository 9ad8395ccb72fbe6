"""The router's prefill/decode decision against real instances: a prefill-role and a
decode-role `loomserve serve` (Mooncake Transfer Engine over TCP, KV events on the decode
side), the router with a low --pd-threshold-tokens. A cold long prompt is disaggregated (the
decode instance answers from the imported prefix); the same session's next turn, mostly
cached on the decode instance, goes straight to it; a short prompt never leaves it; with the
prefill instance dead, long prompts are computed on the decode side."""

from __future__ import annotations

import httpx
import pytest

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


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-pd")
    procs: list[Proc] = []
    try:
        for role in ("prefill", "decode"):
            port = free_port()
            log = str(logs / f"{role}.log")
            args = ["serve", TINY_LLAMA, "--port", str(port), "--dtype", "float32",
                    "--kv-cache-memory", "4MiB", "--log-level", "warning", "--role", role,
                    "--kv-transfer-backend", "mooncake", "--kv-transfer-timeout", "5"]
            if role == "decode":
                args += ["--kv-events-endpoint", "tcp://127.0.0.1:0"]
            procs.append(Proc(f"http://127.0.0.1:{port}", spawn(args, log), log))
        port = free_port()
        args = ["router", "--port", str(port), "--log-level", "warning",
                "--pd-threshold-tokens", str(THRESHOLD)]
        for p in procs:
            args += ["--instance", p.url]
        procs.append(Proc(f"http://127.0.0.1:{port}", spawn(args, str(logs / "router.log")),
                          str(logs / "router.log")))
        c = Cluster(procs[2].url, procs[:2])

        def ready():
            h = c.health()
            return h["tokenizer"] and all(r["up"] for r in h["instances"])
        wait_for(ready, START_TIMEOUT_S, "prefill and decode instances up", procs)
        yield c
    finally:
        for p in procs:
            p.kill()
            p.proc.wait(timeout=10)


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
    assert usage["prompt_tokens_details"]["cached_tokens"] > THRESHOLD  # imported, not computed
    # the decode instance's KV events tell the router what it now holds
    wait_for(lambda: pd.row(decode.name)["cached_blocks"] * 16 > usage["prompt_tokens"] - 16,
             30, "the decode instance's KV events")
    local = pd_count(pd, "local")
    ask(pd, first + [{"role": "assistant", "content": r.json()["choices"][0]["message"][
        "content"]}, {"role": "user", "content": "Go on"}], "agent")
    assert pd_count(pd, "local") == local + 1 and pd_count(pd, "disaggregated") == 1
    ask(pd, [{"role": "user", "content": "Hi"}])
    assert pd_count(pd, "local") == local + 2


def test_prefill_instance_dead_long_prompts_computed_on_decode(pd):
    prefill, decode = pd.instances
    prefill.kill()
    wait_for(lambda: not pd.row(prefill.name)["up"], 5, "the prefill instance marked down")
    r = ask(pd, [{"role": "user", "content": PROMPT + " Another one."}])
    assert r.headers["x-loomserve-instance"] == decode.name
    assert r.json()["usage"]["completion_tokens"] == 6
