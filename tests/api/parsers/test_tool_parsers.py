"""Each format's parser on recorded outputs: whole, one character at a time, and any chunking."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve.api.chat.events import TextDelta, ToolCallArgs, ToolCallStart
from loomserve.api.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.api.parsers.helpers import calls_of, chunks, fold, run, shape
from tests.api.parsers.samples import HARMONY_REASONING, SAMPLES, TOOLS

IDS = [f"{s[0]}-{i}" for i, s in enumerate(SAMPLES)]


def parse(name: str, pieces: list[str]):
    return fold(run(get_tool_parser(name)(TOOLS), pieces))


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_sample_parses_whole_and_char_by_char(sample):
    name, text, content, expected = sample
    whole = parse(name, [text])
    assert whole.content == content
    assert calls_of(whole) == expected
    assert shape(parse(name, list(text))) == shape(whole)


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 2000), max_size=12))
def test_any_chunking_gives_the_same_result(sample, cuts):
    name, text, _, _ = sample
    assert shape(parse(name, chunks(text, cuts))) == shape(parse(name, [text]))


def test_harmony_reasoning_is_the_analysis_channel():
    harmony = [s for s in SAMPLES if s[0] == "harmony"]
    for i, (_, text, _, _) in enumerate(harmony):
        assert parse("harmony", list(text)).reasoning == HARMONY_REASONING[i]


def test_ids_are_openai_style_or_the_formats_own():
    hermes = next(s for s in SAMPLES if s[0] == "hermes")
    ids = [c.id for c in parse("hermes", [hermes[1]]).tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
    kimi = next(s for s in SAMPLES if s[0] == "kimi_k2")
    ids = [c.id for c in parse("kimi_k2", [kimi[1]]).tool_calls]
    assert ids == ["functions.get_weather:0", "functions.search:1"]


def test_arguments_stream_before_the_call_ends():
    p = get_tool_parser("hermes")(TOOLS)
    events = p.feed('<tool_call>\n{"name": "search", "arguments": {"query": "long te')
    assert isinstance(events[0], ToolCallStart) and events[0].name == "search"
    assert "".join(e.text for e in events if isinstance(e, ToolCallArgs)) == '{"query": "long te'
    events = p.feed('xt", "limit": 1')  # the number may go on: held back
    assert "".join(e.text for e in events if isinstance(e, ToolCallArgs)) == 'xt"'
    events = p.feed("0}}\n</tool_call>")
    assert "".join(e.text for e in events) == ', "limit": 10}'


@pytest.mark.parametrize("name", sorted(set(TOOL_PARSERS) - {"harmony"}))
def test_marker_prefixes_are_held_back_then_released(name):
    # (harmony's markers are special tokens that frame every message: an unfinished header
    # is markup, dropped, not content)
    parser = get_tool_parser(name)(TOOLS)
    trigger = parser.triggers[0]
    held = "Hello " + trigger[:-1]
    events = parser.feed(held)
    assert trigger[:-1] not in "".join(e.text for e in events if isinstance(e, TextDelta))
    assert fold(events + parser.finish()).content.endswith(trigger[:-1])


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "search", "arguments": {"query": "cut off',
    '<tool_call>\n{"name": "search", "arguments": {"query": "a\\',
    '<tool_call>\n{"name": "search", "arguments": {"query": "q", "limit": 1.',
    '<tool_call>\n{"name": "search", "arguments": {"query": "q", "lim',
    '<tool_call>\n{"name": "search", "arguments": {"query": [1, {"a": tru}]}}\n</tool_call>ok',
])
def test_a_started_call_cut_off_or_invalid_is_closed_as_valid_json(text):
    for pieces in ([text], list(text)):
        result = parse("hermes", pieces)
        assert [c.name for c in result.tool_calls] == ["search"]
        args = json.loads(result.tool_calls[0].arguments)
        assert "query" not in args or args["query"] in ("cut off", "a", "q", [1, {}])


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_call_format_is_parsed_back(name):
    cls = get_tool_parser(name)
    schema = WEATHER_PARAMS = TOOLS[0]["function"]["parameters"]
    fmt = cls.call_format("get_weather", WEATHER_PARAMS)
    if name in ("qwen3_coder", "glm45", "minimax_m2", "deepseek_v32"):
        assert fmt is None  # XML arguments: the caller forces hermes instead
        return
    assert json.loads(fmt.schema) == schema
    assert any(fmt.begin.startswith(t) for t in cls.triggers)
    args = {"city": "Paris", "days": 3}
    one = fmt.begin + json.dumps(args) + fmt.end
    text = one + cls.call_separator + one
    result = parse(name, list(text))
    assert calls_of(result) == [("get_weather", args)] * 2
    assert result.content == ""


def test_get_tool_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name", sorted(set(TOOL_PARSERS) - {"qwen3_coder", "glm45",
                                                         "minimax_m2", "deepseek_v32"}))
@pytest.mark.parametrize("required", [True, False])
def test_the_grammar_of_a_call_format_accepts_what_the_parser_reads(name, required):
    """The engine's structural tag (tool_choice required: calls joined by the separator; auto:
    free text, then a trigger opens a call) accepts the text, and the parser reads the calls."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    from loomserve.execution.structured.grammar import structural_tag
    from loomserve.sampling_params import ToolCallGrammar

    cls = get_tool_parser(name)
    fmt = cls.call_format("get_weather", TOOLS[0]["function"]["parameters"])
    grammar = ToolCallGrammar(calls=[fmt], required=required, separator=cls.call_separator,
                              triggers=list(cls.triggers))
    compiled = xgr.Grammar.from_structural_tag(json.dumps(structural_tag(grammar)))
    one = fmt.begin + json.dumps({"city": "Paris", "days": 3}) + fmt.end
    text = one + cls.call_separator + one if required else "Sure. " + one
    assert _is_grammar_accept_string(compiled, text)
    result = parse(name, list(text))
    assert calls_of(result) == [("get_weather", {"city": "Paris", "days": 3})] * (
        2 if required else 1)
    assert result.content == ("" if required else "Sure. ")
