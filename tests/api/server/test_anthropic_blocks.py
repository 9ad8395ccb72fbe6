"""The Anthropic Messages API's parts that need no server: the conversion of a request to the
neutral chat request, and the content blocks built from a real output parser's events (checked
with the `anthropic` client's own stream accumulator)."""

from __future__ import annotations

import pytest

from tests.api.server.test_anthropic_api import ASK, WEATHER

pytest.importorskip("anthropic")


def test_thinking_text_and_calls_stream_into_the_same_message():
    """The block assembly over a real output parser (Hermes calls, <think> reasoning): the
    client's own stream accumulator builds exactly the non-streaming content, whatever the
    chunking; the thinking block carries a signature."""
    from anthropic.lib.streaming._messages import accumulate_event

    from loomserve.api.anthropic_api import BlockAssembler
    from loomserve.api.chat.output_parser import ChatOutputParser
    from loomserve.api.reasoning import get_reasoning_parser
    from loomserve.api.tool_parsers import get_tool_parser

    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": WEATHER["input_schema"]}}]
    text = ('<think>\nThe user asks about Paris.\n</think>\n\nChecking.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris", "metric": true}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Rome", "metric": false}}\n</tool_call>')

    def run(step: int):
        parser = ChatOutputParser(get_tool_parser("hermes")(tools),
                                  get_reasoning_parser("qwen3")(False))
        blocks, events = BlockAssembler(), []
        for i in range(0, len(text), step):
            events += blocks.feed(parser.feed(text[i:i + step]))
        events += blocks.feed(parser.finish()) + blocks.close()
        return blocks.blocks, events

    whole, _ = run(len(text))
    assert [b["type"] for b in whole] == ["thinking", "text", "tool_use", "tool_use"]
    assert whole[0]["thinking"].strip() == "The user asks about Paris." and whole[0]["signature"]
    assert [b["input"] for b in whole[2:]] == [{"city": "Paris", "metric": True},
                                               {"city": "Rome", "metric": False}]
    for step in (1, 2, 7):
        blocks, events = run(step)
        start = {"type": "message_start", "message": {
            "id": "msg_x", "type": "message", "role": "assistant", "model": "m", "content": [],
            "usage": {"input_tokens": 1, "output_tokens": 0}}}
        snapshot, json_bufs = None, {}
        for e in [start] + events:
            snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=json_bufs)
        built = [b.to_dict() for b in snapshot.content]
        for b in built:
            b.pop("citations", None)
        assert built == blocks and blocks == whole[:2] + [
            {**b, "id": blocks[i + 2]["id"]} for i, b in enumerate(whole[2:])]


def test_parallel_cap_drops_later_calls():
    from loomserve.api.anthropic_api import BlockAssembler
    from loomserve.api.chat.events import ToolCallArgs, ToolCallStart

    blocks = BlockAssembler(max_calls=1)
    events = blocks.feed([ToolCallStart(0, "a", "f"), ToolCallArgs(0, "{}"),
                          ToolCallStart(1, "b", "f"), ToolCallArgs(1, '{"x": 1}')])
    events += blocks.close()
    assert [b["type"] for b in blocks.blocks] == ["tool_use"]
    assert {e["index"] for e in events} == {0}


def test_conversion_to_the_neutral_chat_request():
    from loomserve.api.anthropic_protocol import MessagesRequest

    def convert(**kw):
        body = {"model": "m", "max_tokens": 8, "messages": ASK, **kw}
        return MessagesRequest.model_validate(body).to_chat_request()

    req, ignored = convert(
        system=[{"type": "text", "text": "A."}, {"type": "text", "text": "B."}],
        tools=[WEATHER, {"type": "web_search_20250305", "name": "web_search"}],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=ASK + [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "redacted_thinking", "data": "x"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Rome", "metric": True}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                 "content": [{"type": "text", "text": "timeout"}]},
                {"type": "text", "text": "Retry."}]}])
    assert ignored == ["web_search (web_search_20250305)"]
    assert req.messages == [
        {"role": "system", "content": "A.\nB."}, ASK[0],
        {"role": "assistant", "content": "", "reasoning_content": "hm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Rome", "metric": true}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather",
         "content": "Error: timeout"},
        {"role": "user", "content": "Retry."}]
    assert [t["function"]["name"] for t in req.tools] == ["get_weather"]
    assert req.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert req.parallel_tool_calls is False and req.template_kwargs == {}
    assert convert(tools=[WEATHER], tool_choice={"type": "any"})[0].tool_choice == "required"
    # Claude Code's mid-conversation system reminders stay system turns where they stand.
    reminder = [{"type": "text", "text": "<system-reminder>R</system-reminder>"}]
    mid = convert(messages=ASK + [{"role": "system", "content": reminder}])[0].messages
    assert mid[-1] == {"role": "system", "content": "<system-reminder>R</system-reminder>"}
    for kind, flag in (("enabled", True), ("adaptive", True), ("disabled", False)):
        thinking = {"type": kind, "budget_tokens": 2048}
        assert convert(thinking=thinking)[0].template_kwargs == {"enable_thinking": flag}
    fmt = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    assert convert(output_config=fmt)[0].response_format["json_schema"]["schema"] == \
        {"type": "object"}
