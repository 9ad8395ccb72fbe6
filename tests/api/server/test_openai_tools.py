"""Tool calling through Chat Completions with the official client, on the tiny-agent fixture
(random weights: only the grammar makes its calls valid)."""

import json

import httpx
import pytest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
        "required": ["city"], "additionalProperties": False}}}
BOOKING = {"type": "function", "function": {
    "name": "book_table", "description": "Book a restaurant table.",
    "parameters": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "people": {"type": "integer", "minimum": 1, "maximum": 12},
        "terrace": {"type": "boolean"},
        "time": {"type": "string", "enum": ["noon", "evening"]}},
        "required": ["name", "people", "time"], "additionalProperties": False}}}
ASK = [{"role": "system", "content": "Use tools."},
       {"role": "user", "content": "What is the weather in Paris?"}]


def create(client, server, **kw):
    # Seeded sampling, not greedy: greedy on random weights picks the same filler (e.g. JSON
    # whitespace) forever; a seed keeps every test reproducible all the same.
    kw.setdefault("messages", ASK)
    kw.setdefault("temperature", 1.0)
    kw.setdefault("seed", 0)
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(model=server.model, **kw)


def check_args(schema: dict, arguments: str) -> dict:
    args = json.loads(arguments)
    try:
        import jsonschema
    except ImportError:  # a hand check of what the test schemas use
        assert set(schema.get("required", [])) <= set(args) <= set(schema["properties"])
        for key, value in args.items():
            sub = schema["properties"][key]
            assert "enum" not in sub or value in sub["enum"]
            assert sub["type"] != "integer" or isinstance(value, int)
    else:
        jsonschema.validate(args, schema)
    return args


def test_tool_round_trip_reuses_the_cached_prefix(agent_client, agent_server):
    first = create(agent_client, agent_server, tools=[WEATHER], tool_choice="required",
                   parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    check_args(WEATHER["function"]["parameters"], call.function.arguments)
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    second = create(agent_client, agent_server, messages=history, tools=[WEATHER],
                    max_tokens=4, extra_body={"ignore_eos": True})
    assert second.choices[0].finish_reason == "length"
    assert not second.choices[0].message.tool_calls
    block = agent_server.engine.config.cache.block_size
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    # turn 1's prompt is a prefix of turn 2's: its full blocks come from the cache
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // block * block > 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_required_gives_a_schema_valid_call_at_temperature_1(agent_client, agent_server, seed):
    r = create(agent_client, agent_server, tools=[WEATHER, BOOKING], tool_choice="required",
               temperature=1.0, seed=seed, max_tokens=200, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "book_table": BOOKING}[call.function.name]
    check_args(tool["function"]["parameters"], call.function.arguments)


def test_named_tool_choice_calls_that_tool(agent_client, agent_server):
    r = create(agent_client, agent_server, tools=[WEATHER, BOOKING], temperature=1.0, seed=7,
               tool_choice={"type": "function", "function": {"name": "book_table"}},
               max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert calls and all(c.function.name == "book_table" for c in calls)
    for c in calls:
        check_args(BOOKING["function"]["parameters"], c.function.arguments)


def _streamed_calls(chunks) -> list[dict]:
    """Calls assembled from stream deltas, checking the delta invariants on the way."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call: id, type, whole name
                    assert d.id and d.type == "function" and d.function.name
                    assert d.function.arguments == ""
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and not d.function.name
                    calls[d.index]["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)]


def test_stream_gives_the_same_calls_as_non_streaming(agent_client, agent_server):
    kw = dict(tools=[WEATHER, BOOKING], tool_choice="required", seed=11,
              parallel_tool_calls=False)
    full = create(agent_client, agent_server, **kw).choices[0]
    chunks = list(create(agent_client, agent_server, stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in full.message.tool_calls]
    assert _streamed_calls(chunks) == expected
    assert chunks[-1].choices[0].finish_reason == full.finish_reason == "tool_calls"
    assert all(json.loads(c["arguments"]) is not None for c in expected)


def test_tool_choice_none_and_auto_without_calls_give_text(agent_client, agent_server):
    for choice in ("none", "auto"):
        r = create(agent_client, agent_server, tools=[WEATHER], tool_choice=choice,
                   max_tokens=6, extra_body={"ignore_eos": True})
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "length" and not msg.tool_calls
        assert isinstance(msg.content, str)


def test_response_format_json_schema(agent_client, agent_server):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 0,
                                                         "maximum": 9}},
              "required": ["answer", "score"], "additionalProperties": False}
    r = create(agent_client, agent_server, temperature=1.0, seed=3, max_tokens=100,
               response_format={"type": "json_schema",
                                "json_schema": {"name": "verdict", "schema": schema,
                                                "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    check_args(schema, r.choices[0].message.content)


BAD = [
    ("tool without a name", {"tools": [{"type": "function", "function": {
        "parameters": {"type": "object"}}}]}, "tools"),
    ("parameters not an object schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    ("tool result for an unknown call", {"messages": ASK + [
        {"role": "tool", "tool_call_id": "call_nope", "content": "x"}]}, "messages"),
    ("invalid response_format schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}},
     "response_format"),
    ("unknown role", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("unknown named tool", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("legacy functions", {"functions": [{"name": "f"}]}, "functions"),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("top_logprobs above 20", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("logit_bias key not a token id", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias value out of range", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("min_tokens above max_tokens", {"min_tokens": 5}, "min_tokens"),
    ("tool_choice of another kind", {"tools": [WEATHER], "tool_choice": "sometimes"},
     "tool_choice"),
    ("non-function tool", {"tools": [{"type": "web_search"}]}, "tools"),
    ("store", {"store": True}, "store"),
]


def test_bad_tool_inputs_are_openai_400s_and_the_server_keeps_serving(agent_server,
                                                                      agent_client):
    failures = []
    with httpx.Client(base_url=agent_server.url, timeout=60) as http:
        for name, fields, param in BAD:
            body = {"model": agent_server.model, "messages": ASK, "max_tokens": 2, **fields}
            r = http.post("/v1/chat/completions", json=body)
            err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith(
                "application/json") else {}
            if not (r.status_code == 400 and set(err) == {"message", "type", "param", "code"}
                    and err["type"] == "invalid_request_error" and err["param"] == param):
                failures.append(f"{name}: {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)
    r = create(agent_client, agent_server, tools=[WEATHER], tool_choice="required",
               parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    agent_server.wait_idle()


def test_auto_with_a_strict_tool_runs_the_triggered_grammar(agent_client, agent_server):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    for seed in range(3):
        r = create(agent_client, agent_server, tools=[strict, BOOKING], seed=seed,
                   max_tokens=60, parallel_tool_calls=False)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        for call in r.choices[0].message.tool_calls or []:
            if call.function.name == "get_weather" and r.choices[0].finish_reason != "length":
                check_args(WEATHER["function"]["parameters"], call.function.arguments)
