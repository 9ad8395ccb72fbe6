"""Arbitrary text made of each format's markers and JSON pieces: every parser keeps the event
invariants (fold() checks them: start before arguments, arguments valid JSON) and gives the
same result however the text is chunked."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve.api.chat.output_parser import ChatOutputParser
from loomserve.api.reasoning import get_reasoning_parser
from loomserve.api.tool_parsers import TOOL_PARSERS, get_tool_parser
from tests.api.parsers.helpers import chunks, fold, run, shape
from tests.api.parsers.samples import SAMPLES, TOOLS

MARKERS = {
    "hermes": ["<tool_call>", "</tool_call>", "[", "]", ","],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=search>", "</function>",
                    "<parameter=query>", "<parameter=limit>", "</parameter>", "<function="],
    "llama3_json": ["<|python_tag|>", ";", '{"name"', '"parameters"'],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[", "]", "search"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "function", "```json", "search"],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                "functions.search:0"],
    "glm45": ["<tool_call>", "</tool_call>", "search", "<arg_key>", "</arg_key>", "<arg_value>",
              "</arg_value>"],
    "minimax_m2": ["<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="search">',
                   "</invoke>", '<parameter name="query">', '<parameter name="limit">',
                   "</parameter>", "<invoke name="],
    "deepseek_v32": ["<｜DSML｜function_calls>", "</｜DSML｜function_calls>",
                     '<｜DSML｜invoke name="search">', "</｜DSML｜invoke>", "<｜DSML｜invoke name=",
                     '<｜DSML｜parameter name="query" string="true">', "</｜DSML｜parameter>",
                     '<｜DSML｜parameter name="limit" string="false">', ' string="'],
    "harmony": ["<|channel|>", "analysis", "final", "commentary", " to=functions.search",
                "<|constrain|>json", "<|message|>", "<|end|>", "<|call|>", "<|start|>assistant"],
}
JSON = ['{', '}', '"name"', '"arguments"', ': ', '"search"', '"query"', '"q"', ", ", "1", ".5",
        "true", "[", "]", '"', "\\", "\n", " ", "x", "<", "|", "<think>", "</think>"]


ARGS = st.dictionaries(st.sampled_from(["query", "limit", "q\\\"x"]),
                       st.none() | st.integers() | st.text(max_size=8)
                       | st.lists(st.booleans(), max_size=2), max_size=3)


@st.composite
def calls(draw, name: str) -> str:
    """A well-formed call of the format, maybe damaged (a slice cut out, or cut short)."""
    cls = get_tool_parser(name)
    fmt = cls.call_format("search", {})
    if fmt is None:
        text = draw(st.sampled_from([s[1] for s in SAMPLES if s[0] == name]))
    else:
        text = fmt.begin + json.dumps(draw(ARGS), indent=draw(st.sampled_from([None, 1]))) + \
            fmt.end
    damage = draw(st.sampled_from(["none", "cut", "short"]))
    if damage != "none":
        a = draw(st.integers(0, len(text)))
        b = len(text) if damage == "short" else draw(st.integers(a, len(text)))
        text = text[:a] + text[b:]
    return text


def texts(name: str):
    piece = st.sampled_from(MARKERS[name] + JSON) | calls(name)
    return st.lists(piece, max_size=12).map("".join)


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_text_keeps_the_invariants(name, data):
    text = data.draw(texts(name))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    whole = fold(run(get_tool_parser(name)(TOOLS), [text]))
    assert shape(fold(run(get_tool_parser(name)(TOOLS), chunks(text, cuts)))) == shape(whole)
    assert shape(fold(run(get_tool_parser(name)(TOOLS), list(text)))) == shape(whole)


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder", "deepseek_v3", "kimi_k2", "glm45",
                                  "minimax_m2", "deepseek_v32"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_text_through_reasoning_and_tools(name, data):
    text = data.draw(texts(name))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    starts = data.draw(st.booleans())  # the prompt opened the reasoning block, or not

    def parse(pieces):
        parser = ChatOutputParser(get_tool_parser(name)(TOOLS),
                                  get_reasoning_parser("qwen3")(starts_in_reasoning=starts))
        result = fold(run(parser, pieces))
        assert parser.result() == result
        return shape(result)

    assert parse(chunks(text, cuts)) == parse([text]) == parse(list(text))
