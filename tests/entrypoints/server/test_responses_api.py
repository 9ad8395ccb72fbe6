"""OpenAI Responses API: the store, the input conversion, the output builder, and the official
`openai` client against a real engine on the tool-capable tiny fixture (tests/fixtures/tiny-agent)."""

import json
import os

import pytest

from loomserve.entrypoints.chat.output_parser import ChatOutputParser
from loomserve.entrypoints.reasoning import get_reasoning_parser
from loomserve.entrypoints.server.errors import APIError
from loomserve.entrypoints.server.response_store import ResponseStore, StoredResponse
from loomserve.entrypoints.server.responses_api import OutputBuilder
from loomserve.entrypoints.server.responses_protocol import convert_tools, to_messages
from loomserve.entrypoints.tool_parsers import get_tool_parser

from tests.entrypoints.server.conftest import running_server

TINY_AGENT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "fixtures",
                                          "tiny-agent"))
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
           "strict": True,
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city", "days"],
                          "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}}}}


# the store -------------------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

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


# input conversion ----------------------------------------------------------------------------

CODEX_INPUT = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [],
     "content": [{"type": "reasoning_text", "text": "Call the tool."}], "encrypted_content": None},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
     "arguments": "{\"city\": \"Paris\", \"days\": 1}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}]},
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


def test_non_function_tools_are_dropped_and_named():
    tools, ignored = convert_tools([{"type": "web_search"}, WEATHER, {"type": "local_shell"},
                                    {"type": "custom", "name": "apply_patch"}])
    assert [t["function"]["name"] for t in tools] == ["get_weather"]
    assert tools[0]["function"]["parameters"] == WEATHER["parameters"]
    assert ignored == ["web_search", "local_shell", "custom"]


# output builder ------------------------------------------------------------------------------

TURN = ("<think>The user wants weather.</think>\n\nLet me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
        "<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>\n')


def _build(chunks: list[str], parallel: bool = True) -> tuple[list[dict], list[dict]]:
    parser = ChatOutputParser(get_tool_parser("hermes")([WEATHER]),
                              get_reasoning_parser("qwen3")())
    builder, events = OutputBuilder(parallel), []
    for c in chunks:
        events += builder.feed(parser.feed(c))
    events += builder.feed(parser.finish()) + builder.close("completed")
    return builder.items, events


def _strip_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in i.items() if k != "id" and k != "call_id"} for i in items]


def test_builder_items_do_not_depend_on_chunking():
    whole, _ = _build([TURN])
    by_char, events = _build(list(TURN))
    assert _strip_ids(whole) == _strip_ids(by_char)
    assert [i["type"] for i in whole] == ["reasoning", "message", "function_call", "function_call"]
    assert whole[0]["content"] == [{"type": "reasoning_text", "text": "The user wants weather."}]
    assert whole[1]["content"][0]["text"].strip() == "Let me check."
    assert [json.loads(i["arguments"]) for i in whole[2:]] == [{"city": "Paris", "days": 2},
                                                              {"city": "Rome", "days": 1}]
    assert all(i["status"] == "completed" for i in whole)
    # Every item is added, then done, in output order; deltas rebuild the final texts.
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2, 3]
    args = "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == 3)
    assert args == by_char[3]["arguments"]


def test_builder_drops_whitespace_messages_and_extra_calls_when_not_parallel():
    items, _ = _build([TURN.replace("Let me check.", "")], parallel=False)
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert json.loads(items[1]["arguments"])["city"] == "Paris"
