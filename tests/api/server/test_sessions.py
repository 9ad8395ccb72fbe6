"""Session pinning through tool pauses, and the endpoint that ends a session."""

import time

import httpx
import openai
import pytest

from tests.api.server.conftest import running_server


@pytest.fixture(scope="module")
def pinned():
    with running_server(session_pin_ttl=300, session_pin_budget="4MiB") as srv:
        yield srv


def blocks_used(srv) -> int:
    return srv.engine.stats().kv_blocks_used


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_a_finished_turn_stays_pinned_until_its_session_ends(pinned):
    client = openai.OpenAI(base_url=pinned.url + "/v1", api_key="x", max_retries=0)
    prompt = list(range(10, 90))  # 80 tokens: 5 full blocks of 16
    first = client.completions.create(model=pinned.model, prompt=prompt, max_tokens=4,
                                      temperature=0, extra_headers={"X-Session-ID": "agent-1"})
    assert first.usage.prompt_tokens == 80
    # The tool pause: nothing runs, yet the session's prefix is held (not merely evictable).
    assert wait_for(lambda: pinned.engine.stats().num_running == 0)
    assert blocks_used(pinned) > 0
    second = client.completions.create(model=pinned.model, prompt=prompt + [5, 6, 7], max_tokens=2,
                                       temperature=0, extra_headers={"X-Session-ID": "agent-1"})
    assert second.usage.prompt_tokens_details.cached_tokens == 80
    r = httpx.delete(pinned.url + "/v1/sessions/agent-1")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert wait_for(lambda: blocks_used(pinned) == 0)
    # Ending an unknown session is harmless.
    assert httpx.delete(pinned.url + "/v1/sessions/nobody").status_code == 200


def test_without_a_session_id_nothing_is_pinned(pinned):
    client = openai.OpenAI(base_url=pinned.url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model=pinned.model, prompt=list(range(100, 180)), max_tokens=2,
                              temperature=0)
    assert wait_for(lambda: blocks_used(pinned) == 0)
