"""Anthropic Messages API cases that need a server of their own: API keys, a core that fails
mid-stream, a chat template that reads enable_thinking."""

from __future__ import annotations

import json
import os

import pytest

from tests.api.server.conftest import app_over, running_server
from tests.api.server.test_anthropic_api import (
    ASK,
    ONE_CALL,
    TINY_AGENT,
    WEATHER,
    args,
    create,
)

anthropic = pytest.importorskip("anthropic")


def thinking_template() -> str:
    """tiny-agent's template with Qwen3's switch: enable_thinking=false writes an empty
    <think></think> block after the generation prompt."""
    with open(os.path.join(TINY_AGENT, "tokenizer_config.json")) as f:
        template = json.load(f)["chat_template"]
    prompt = "{{- '<|im_start|>assistant\\n' }}"
    assert prompt in template
    return template.replace(prompt, prompt + "{%- if enable_thinking is defined and "
                            "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
                            "{%- endif %}")


def test_thinking_config_reaches_a_template_that_reads_it(agent_server):
    with app_over(agent_server.engine, app_options={"chat_template": thinking_template()}) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)

        def count(**kw) -> int:
            return client.messages.count_tokens(model=srv.model, messages=ASK, **kw).input_tokens

        default = count()
        assert count(thinking={"type": "enabled", "budget_tokens": 1024}) == default
        assert count(thinking={"type": "disabled"}) > default
        # A forced call renders with thinking off (no reasoning block for the grammar to
        # fight); count_tokens counts that same prompt.
        forced = dict(tools=[WEATHER], tool_choice=ONE_CALL)
        usage = create(client, srv, max_tokens=120, **forced).usage
        assert usage.input_tokens + usage.cache_read_input_tokens == count(**forced)
        assert count(**forced) > count(tools=[WEATHER])


def test_api_key_is_checked(keyed_server):
    wrong = anthropic.Anthropic(base_url=keyed_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=keyed_server.model, max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    right = anthropic.Anthropic(base_url=keyed_server.url, api_key="sekrit", max_retries=0)
    assert right.messages.create(model=keyed_server.model, max_tokens=2,
                                 messages=ASK).usage.output_tokens > 0
    bearer = anthropic.Anthropic(base_url=keyed_server.url, auth_token="sekrit", max_retries=0)
    assert bearer.messages.count_tokens(model=keyed_server.model, messages=ASK).input_tokens > 0


def test_core_failure_mid_stream_is_an_in_band_error_event():
    env = {"LOOMSERVE_FAULT_INJECT": "step:12", "LOOMSERVE_STEP_DELAY_MS": "20"}
    with running_server(core_env=env) as srv:
        client = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
        seen = []
        with pytest.raises(anthropic.APIStatusError) as e:
            with client.messages.stream(**args(srv, {"max_tokens": 100})) as stream:
                for event in stream:
                    seen.append(event.type)
        assert seen[0] == "message_start" and "message_stop" not in seen
        body = e.value.body
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
        assert "injected fault" in body["error"]["message"]
