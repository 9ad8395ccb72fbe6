"""Kimi-K2 format; the call id is the format's own `functions.NAME:IDX`:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(the singular <|tool_call_section_begin|> spelling is accepted too).
"""

from __future__ import annotations

from loomserve.api.tool_parsers.base import json_call_format
from loomserve.api.tool_parsers.sectioned import SectionedToolParser
from loomserve.sampling_params import CallFormat

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN, ARG_BEGIN = "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"


class KimiK2ToolParser(SectionedToolParser):
    name = "kimi_k2"
    needs_special_tokens = True
    triggers = [SECTION_BEGIN[0]]
    call_separator = ""
    section_begin, section_end = SECTION_BEGIN, SECTION_END
    call_begin, head_end, call_end = CALL_BEGIN, ARG_BEGIN, CALL_END

    @classmethod
    def call_format(cls, name: str, parameters: dict) -> CallFormat:
        begin = SECTION_BEGIN[0] + CALL_BEGIN + "functions.NAME:0" + ARG_BEGIN
        return json_call_format(begin, name, parameters, CALL_END + SECTION_END[0])

    def parse_head(self, head: str) -> tuple[str, str | None] | None:
        call_id = head.strip()
        name = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
        if name.startswith("functions."):
            name = name[len("functions."):]
        if not name or any(c.isspace() for c in name):
            return None
        return name, call_id
