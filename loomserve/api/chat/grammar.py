"""The grammar a chat turn's output must follow, from tool_choice and response_format.

- tool_choice "required" / a named function: the output is only calls (of any tool / of that
  one) in the tool parser's format, `parallel_tool_calls` deciding if more than one may follow.
  Formats whose arguments are not one JSON value (XML styles: call_format is None) are forced
  into the Hermes format instead, and that request is parsed with the Hermes parser.
- tool_choice "auto" with a `strict: true` tool: free text, but a call, once its trigger is
  written, must follow the schema (non-strict tools: any JSON object). Skipped for XML formats.
- tool_choice "none": no grammar, no tool parsing (the tools are still rendered, so the prompt
  stays the same bytes as the turns around it).
- response_format json_object / json_schema: the text is one JSON value (the schema's). When
  tool_choice forces calls, the calls win (there is no text answer to shape).
"""

from __future__ import annotations

import json

from loomserve.api.chat.validate import ChatInputError, check_schema
from loomserve.sampling_params import StructuredOutputs, ToolCallGrammar

ANY_OBJECT = {"type": "object"}


def tool_grammar(tools: list[dict], mode: str, name: str | None, parallel: bool,
                 parser_cls, hermes_cls) -> tuple[StructuredOutputs | None, type | None]:
    """(grammar, parser class to parse the output with) for a tool_choice mode."""
    if mode == "none" or not tools:
        return None, None
    if mode == "auto":
        if parser_cls is None or not any(t["function"].get("strict") for t in tools):
            return None, parser_cls
        calls = [_format(parser_cls, t, strict_only=True) for t in tools]
        if any(c is None for c in calls):  # an XML format: strict is not enforced (see doc)
            return None, parser_cls
        grammar = ToolCallGrammar(calls=calls, required=False, triggers=list(parser_cls.triggers),
                                  separator=parser_cls.call_separator, parallel=parallel)
        return StructuredOutputs(tool_calls=grammar), parser_cls
    chosen = [t for t in tools if mode == "required" or t["function"]["name"] == name]
    cls = parser_cls
    if cls is None or cls.call_format("x", ANY_OBJECT) is None:
        cls = hermes_cls
    grammar = ToolCallGrammar(calls=[_format(cls, t) for t in chosen], required=True,
                              separator=cls.call_separator, parallel=parallel)
    return StructuredOutputs(tool_calls=grammar), cls


def _format(cls, tool: dict, strict_only: bool = False):
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if strict_only and not fn.get("strict"):
        params = ANY_OBJECT
    return cls.call_format(fn["name"], params)


def response_grammar(response_format) -> StructuredOutputs | None:
    """StructuredOutputs for OpenAI's response_format (None / text: no constraint)."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ChatInputError("response_format must be an object", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ChatInputError("response_format json_schema needs json_schema.schema",
                                 "response_format")
        check_schema(spec["schema"], "response_format.json_schema.schema")
        return StructuredOutputs(json_schema=json.dumps(spec["schema"]))
    raise ChatInputError(f"response_format type must be text, json_object or json_schema, got "
                         f"{kind!r}", "response_format")
