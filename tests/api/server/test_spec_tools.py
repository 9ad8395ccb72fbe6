"""Tool calling, structured output and stop strings through the API with speculative decoding
(ngram drafts, every step: always_draft) and async scheduling on, with the official client.

Oracle: the session's plain agent server (same tiny-agent weights, no drafts, synchronous).
Greedy requests must give the same text and calls token for token; seeded sampling at
temperature 1 must give schema-valid calls, the same streamed as not; the drafts must have
been verified (the grammar cuts each proposal to what it accepts, so the forced tokens of a
tool call's JSON are drafted and accepted).
"""

import json

import pytest

from tests.api.server.conftest import TINY_AGENT, running_server
from tests.api.server.test_openai_tools import (
    BOOKING,
    WEATHER,
    _streamed_calls,
    check_args,
    create,
)

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 4, "always_draft": True}


@pytest.fixture(scope="module")
def spec_server():
    with running_server(model=TINY_AGENT, kv_cache_memory="16MiB", speculative_config=SPEC,
                        async_scheduling=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def spec_client(spec_server):
    import openai
    return openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_greedy_tool_call_and_json_schema_equal_the_plain_server(spec_client, spec_server,
                                                                 agent_client, agent_server):
    schema = {"type": "object", "properties": {"answer": {"type": "string",
                                                          "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    kinds = [dict(tools=[WEATHER, BOOKING], tool_choice="required", parallel_tool_calls=False),
             dict(response_format={"type": "json_schema", "json_schema": {
                 "name": "verdict", "schema": schema, "strict": True}}),
             dict(max_tokens=24)]
    text = create(agent_client, agent_server, temperature=0.0, **kinds[-1]).choices[0]
    kinds.append(dict(max_tokens=24, stop=[text.message.content[10:13]]))  # a stop string mid-way
    for kw in kinds:
        a = create(agent_client, agent_server, temperature=0.0, **kw).choices[0]
        b = create(spec_client, spec_server, temperature=0.0, **kw).choices[0]
        assert b.message.content == a.message.content
        assert b.finish_reason == a.finish_reason
        calls = lambda m: [(c.function.name, c.function.arguments)  # noqa: E731
                           for c in m.tool_calls or []]
        assert calls(b.message) == calls(a.message)
    assert b.finish_reason == "stop" and len(b.message.content) < len(text.message.content)
    stats = spec_server.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_calls_are_schema_valid_and_streamed_alike(spec_client, spec_server, seed):
    kw = dict(tools=[WEATHER, BOOKING], tool_choice="required", seed=seed,
              parallel_tool_calls=False)
    full = create(spec_client, spec_server, **kw).choices[0]
    assert full.finish_reason == "tool_calls", full
    (call,) = full.message.tool_calls
    tool = {"get_weather": WEATHER, "book_table": BOOKING}[call.function.name]
    check_args(tool["function"]["parameters"], call.function.arguments)
    chunks = list(create(spec_client, spec_server, stream=True, **kw))
    assert _streamed_calls(chunks) == [{"name": call.function.name,
                                        "arguments": call.function.arguments}]
    assert json.loads(call.function.arguments) is not None
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_client_leaving_mid_stream_leaves_nothing_behind(spec_client, spec_server):
    """The client closes a drafting stream after a few chunks (drafted steps in flight under
    async scheduling): the request is aborted and every block comes back."""
    stream = spec_client.completions.create(
        model=spec_server.model, prompt="1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3 4", max_tokens=400,
        temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += len(chunk.choices[0].text or "") > 0
        if got >= 3:
            break
    stream.close()
    stats = spec_server.wait_idle(timeout=30)
    assert stats.num_running == 0 and stats.kv_blocks_used == 0
    again = spec_client.completions.create(model=spec_server.model, prompt="1 2 3 4", max_tokens=4,
                                           temperature=0.0)
    assert again.choices[0].finish_reason == "length"  # the server keeps serving
