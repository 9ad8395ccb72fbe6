"""A client that goes away mid-request frees its request: no running request, no blocks held."""

import httpx
import openai
import pytest

from tests.api.server.conftest import running_server
from tests.api.server.test_metrics import scrape


@pytest.fixture(scope="module")
def slow_server():
    """The real engine with its steps paced (15 ms each, the core's LOOMSERVE_STEP_DELAY_MS
    hook) so a fast machine cannot finish the whole generation before the client's disconnect
    is seen. The engine does not wait for its consumer, so slowing the stream would not do."""
    with running_server(core_env={"LOOMSERVE_STEP_DELAY_MS": "15"}) as srv:
        yield srv


def _long_request(server, prompt="Tell me everything"):
    room = server.engine.max_model_len - len(server.engine.tokenizer.encode(prompt)) - 1
    return {"model": server.model, "prompt": prompt, "max_tokens": room, "temperature": 0,
            "ignore_eos": True}


def test_stream_disconnect_aborts_the_request(slow_server):
    server = slow_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    server.wait_idle()
    body = _long_request(server)
    generated_before = scrape(server)["loomserve_generation_tokens_total"]
    stream = client.completions.create(
        model=body["model"], prompt=body["prompt"], max_tokens=body["max_tokens"],
        temperature=0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    s = server.wait_idle(timeout=10)
    assert s.num_running == 0 and s.kv_blocks_used == 0
    generated = scrape(server)["loomserve_generation_tokens_total"] - generated_before
    assert generated < body["max_tokens"], "the request ran to the end instead of being aborted"


def test_non_streaming_disconnect_aborts_the_request(slow_server):
    server = slow_server
    server.wait_idle()
    body = _long_request(server, "Another long story")
    generated_before = scrape(server)["loomserve_generation_tokens_total"]
    try:
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    except httpx.TimeoutException:
        pass
    s = server.wait_idle(timeout=10)
    assert s.num_running == 0 and s.kv_blocks_used == 0
    generated = scrape(server)["loomserve_generation_tokens_total"] - generated_before
    assert generated < body["max_tokens"], "the request ran to the end instead of being aborted"
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": server.model, "prompt": "ok?", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
