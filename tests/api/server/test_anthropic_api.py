"""The Anthropic Messages API against a real engine on tiny-agent (a tool-calling chat template,
4096 context) behind uvicorn, through the official `anthropic` client.

The model has random weights: tool calls come from tool_choice any / tool, whose grammar forces
a schema-valid call; tool schemas use enums and booleans so every forced call completes.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

from tests.api.server.conftest import running_server

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

TINY_AGENT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "fixtures",
                                          "tiny-agent"))
WEATHER = {"name": "get_weather", "description": "Current weather in a city.",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "required": ["city", "metric"],
                            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "metric": {"type": "boolean"}}}}
CLOCK = {"name": "get_time", "input_schema": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}
CLAUDE = "claude-sonnet-4-5-20250929"  # an alias, as Claude Code's model id


@pytest.fixture(scope="module")
def agent():
    if not os.path.isdir(TINY_AGENT):
        pytest.skip("tests/fixtures/tiny-agent is missing")
    with running_server(model=TINY_AGENT, kv_cache_memory="64MiB", session_pin_ttl=300,
                        session_pin_budget="4MiB",
                        app_options={"served_model_names": ["tiny-agent", CLAUDE]}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(agent):
    return anthropic.Anthropic(base_url=agent.url, api_key="unused", max_retries=0, timeout=120)


def args(agent, kw: dict) -> dict:
    """create() arguments: this client version has no sampling parameters, so temperature
    (0 unless given: greedy) travels in extra_body, as the API still takes it."""
    kw = {**dict(model=agent.model, max_tokens=120, messages=ASK), **kw}
    kw["extra_body"] = {"temperature": kw.pop("temperature", 0)}
    return kw


def create(client, agent, **kw):
    return client.messages.create(**args(agent, kw))


def tool_uses(message) -> list[tuple[str, dict]]:
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


def test_forced_tool_call_then_result_then_follow_up(client, agent):
    first = create(client, agent, tools=[WEATHER, CLOCK], tool_choice=ONE_CALL)
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name in ("get_weather", "get_time")
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.name]["input_schema"]
    jsonschema.validate(call.input, schema)
    assert first.usage.output_tokens > 0 and first.usage.input_tokens > 0

    history = ASK + [{"role": "assistant", "content": first.content},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": call.id, "content": "22 C"}]}]
    follow = create(client, agent, tools=[WEATHER, CLOCK], messages=history, max_tokens=8)
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The follow-up's prompt holds the first turn's: its full blocks come from the prefix cache.
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    bs = agent.engine.config.cache.block_size
    assert follow.usage.cache_read_input_tokens >= first_prompt // bs * bs > 0


def test_streaming_gives_the_same_turn_as_non_streaming(client, agent):
    for kw in ({"tools": [WEATHER, CLOCK], "tool_choice": {"type": "any"}},
               {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}},
               {"max_tokens": 24}):
        plain = create(client, agent, **kw)
        with client.messages.stream(**args(agent, kw)) as stream:
            streamed = stream.get_final_message()
        assert tool_uses(streamed) == tool_uses(plain)
        assert [b.type for b in streamed.content] == [b.type for b in plain.content]
        assert [getattr(b, "text", None) for b in streamed.content] == \
            [getattr(b, "text", None) for b in plain.content]
        assert streamed.stop_reason == plain.stop_reason
        assert streamed.usage.output_tokens == plain.usage.output_tokens
        assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == \
            plain.usage.input_tokens + plain.usage.cache_read_input_tokens


def sse_events(agent, body: dict) -> list[dict]:
    """The raw stream: every event's name must equal its data's type."""
    events = []
    with httpx.stream("POST", agent.url + "/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append(data)
    return events


DELTA_OF = {"text": {"text_delta"}, "tool_use": {"input_json_delta"},
            "thinking": {"thinking_delta", "signature_delta"}}


def check_event_order(events: list[dict]) -> None:
    """Anthropic's sequence: message_start, then blocks (start, deltas of the block's kind,
    stop; indexes 0, 1, ...), then message_delta with the stop reason, then message_stop."""
    kinds = [e["type"] for e in events if e["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    open_block, next_index = None, 0
    for e in events[1:-2]:
        if e["type"] == "content_block_start":
            assert open_block is None and e["index"] == next_index
            open_block, next_index = e["content_block"]["type"], next_index + 1
        elif e["type"] == "content_block_delta":
            assert e["index"] == next_index - 1 and e["delta"]["type"] in DELTA_OF[open_block]
        elif e["type"] == "content_block_stop":
            assert open_block is not None and e["index"] == next_index - 1
            open_block = None
        else:
            assert e["type"] == "ping", e
    assert open_block is None
    assert events[-2]["delta"]["stop_reason"] is not None


def test_stream_event_order(agent):
    body = {"model": agent.model, "max_tokens": 120, "temperature": 0, "stream": True,
            "messages": ASK, "tools": [WEATHER], "tool_choice": ONE_CALL}
    events = sse_events(agent, body)
    check_event_order(events)
    assert events[1]["type"] == "ping"
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts[0] == {"type": "tool_use", "id": starts[0]["id"], "name": "get_weather",
                         "input": {}}
    args = "".join(e["delta"]["partial_json"] for e in events
                   if e["type"] == "content_block_delta" and e["index"] == 0)
    jsonschema.validate(json.loads(args), WEATHER["input_schema"])
    final = events[-2]
    assert final["delta"]["stop_reason"] == "tool_use"
    assert final["usage"]["output_tokens"] > 0
    text_events = sse_events(agent, {**body, "tools": None, "tool_choice": None,
                                      "max_tokens": 16})
    check_event_order(text_events)
    assert text_events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


def test_tool_choice_any_yields_schema_valid_input_every_time(client, agent):
    for seed in range(6):
        # Sampling at temperature 1: only the grammar keeps the random model on the schema.
        msg = create(client, agent, temperature=1.0, tools=[WEATHER, CLOCK],
                     tool_choice=ONE_CALL, messages=[{"role": "user", "content": f"try {seed}"}])
        [(name, args)] = tool_uses(msg)
        jsonschema.validate(args, {"get_weather": WEATHER, "get_time": CLOCK}[name]
                            ["input_schema"])
        assert msg.stop_reason == "tool_use"


def test_parallel_calls_are_capped_when_disabled(client, agent):
    msg = create(client, agent, temperature=1.0, tools=[WEATHER], max_tokens=400,
                 tool_choice={"type": "tool", "name": "get_weather",
                              "disable_parallel_tool_use": True})
    assert len(tool_uses(msg)) == 1


def test_count_tokens_equals_the_prompt_the_request_used(client, agent):
    req = dict(system=[{"type": "text", "text": "Be brief.", "cache_control": {"type":
                                                                                 "ephemeral"}}],
               tools=[WEATHER, CLOCK], messages=ASK + [
                   {"role": "assistant", "content": "Let me check."},
                   {"role": "user", "content": [{"type": "text", "text": "Go on."}]}])
    counted = client.messages.count_tokens(model=agent.model, **req).input_tokens
    for _ in range(2):  # the second is served from the prefix cache
        usage = create(client, agent, max_tokens=4, **req).usage
        assert usage.cache_creation_input_tokens == 0
        assert usage.input_tokens + usage.cache_read_input_tokens == counted
    # all its full blocks but the one holding the last prompt token (always computed)
    bs = agent.engine.config.cache.block_size
    assert usage.cache_read_input_tokens == (counted - 1) // bs * bs


def test_thinking_blocks_pass_back_as_reasoning(client, agent):
    def count(assistant_content) -> int:
        messages = ASK + [{"role": "assistant", "content": assistant_content},
                          {"role": "user", "content": "And in Rome?"}]
        return client.messages.count_tokens(model=agent.model, messages=messages).input_tokens

    text = [{"type": "text", "text": "Sunny."}]
    thought = [{"type": "thinking", "thinking": "The user wants weather.", "signature": "s"}]
    redacted = [{"type": "redacted_thinking", "data": "opaque"}]
    # tiny-agent's template renders reasoning_content as a <think> block on every turn.
    assert count(thought + text) > count(text)
    assert count(redacted + text) == count(text)
    msg = create(client, agent, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 1024},
                 messages=ASK + [{"role": "assistant", "content": thought + text},
                                 {"role": "user", "content": "And in Rome?"}])
    assert msg.stop_reason in ("end_turn", "max_tokens")


def test_stop_sequence_is_reported(client, agent):
    free = create(client, agent, max_tokens=40)
    text = free.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    kw = {"max_tokens": 40, "stop_sequences": ["never-there", stop]}
    msg = create(client, agent, **kw)
    with client.messages.stream(**args(agent, kw)) as stream:
        streamed = stream.get_final_message()
    for m in (msg, streamed):
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
        assert m.content[0].text == text[:text.index(stop)]


def test_max_tokens_cuts_a_forced_call(client, agent):
    msg = create(client, agent, max_tokens=3, tools=[WEATHER], tool_choice={"type": "any"})
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_max_tokens_past_the_context_is_capped(client, agent):
    """Agents ask for more output than a small context holds (Claude Code: 32000): the
    request runs to the context's end and says so, instead of failing."""
    base = client.messages.count_tokens(model=agent.model, messages=ASK, tools=[WEATHER],
                                        tool_choice={"type": "any"}).input_tokens
    filler = "x " * ((agent.engine.max_model_len - base - 6) // 2)
    messages = [{"role": "user", "content": filler + ASK[0]["content"]}]
    counted = client.messages.count_tokens(model=agent.model, messages=messages,
                                           tools=[WEATHER]).input_tokens
    room = agent.engine.max_model_len - counted
    assert 0 < room < 20, room
    msg = create(client, agent, max_tokens=32000, messages=messages, tools=[WEATHER],
                 tool_choice={"type": "any"})
    assert msg.stop_reason == "model_context_window_exceeded"
    assert msg.usage.output_tokens == room
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        create(client, agent, messages=[{"role": "user", "content": filler * 2}])


def test_claude_code_shaped_request(client, agent):
    """What Claude Code sends: ?beta=true, beta headers, a Claude model id, system blocks with
    cache_control, draft-07 tool schemas, its user_id, thinking, 32000 max_tokens, a stream."""
    bash = {"name": "Bash", "description": "Run a command.", "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "additionalProperties": False, "required": ["command"],
        "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}}}}
    system = [{"type": "text", "text": "You are Claude Code."},
              {"type": "text", "text": "Be careful. " * 200, "cache_control": {"type":
                                                                                "ephemeral"}}]
    body = {"model": CLAUDE, "max_tokens": 32000, "stream": True, "temperature": 1,
            "system": system, "tools": [bash], "tool_choice": {"type": "auto"},
            "thinking": {"type": "enabled", "budget_tokens": 31999},
            "metadata": {"user_id": "user_abc_account__session_0f6e"},
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "List the files.", "cache_control": {"type":
                                                                              "ephemeral"}}]}]}
    counted = client.messages.count_tokens(
        model=CLAUDE, system=system, tools=[bash], messages=body["messages"],
        thinking=body["thinking"]).input_tokens
    # Leave ~60 tokens of context, so the capped turn ends quickly.
    body["system"][1]["text"] += "x " * ((agent.engine.max_model_len - counted - 60) // 2)
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "x-claude-code-session-id": "0f6e"}
    events = []
    with httpx.stream("POST", agent.url + "/v1/messages?beta=true", json=body,
                      headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    check_event_order(events)
    assert events[0]["message"]["model"] == CLAUDE
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "tool_use",
                                                  "model_context_window_exceeded")
    httpx.delete(agent.url + "/v1/sessions/user_abc_account__session_0f6e")


