"""Miss causes as a client sees them: the usage extension (OpenAI, Anthropic), the
loomserve_prefix_cache_miss_tokens_total{cause} counter and the debug request log line."""

from __future__ import annotations

import logging

import httpx

from tests.api.server.test_metrics import scrape


def chat(server, messages, session):
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": server.model, "messages": messages, "max_tokens": 2, "temperature": 0,
        "prompt_cache_key": session})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record) -> None:
        self.records.append(record)


def test_usage_metric_and_log_attribute_an_edited_history(server):
    log = logging.getLogger("loomserve.requests")
    lines, level = Lines(), log.level
    log.addHandler(lines)
    log.setLevel(logging.DEBUG)
    try:
        before = scrape(server)
        history = [{"role": "system", "content": "You are a careful agent. " * 4},
                   {"role": "user", "content": "list the files " * 6}]
        u1 = chat(server, history, "mc-session")
        edited = [{"role": "system", "content": "You are a careless agent. " * 4}, history[1],
                  {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
        u2 = chat(server, edited, "mc-session")
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    for u in (u1, u2):
        causes = u["prompt_tokens_details"]["miss_causes"]
        assert sum(causes.values()) == u["prompt_tokens"] - u["prompt_tokens_details"][
            "cached_tokens"]
    assert "first_sight" in u1["prompt_tokens_details"]["miss_causes"]
    assert u2["prompt_tokens_details"]["miss_causes"].get("diverged", 0) > 0
    after = scrape(server)
    missed = (u1["prompt_tokens"] - u1["prompt_tokens_details"]["cached_tokens"]
              + u2["prompt_tokens"] - u2["prompt_tokens_details"]["cached_tokens"])
    assert after["loomserve_prefix_cache_miss_tokens_total"] - before[
        "loomserve_prefix_cache_miss_tokens_total"] == missed
    miss_lines = [r for r in lines.records if getattr(r, "miss_causes", None)]
    assert len(miss_lines) == 2
    div = miss_lines[1].prompt_divergence
    assert div["kind"] == "text" and "careless" in div["current"]  # text side, live


def test_anthropic_usage_extension(server):
    r = httpx.post(server.url + "/v1/messages", json={
        "model": server.model, "max_tokens": 2,
        "messages": [{"role": "user", "content": "count the tokens " * 8}]})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert sum(u["miss_causes"].values()) == u["input_tokens"]
