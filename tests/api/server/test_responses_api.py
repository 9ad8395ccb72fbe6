"""OpenAI Responses API: the store, the input conversion, the output builder, and the official
`openai` client against a real engine on the tool-capable tiny fixture (tiny-agent)."""

import json

import openai
import pytest
from openai.types.responses import Response

from loomserve.api.chat.output_parser import ChatOutputParser
from loomserve.api.errors import APIError
from loomserve.api.reasoning import get_reasoning_parser
from loomserve.api.response_store import ResponseStore, StoredResponse
from loomserve.api.responses_api import OutputBuilder
from loomserve.api.responses_protocol import convert_tools, to_messages
from loomserve.api.tool_parsers import get_tool_parser
from tests.api.server.conftest import TINY_AGENT, running_server

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
           "strict": True,
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city", "days"],
                          # Bounded, so a random tiny model's call ends well within limits.
                          "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 14}}}}

# Codex groups its sub-agent tools in a namespace tool.
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
          "tools": [{"type": "function", "name": "spawn_agent", "strict": False,
                     "parameters": {"type": "object", "properties": {
                         "task": {"type": "string"}}}}]}


# the store -------------------------------------------------------------------------------------

class FakeClock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _entry(n: int) -> StoredResponse:
    return StoredResponse({"id": f"r{n}"}, [{"type": "message", "role": "user", "content": "x"}])


def test_store_is_bounded_lru():
    store = ResponseStore(max_size=2, ttl_s=60)
    store.put("a", _entry(1))
    store.put("b", _entry(2))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", _entry(3))
    assert len(store) == 2 and store.get("b") is None
    assert store.get("a").response == {"id": "r1"} and store.get("c") is not None
    assert store.delete("a") and not store.delete("a") and store.get("a") is None


def test_store_entries_expire():
    clock = FakeClock()
    store = ResponseStore(max_size=8, ttl_s=0.5, clock=clock)
    store.put("a", _entry(1))
    clock.now = 0.3
    store.put("b", _entry(2))
    assert store.get("a") is not None
    clock.now = 0.5  # a is 0.5 s old: expired, even though it was just used
    assert store.get("a") is None and store.get("b") is not None
    clock.now = 0.81
    assert store.get("b") is None and len(store) == 0


def test_store_charges_each_turn_its_own_items_and_bounds_the_total():
    history = [{"type": "message", "role": "user", "content": "x" * 100}]
    store = ResponseStore(max_size=8, ttl_s=60, max_chars=400)
    store.put("a", StoredResponse({"id": "a"}, history))
    own = store.get("a").size
    assert own > 100 and store.chars == own
    # A follow-up shares a's items: it is charged only for its own new one.
    follow = StoredResponse({"id": "b"}, history + [{"type": "message", "role": "user",
                                                    "content": "y"}], new_from=1)
    store.put("b", follow)
    assert follow.size < own / 2 and store.chars == own + follow.size
    store.put("c", StoredResponse({"id": "c"}, history * 2))  # over the budget: a goes
    assert store.get("a") is None and store.get("b") and store.get("c")
    assert store.chars == follow.size + store.get("c").size <= 400
    store.put("d", StoredResponse({"id": "d"}, history * 4))  # alone over the budget
    assert store.get("d") is None and len(store) == 2
    assert store.delete("b") and store.chars == store.get("c").size


# input conversion ----------------------------------------------------------------------------

CODEX_INPUT = [
    {"type": "message", "role": "developer",
     "content": [{"type": "input_text", "text": "Be brief."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [],
     "content": [{"type": "reasoning_text", "text": "Call the tool."}], "encrypted_content": None},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
     "arguments": "{\"city\": \"Paris\", \"days\": 1}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"role": "assistant",
     "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}]},
]


def test_input_items_become_neutral_messages():
    msgs = to_messages(CODEX_INPUT, "You are a coding agent.")
    assert msgs == [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}]


@pytest.mark.parametrize("items, param", [
    ([{"role": "robot", "content": "hi"}], "input[0].role"),
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "input[0].call_id"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "input[0].content[0].type"),
    ([{"type": "web_search_call", "id": "ws_1"}], "input[0].type"),
    ([{"type": "function_call", "call_id": "c", "name": "f"}], "input[0].arguments"),
])
def test_bad_input_items_name_their_param(items, param):
    with pytest.raises(APIError) as e:
        to_messages(items, None)
    assert e.value.status_code == 400 and e.value.param == param


def test_non_function_tools_are_dropped_and_namespaces_flattened():
    dup = {"type": "function", "name": "get_weather"}
    agents = dict(AGENTS, tools=AGENTS["tools"] + [dup])
    toolset = convert_tools([{"type": "web_search"}, WEATHER, {"type": "local_shell"},
                             {"type": "custom", "name": "apply_patch"}, agents])
    assert [t["function"]["name"] for t in toolset.tools] == ["get_weather", "spawn_agent"]
    assert toolset.tools[0]["function"]["parameters"] == WEATHER["parameters"]
    assert toolset.ignored == ["web_search", "local_shell", "custom",
                               "get_weather (duplicate name)"]
    assert toolset.namespace_of == {"spawn_agent": "multi_agent_v1"}