def test_server_tools_are_ignored_with_a_warning(client, agent):
    raw = client.messages.with_raw_response.create(
        model=agent.model, max_tokens=4, messages=ASK,
        tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "web_search" in raw.headers["x-loomserve-warning"]
    assert raw.parse().stop_reason in ("end_turn", "max_tokens")


def test_metadata_user_id_is_the_session(client, agent):
    def used() -> int:
        return agent.engine.stats().kv_blocks_used

    create(client, agent, max_tokens=2, metadata={"user_id": "claude-session-1"},
           messages=[{"role": "user", "content": "pinned " * 20}])
    assert used() > 0  # the finished turn's prefix stays pinned for its session
    assert httpx.delete(agent.url + "/v1/sessions/claude-session-1").status_code == 200
    agent.wait_idle()


BAD = {
    "unknown role": dict(messages=[{"role": "robot", "content": "hi"}]),
    "malformed tool schema": dict(tools=[{"name": "t", "input_schema": {"type": "array"}}]),
    "bad nested schema": dict(tools=[{"name": "t", "input_schema": {
        "type": "object", "properties": {"x": {"type": "strnig"}}}}]),
    "bad tool name": dict(tools=[{"name": "has space", "input_schema": {"type": "object"}}]),
    "unknown tool_use_id": dict(messages=[{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]),
    "image block": dict(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]),
    "image in a tool result": dict(messages=[
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "t",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "image", "source": {}}]}]}]),
    "tool_choice names no tool": dict(tools=[WEATHER],
                                      tool_choice={"type": "tool", "name": "nope"}),
    "temperature above 1": dict(temperature=1.5),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_400_in_anthropic_shape(client, agent, case):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, agent, **BAD[case])
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]
    if case.startswith("image"):
        assert "image" in body["error"]["message"] and "messages." in body["error"]["message"]
    assert create(client, agent, max_tokens=2).type == "message"  # still serving


def test_claude_model_id_served_as_an_alias(client, agent):
    msg = create(client, agent, model=CLAUDE, max_tokens=2)
    assert msg.model == CLAUDE
    assert create(client, agent, max_tokens=2).model == "tiny-agent"
    assert client.messages.count_tokens(model=CLAUDE, messages=ASK).input_tokens > 0


def test_missing_max_tokens_and_unknown_model(agent):
    r = httpx.post(agent.url + "/v1/messages", json={"model": agent.model, "messages": ASK})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(agent.url + "/v1/messages", json={"model": "claude-nope", "max_tokens": 2,
                                                     "messages": ASK})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(agent.url + "/v1/messages/count_tokens", json={"model": agent.model,
                                                                  "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
