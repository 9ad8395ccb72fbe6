"""MiniMax-M2's tool-call format (<minimax:tool_call><invoke name=...><parameter name=...>):
streaming one parameter at a time, cut-off and malformed blocks, schema typing, detection.
The recorded outputs in samples.py also run whole, char by char and at random cuts
(test_tool_parsers.py) and under fuzzing (test_fuzz.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve.api.chat.events import TextDelta, ToolCallArgs, ToolCallStart
from loomserve.api.chat.output_parser import ChatOutputParser
from loomserve.api.reasoning import detect_reasoning_parser, get_reasoning_parser
from loomserve.api.tool_parsers import detect_tool_parser, get_tool_parser
from tests.api.parsers.helpers import calls_of, chunks, fold, run, shape
from tests.api.parsers.samples import TOOLS


def parse(pieces: list[str]):
    return fold(run(get_tool_parser("minimax_m2")(TOOLS), pieces))


# A turn as MiniMax-M2 writes it after its template's "]~b]ai\n<think>\n": reasoning, content,
# then a block of two calls whose values the schema types (integer, boolean, array, object).
TURN = ("The user wants weather.\n</think>\n\nLet me check.\n<minimax:tool_call>\n"
        '<invoke name="get_weather">\n<parameter name="city">São Paulo</parameter>\n'
        '<parameter name="days">5</parameter>\n<parameter name="metric">true</parameter>\n'
        '<parameter name="hours">[6, 12]</parameter>\n<parameter name="opts">{"wind": '
        'false}</parameter>\n<parameter name="zip">01310</parameter>\n</invoke>\n'
        '<invoke name="search">\n<parameter name="query">"quoted" & <b>bold</b></parameter>\n'
        "</invoke>\n</minimax:tool_call>")
TURN_CALLS = [("get_weather", {"city": "São Paulo", "days": 5, "metric": True, "hours": [6, 12],
                               "opts": {"wind": False}, "zip": "01310"}),
              ("search", {"query": '"quoted" & <b>bold</b>'})]


def _through_reasoning(pieces: list[str]):
    parser = ChatOutputParser(get_tool_parser("minimax_m2")(TOOLS),
                              get_reasoning_parser("qwen3")(starts_in_reasoning=True))
    return fold(run(parser, pieces))


def test_a_turn_with_reasoning_content_and_two_calls():
    result = _through_reasoning([TURN])
    assert result.reasoning == "The user wants weather.\n"
    assert result.content == "Let me check.\n"
    assert calls_of(result) == TURN_CALLS
    assert shape(_through_reasoning(list(TURN))) == shape(result)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(TURN)), max_size=16))
def test_a_turn_split_anywhere_parses_the_same(cuts):
    assert shape(_through_reasoning(chunks(TURN, cuts))) == shape(_through_reasoning([TURN]))


def test_arguments_stream_one_complete_parameter_at_a_time():
    p = get_tool_parser("minimax_m2")(TOOLS)
    events = p.feed('Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="ci')
    assert events[0] == TextDelta("Sure.\n")
    assert isinstance(events[1], ToolCallStart) and events[1].name == "get_weather"
    assert [e.text for e in events[2:]] == ["{"]
    events = p.feed('ty">Par')
    assert events == []  # the value may go on
    events = p.feed('is</parameter>\n<parameter name="days">')
    assert [e.text for e in events if isinstance(e, ToolCallArgs)] == ['"city": "Paris"']
    events = p.feed("3</parameter>\n</invoke>")
    assert "".join(e.text for e in events) == ', "days": 3}'
    assert p.feed("\n</minimax:tool_call>") == [] and p.finish() == []


@pytest.mark.parametrize("text,content,calls", [
    # cut off inside a value: the complete parameters stay, the call is closed
    ('<minimax:tool_call>\n<invoke name="search">\n<parameter name="limit">5</parameter>\n'
     '<parameter name="query">partial', "", [("search", {"limit": 5})]),
    # cut off inside the name: the text was not a call
    ('Hi <minimax:tool_call>\n<invoke name="sea', 'Hi <minimax:tool_call>\n<invoke name="sea', []),
    # a block with no call in it is content, tags included
    ("<minimax:tool_call>no call here</minimax:tool_call>",
     "<minimax:tool_call>no call here</minimax:tool_call>", []),
    ("<minimax:tool_call>", "<minimax:tool_call>", []),
    # the next <invoke closes a call whose </invoke> is missing; a missing block end too
    ('<minimax:tool_call><invoke name="search"><parameter name="query">a</parameter>'
     '<invoke name="search"><parameter name="query">b</parameter>', "",
     [("search", {"query": "a"}), ("search", {"query": "b"})]),
    # a value stripped of surrounding whitespace (vLLM's and MiniMax's parsers do), "null" kept
    # as a string for a string parameter, an unknown parameter kept as a string
    ('<minimax:tool_call><invoke name="search"><parameter name="query">\n  null  \n</parameter>'
     '<parameter name="extra">[1]</parameter></invoke></minimax:tool_call>', "",
     [("search", {"query": "null", "extra": "[1]"})]),
    # text that only looks like the tag is content
    ("<minimax:tool_cal> and <minimax:", "<minimax:tool_cal> and <minimax:", []),
])
def test_edges(text, content, calls):
    for pieces in ([text], list(text)):
        result = parse(pieces)
        assert (result.content, calls_of(result)) == (content, calls)


def test_unknown_tool_arguments_stay_strings():
    result = parse(['<minimax:tool_call><invoke name="other"><parameter name="n">3</parameter>'
                    "</invoke></minimax:tool_call>"])
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [("other", {"n": "3"})]


def test_detected_from_the_template_or_the_model_type():
    template = "{%- set toolcall_begin_token = '<minimax:tool_call>' -%}<think>"
    assert detect_tool_parser(template, None) == "minimax_m2"
    assert detect_tool_parser(None, "minimax_m2") == "minimax_m2"
    assert detect_reasoning_parser(template, "minimax_m2") == "qwen3"
    assert get_tool_parser("minimax_m2").call_format("search", {}) is None  # XML arguments
