"""Per-format edges: cut-off and malformed calls, schema typing, detection from templates."""

from __future__ import annotations

import json

import pytest

from loomserve.api.tool_parsers import detect_tool_parser, get_tool_parser
from loomserve.api.tool_parsers.xml_args import convert_value
from tests.api.parsers.helpers import calls_of, fold, run
from tests.api.parsers.samples import TOOLS

# (parser, text, content, calls): cut off by the end of output, or malformed
EDGES = [
    # a started call cut off keeps its valid part, closed
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0"
     '<|tool_call_argument_begin|>{"query": "cut', "", [("search", {"query": "cut"})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n``",
     "", [("search", {})]),
    ("mistral", '[TOOL_CALLS]search[ARGS]{"query": ["a", "b', "", [("search", {"query": ["a",
                                                                                     "b"]})]),
    ("harmony", "<|channel|>commentary to=functions.search <|constrain|>json<|message|>"
     '{"query": "x", "limit', "", [("search", {"query": "x"})]),
    ("qwen3_coder", "<tool_call>\n<function=search>\n<parameter=limit>\n5\n</parameter>\n"
     "<parameter=query>\npartial", "", [("search", {"limit": 5})]),
    ("glm45", "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>a</arg_value>\n"
     "<arg_key>limit</arg_key>\n<arg_value>7", "", [("search", {"query": "a"})]),
    # invalid JSON after the start: closed at the last valid point, the rest of the block dropped
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0"
     '<|tool_call_argument_begin|>{"query": "q" oops}<|tool_call_end|><|tool_calls_section_end|>'
     "After.", "After.", [("search", {"query": "q"})]),
    # no call after all: content, markers included
    ("kimi_k2", "<|tool_calls_section_begin|>text<|tool_calls_section_end|>",
     "<|tool_calls_section_begin|>text<|tool_calls_section_end|>", []),
    ("qwen3_coder", "<tool_call>\nnot a function</tool_call>", "<tool_call>\nnot a function"
     "</tool_call>", []),
    ("glm45", "<tool_call>", "<tool_call>", []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.'
     'call(query="x")', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("hermes", "<tool_call>\n", "<tool_call>\n", []),
    ("deepseek_v32", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter '
     'name="limit" string="false">5</｜DSML｜parameter>\n<｜DSML｜parameter name="query" '
     'string="true">partial', "", [("search", {"limit": 5})]),
    ("deepseek_v32", "<｜DSML｜function_calls>no call</｜DSML｜function_calls>",
     "<｜DSML｜function_calls>no call</｜DSML｜function_calls>", []),
]


@pytest.mark.parametrize("edge", EDGES, ids=[f"{e[0]}-{i}" for i, e in enumerate(EDGES)])
def test_edges(edge):
    name, text, content, calls = edge
    for pieces in ([text], list(text)):
        result = fold(run(get_tool_parser(name)(TOOLS), pieces))
        assert (result.content, calls_of(result)) == (content, calls)


@pytest.mark.parametrize("raw,schema,value", [
    ("Paris", {"type": "string"}, "Paris"),
    ("007", {"type": "string"}, "007"),
    ("3", {"type": "integer"}, 3),
    ("3.5", {"type": "integer"}, "3.5"),
    ("3.5", {"type": "number"}, 3.5),
    ("True", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False),
    ("[1, 'a']", {"type": "array"}, [1, "a"]),
    ('{"k": null}', {"type": "object"}, {"k": None}),
    ("null", {"type": ["integer", "null"]}, None),
    ("12", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 12),
    ("12", None, "12"),
    ("not json", {"type": "object"}, "not json"),
])
def test_schema_typed_values(raw, schema, value):
    assert convert_value(raw, schema) == value


@pytest.mark.parametrize("raw,schema,is_string,value", [
    (" 12 ", None, True, " 12 "),
    ("[1, 2]", None, False, [1, 2]),
    ("not json", None, False, "not json"),
    ("NaN", None, False, "NaN"),  # not JSON
    ("12", {"type": ["integer", "string"]}, True, "12"),
    ("12", {"type": ["integer", "string"]}, False, 12),
    ("12", {"type": "string"}, False, "12"),
    ("12", {"type": "integer"}, True, 12),
])
def test_a_string_flag_decides_where_the_schema_does_not(raw, schema, is_string, value):
    """DeepSeek-V3.2's string="true|false": for an untyped parameter and between the types of a
    union; a schema of one type still wins."""
    assert convert_value(raw, schema, is_string) == value


def test_qwen3_coder_arguments_are_json_of_the_schema_types():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n"
            "<parameter=city>\n\"Paris\"\n</parameter>\n</function>\n</tool_call>")
    call = fold(run(get_tool_parser("qwen3_coder")(TOOLS), [text])).tool_calls[0]
    assert json.loads(call.arguments) == {"days": 4, "city": '"Paris"'}


@pytest.mark.parametrize("template,model_type,name", [
    ("{% for t in tools %}<tool_call>\n<function={{ t.name }}>", "qwen3_moe", "qwen3_coder"),
    ('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
     "qwen2", "hermes"),
    ("{{- '<|python_tag|>' }}{% if builtin_tools %}ipython{% endif %}", "llama", "llama3_json"),
    ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", "mistral", "mistral"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}", "deepseek_v3", "deepseek_v3"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}", "deepseek_v32", "deepseek_v3"),
    ("{%- set dsml = '｜DSML｜' -%}{{ '<' ~ dsml ~ 'function_calls>' }}", "deepseek_v32",
     "deepseek_v32"),
    (None, "deepseek_v32", "deepseek_v32"),
    ("<|tool_calls_section_begin|>", "kimi_k2", "kimi_k2"),
    ("<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>", "glm4_moe", "glm45"),
    ("<|start|>assistant<|channel|>", "gpt_oss", "harmony"),
    (None, "gpt_oss", "harmony"),
    (None, "glm4_moe", "glm45"),
    ("{{ messages }}", "llama", "hermes"),
    (None, None, "hermes"),
])
def test_detect_tool_parser(template, model_type, name):
    assert detect_tool_parser(template, model_type) == name