# output builder ------------------------------------------------------------------------------

TURN = ("<think>The user wants weather.</think>\n\nLet me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        "<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>\n')


def _build(chunks: list[str], parallel: bool = True) -> tuple[list[dict], list[dict]]:
    parser = ChatOutputParser(get_tool_parser("hermes")([WEATHER]),
                              get_reasoning_parser("qwen3")())
    builder, events = OutputBuilder(parallel, {"get_weather": "weather_ns"}), []
    for c in chunks:
        events += builder.feed(parser.feed(c))
    events += builder.feed(parser.finish()) + builder.close("completed")
    return builder.items, events


def _validate_events(events: list[dict]) -> None:
    """Each event validates strictly (every required field) as the openai package's type."""
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    for n, ev in enumerate(events):
        typed = adapter.validate_python({**ev, "sequence_number": n})
        assert typed.type == ev["type"], ev


def _strip_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in i.items() if k != "id" and k != "call_id"} for i in items]


def test_builder_items_do_not_depend_on_chunking():
    whole, _ = _build([TURN])
    by_char, events = _build(list(TURN))
    _validate_events(events)
    assert _strip_ids(whole) == _strip_ids(by_char)
    assert [i["type"] for i in whole] == ["reasoning", "message", "function_call", "function_call"]
    assert whole[0]["content"] == [{"type": "reasoning_text", "text": "The user wants weather."}]
    assert whole[1]["content"][0]["text"].strip() == "Let me check."
    assert [json.loads(i["arguments"]) for i in whole[2:]] == [{"city": "Paris", "days": 2},
                                                              {"city": "Rome", "days": 1}]
    assert all(i["status"] == "completed" for i in whole)
    assert [i.get("namespace") for i in whole[2:]] == ["weather_ns", "weather_ns"]
    # Every item is added, then done, in output order; deltas rebuild the final texts.
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]
    args = "".join(e["delta"] for e in events if e["output_index"] == 3
                   and e["type"] == "response.function_call_arguments.delta")
    assert args == by_char[3]["arguments"]


def test_builder_drops_whitespace_messages_and_extra_calls_when_not_parallel():
    items, _ = _build([TURN.replace("Let me check.", "")], parallel=False)
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert json.loads(items[1]["arguments"])["city"] == "Paris"


# the official client against a real engine ---------------------------------------------------

@pytest.fixture
def agent(agent_server, agent_client):
    return agent_server, agent_client  # conftest's session-wide tiny-agent server


def create(agent, **kw):
    srv, client = agent
    kw.setdefault("temperature", 0)
    return client.responses.create(model=srv.model, **kw)


def _calls(resp) -> list[tuple[str, dict]]:
    return [(o.name, json.loads(o.arguments)) for o in resp.output if o.type == "function_call"]


def _items(resp) -> list[dict]:
    # parsed_arguments: what client.responses.stream adds on its side.
    return _strip_ids([o.model_dump(exclude_none=True, exclude={"parsed_arguments"})
                       for o in resp.output])


