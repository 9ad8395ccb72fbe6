"""benchmarks/longctx's lean streaming client against a real server (uvicorn's chunked SSE)."""

from __future__ import annotations

import asyncio
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from longctx.http_stream import HttpError, post_stream  # noqa: E402
from longctx.measure import concurrent_decode, random_prompt, timed_request  # noqa: E402


def test_a_timed_stream_counts_every_token_and_times_it(server):
    prompt = random_prompt(40, seed=3, vocab=300, low=10)
    t = timed_request(server.url, prompt, 12, model=server.model)
    assert t.error is None, t.error
    assert t.completion_tokens == 12 and t.prompt_tokens == 40
    # the tiny model may stream every token in one read (then first == last): never negative
    assert t.ttft_s > 0 and t.decode_ms_per_token >= 0 and t.t_last >= t.t_first
    assert t.wall_s >= t.ttft_s


def test_concurrent_streams_each_finish(server):
    prompts = [random_prompt(16, seed=s, vocab=300, low=10) for s in range(3)]
    res = asyncio.run(concurrent_decode(server.url, prompts, 5, model=server.model))
    assert [r.error for r in res] == [None] * 3
    assert [r.completion_tokens for r in res] == [5, 5, 5]


def test_an_error_status_is_reported_never_timed(server):
    too_long = random_prompt(100_000, seed=1, vocab=300, low=10)  # past the model's context
    t = timed_request(server.url, too_long, 4, model=server.model)
    assert t.error is not None and "HTTP 400" in t.error
    assert t.decode_ms_per_token is None and t.ttft_s is None


def test_the_body_text_equals_a_plain_read(server):
    import httpx

    body = {"model": server.model, "prompt": "hello", "max_tokens": 6, "temperature": 0.0,
            "stream": True}

    async def lean() -> str:
        return "".join([t async for t in post_stream(server.url + "/v1/completions", body)])

    text = asyncio.run(lean())
    plain = httpx.post(server.url + "/v1/completions", json=body, timeout=30).text
    strip = [line for line in text.splitlines() if line.startswith("data:")]
    assert strip and strip[-1] == "data: [DONE]"
    # ids, timestamps and how tokens group into chunks differ per request: compare the text
    def texts(s):
        import json
        return [json.loads(x[5:])["choices"][0]["text"] for x in s.splitlines()
                if x.startswith("data:") and x != "data: [DONE]" and json.loads(x[5:])["choices"]]
    assert "".join(texts(text)) == "".join(texts(plain)) != ""


def test_only_http_urls():
    async def go():
        async for _ in post_stream("https://example.com/v1/completions", {}):
            pass

    try:
        asyncio.run(go())
    except HttpError as e:
        assert "only http://" in str(e)
    else:
        raise AssertionError("an https URL was accepted")
