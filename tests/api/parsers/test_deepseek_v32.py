"""DeepSeek-V3.2's DSML tool-call format (<｜DSML｜function_calls><｜DSML｜invoke name=...>
<｜DSML｜parameter name=... string="true|false">): a thinking turn split anywhere, streaming one
parameter at a time, the string flag, cut-off and malformed blocks, detection. The recorded
outputs in samples.py also run whole, char by char and at random cuts (test_tool_parsers.py)
and under fuzzing (test_fuzz.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve.api.chat.events import TextDelta, ToolCallArgs, ToolCallStart
from loomserve.api.chat.output_parser import ChatOutputParser
from loomserve.api.reasoning import detect_reasoning_parser, get_reasoning_parser
from loomserve.api.tool_parsers import detect_tool_parser, get_tool_parser
from tests.api.parsers.helpers import calls_of, chunks, fold, run, shape
from tests.api.parsers.samples import TOOLS

D = "｜DSML｜"


def parse(pieces: list[str]):
    return fold(run(get_tool_parser("deepseek_v32")(TOOLS), pieces))


def param(key: str, value: str, string: bool) -> str:
    flag = "true" if string else "false"
    return f'<{D}parameter name="{key}" string="{flag}">{value}</{D}parameter>\n'


# A thinking turn as DeepSeek-V3.2 writes it after "<｜Assistant｜><think>": reasoning, content,
# "\n\n", then one block of two calls (encoding_dsv32's layout: one tag a line).
TURN = ("The user wants weather.</think>Let me check.\n\n"
        f'<{D}function_calls>\n<{D}invoke name="get_weather">\n'
        + param("city", " São Paulo\n", True) + param("days", "5", False)
        + param("metric", "true", False) + param("hours", "[6, 12]", False)
        + param("opts", '{"wind": false}', False) + param("zip", "01310", True)
        + f'</{D}invoke>\n<{D}invoke name="search">\n'
        + param("query", '"quoted" & <b>bold</b>', True)
        + f"</{D}invoke>\n</{D}function_calls>")
TURN_CALLS = [("get_weather", {"city": " São Paulo\n", "days": 5, "metric": True,
                               "hours": [6, 12], "opts": {"wind": False}, "zip": "01310"}),
              ("search", {"query": '"quoted" & <b>bold</b>'})]


def _through_reasoning(pieces: list[str]):
    parser = ChatOutputParser(get_tool_parser("deepseek_v32")(TOOLS),
                              get_reasoning_parser("deepseek_r1")(starts_in_reasoning=True))
    return fold(run(parser, pieces))


def test_a_thinking_turn_with_content_and_two_calls():
    result = _through_reasoning([TURN])
    assert result.reasoning == "The user wants weather."
    assert result.content == "Let me check.\n\n"
    assert calls_of(result) == TURN_CALLS
    assert shape(_through_reasoning(list(TURN))) == shape(result)


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, len(TURN)), max_size=16))
def test_a_turn_split_anywhere_parses_the_same(cuts):
    assert shape(_through_reasoning(chunks(TURN, cuts))) == shape(_through_reasoning([TURN]))


def test_arguments_stream_one_complete_parameter_at_a_time():
    p = get_tool_parser("deepseek_v32")(TOOLS)
    events = p.feed(f'Sure.\n\n<{D}function_calls>\n<{D}invoke name="get_weather">\n'
                    f'<{D}parameter name="ci')
    assert events[0] == TextDelta("Sure.\n\n")
    assert isinstance(events[1], ToolCallStart) and events[1].name == "get_weather"
    assert [e.text for e in events[2:]] == ["{"]
    assert p.feed('ty" string="true">Par') == []  # the value may go on
    events = p.feed(f'is</{D}parameter>\n<{D}parameter name="days" string="false">')
    assert [e.text for e in events if isinstance(e, ToolCallArgs)] == ['"city": "Paris"']
    events = p.feed(f"3</{D}parameter>\n</{D}invoke>")
    assert "".join(e.text for e in events) == ', "days": 3}'
    assert p.feed(f"\n</{D}function_calls>") == [] and p.finish() == []


@pytest.mark.parametrize("text,content,calls", [
    # cut off inside the name: the text was not a call
    (f'Hi <{D}function_calls>\n<{D}invoke name="sea', f'Hi <{D}function_calls>\n<{D}invoke '
     'name="sea', []),
    (f"<{D}function_calls>", f"<{D}function_calls>", []),
    # no string flag: the schema types the value (stripped, as MiniMax-M2's); an unknown
    # parameter with string="false" and invalid JSON stays a string
    (f'<{D}function_calls><{D}invoke name="search"><{D}parameter name="limit"> 7 </{D}parameter>'
     f'<{D}parameter name="x" string="false">{{oops</{D}parameter></{D}invoke>'
     f"</{D}function_calls>", "", [("search", {"limit": 7, "x": "{oops"})]),
    # a schema of one type wins over the flag: a string parameter written as JSON stays text
    (f'<{D}function_calls><{D}invoke name="search">' + param("query", "[1]", False)
     + param("limit", "2.5", True) + f"</{D}invoke></{D}function_calls>", "",
     [("search", {"query": "[1]", "limit": 2.5})]),
    # V3.1's markers and MiniMax-M2's undecorated tags are content here
    ('<invoke name="search"></invoke> <｜tool▁calls▁begin｜>', '<invoke name="search"></invoke> '
     "<｜tool▁calls▁begin｜>", []),
])
def test_edges(text, content, calls):
    for pieces in ([text], list(text)):
        result = parse(pieces)
        assert (result.content, calls_of(result)) == (content, calls)


def test_detected_from_the_template_or_the_model_type():
    template = "{%- set dsml = '｜DSML｜' -%}<｜User｜>{{ c }}<｜Assistant｜><think>"
    assert detect_tool_parser(template, "deepseek_v32") == "deepseek_v32"
    assert detect_tool_parser(template, None) == "deepseek_v32"
    assert detect_tool_parser(None, "deepseek_v32") == "deepseek_v32"  # the release ships none
    assert detect_reasoning_parser(template, "deepseek_v32") == "deepseek_r1"
    assert get_tool_parser("deepseek_v32").call_format("search", {}) is None  # XML arguments