def test_tool_round_trip_stateless_and_stored(agent):
    first = create(agent, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                   parallel_tool_calls=False, max_output_tokens=200, instructions="Use tools.")
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.status == "completed" and first.output[-1].type == "function_call"
    (name, args), = _calls(first)
    assert name == "get_weather" and set(args) == {"city", "days"}
    call = first.output[-1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    u = first.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens > 0
    # Stateless: the whole conversation again; stored: only the new item.
    replay = [{"role": "user", "content": "Weather in Paris?"}] + [
        o.model_dump(exclude_none=True) for o in first.output] + [result]
    follow = dict(tools=[WEATHER], tool_choice="none", max_output_tokens=12,
                  instructions="Use tools.", extra_body={"ignore_eos": True})
    stateless = create(agent, input=replay, **follow)
    stored = create(agent, input=[result], previous_response_id=first.id, **follow)
    assert stored.previous_response_id == first.id
    assert stored.usage.input_tokens == stateless.usage.input_tokens > u.input_tokens
    assert stored.output_text == stateless.output_text
    assert _calls(stored) == _calls(stateless) == []
    # The chain continues from the follow-up, which kept the whole conversation.
    third = create(agent, input="Thanks.", previous_response_id=stored.id, **follow)
    assert third.usage.input_tokens > stored.usage.input_tokens + stored.usage.output_tokens


def test_stream_and_non_stream_give_the_same_output(agent):
    srv, client = agent
    kw = dict(model=srv.model, input="Weather in Rome?", tools=[WEATHER],
              tool_choice="required", parallel_tool_calls=False, max_output_tokens=200,
              temperature=0)
    full = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    _validate_events([e.to_dict() for e in events])
    Response.model_validate(full.to_dict())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"
    streamed = events[-1].response
    assert _items(streamed) == _items(full) and _calls(full)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == [o.type for o in full.output]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(o.arguments for o in full.output if o.type == "function_call")
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert _items(final) == _items(full) and final.status == "completed"


def test_tool_choice_required_gives_schema_valid_arguments(agent):
    for seed in range(6):
        r = create(agent, input="Weather?", tools=[WEATHER], tool_choice="required",
                   parallel_tool_calls=False, temperature=1.0, max_output_tokens=200,
                   extra_body={"seed": seed})
        calls = _calls(r)
        assert calls and r.status == "completed"
        for name, args in calls:
            assert name == "get_weather" and set(args) == {"city", "days"}
            assert isinstance(args["city"], str) and len(args["city"]) <= 12
            assert type(args["days"]) is int and 1 <= args["days"] <= 14


@pytest.mark.parametrize("stream", [False, True])
def test_codex_shaped_request_is_accepted_and_warns_about_dropped_tools(agent, stream):
    srv, client = agent
    raw = client.responses.with_raw_response.create(
        model=srv.model, instructions="You are Codex.",
        input=CODEX_INPUT + [{"role": "user", "content": "And tomorrow?"}],
        tools=[WEATHER, {"type": "web_search", "external_web_access": False}, {"type": "ünï\n"},
               {"type": "local_shell"}, AGENTS],
        tool_choice="auto", parallel_tool_calls=False, reasoning={"effort": "low"},
        store=False, include=["reasoning.encrypted_content"], prompt_cache_key="codex-1",
        max_output_tokens=8, temperature=0, stream=stream)
    warning = raw.headers.get("x-loomserve-warning")
    assert warning is not None and "web_search" in warning and "local_shell" in warning
    assert "?n??" in warning  # not ASCII: replaced
    r = raw.parse()
    if stream:
        events = list(r)
        assert events[-1].type in ("response.completed", "response.incomplete")
        r = events[-1].response
    assert r.status in ("completed", "incomplete") and r.prompt_cache_key == "codex-1"
    assert [t.type for t in r.tools] == ["function", "namespace"]
    Response.model_validate(r.to_dict())
    assert r.parallel_tool_calls is False
    assert r.usage.input_tokens > 100  # the whole history was rendered
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(r.id)


def test_stored_responses_can_be_read_and_deleted(agent):
    srv, client = agent
    r = create(agent, input="Hello", max_output_tokens=3, metadata={"k": "v"})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_unknown_previous_response_id_is_not_found(agent):
    with pytest.raises(openai.NotFoundError) as e:
        create(agent, input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"


BAD = [
    (dict(input=[{"role": "robot", "content": "hi"}]), "input[0].role"),
    (dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}]),
     "input[0].call_id"),
    (dict(input="hi", tools=[{"type": "function", "name": "f", "parameters": "nope"}]),
     "tools[0].parameters"),
    (dict(input="hi", tools=[{"type": "function", "name": "f",
                              "parameters": {"type": "objekt"}}]), None),
    (dict(input="hi", text={"format": {"type": "json_schema", "name": "x",
                                       "schema": {"type": "object", "minProperties": "two"}}}),
     None),
    (dict(input="hi", tool_choice="sometimes"), "tool_choice"),
]


@pytest.mark.parametrize("kw, param", BAD)
def test_bad_requests_are_400_and_the_server_keeps_serving(agent, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        create(agent, max_output_tokens=2, **kw)
    body = e.value.body
    assert body["type"] == "invalid_request_error" and body["message"]
    if param is not None:
        assert body["param"] == param
    assert create(agent, input="ok", max_output_tokens=2).status == "incomplete"


def test_a_core_failure_mid_stream_is_an_in_band_error_event():
    # The core's step loop faults on its 20th step, well inside this 150-token stream.
    env = {"LOOMSERVE_FAULT_INJECT": "step:20", "LOOMSERVE_STEP_DELAY_MS": "20"}
    with running_server(core_env=env, model=TINY_AGENT) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        events = list(client.responses.create(model=srv.model, input="hi", stream=True,
                                              max_output_tokens=150,
                                              extra_body={"ignore_eos": True}))
    assert events[0].type == "response.created"
    assert events[-1].type == "error" and events[-1].code == "engine_core_failed"
    assert "injected fault" in events[-1].message
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert any(e.type == "response.output_text.delta" for e in events)


def test_text_format_json_schema_through_responses_parse(agent):
    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: str = Field(max_length=12)
        days: int = Field(ge=1, le=14)

    srv, client = agent
    r = client.responses.parse(model=srv.model, input="Forecast for Oslo, as JSON.",
                               text_format=Forecast, temperature=0, max_output_tokens=200)
    assert r.status == "completed" and isinstance(r.output_parsed, Forecast)
    assert r.text.format.type == "json_schema" and r.text.format.name == "Forecast"
