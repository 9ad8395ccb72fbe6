"""Hermes format (Qwen2.5, Qwen3, Hermes 2/3, SmolLM2):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several blocks in a row; SmolLM2 writes a JSON list of such objects inside one block.
Text between and after blocks that is only whitespace is their separator (dropped).
"""

from __future__ import annotations

from loomserve.api.tool_parsers.base import (
    CallObjectStream,
    ToolParser,
    json_call_format,
)
from loomserve.sampling_params import CallFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    needs_special_tokens = False  # <tool_call> is an added, non-special token in Qwen/Hermes
    triggers = [OPEN]
    call_separator = "\n"

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = "text"  # text | open | call | list | skip
        self._in_list = False
        self._stream: CallObjectStream | None = None

    @classmethod
    def call_format(cls, name: str, parameters: dict) -> CallFormat:
        return json_call_format(OPEN + '\n{"name": "NAME", "arguments": ', name, parameters,
                                "}\n" + CLOSE)

    def _run(self, final: bool) -> None:
        while True:
            state = self._state
            if state == "text":
                if self._scan_text((OPEN,), final) is None:
                    return
                self._raw = OPEN
                self._state, self._in_list = "open", False
            elif state == "open":  # after <tool_call> (or a list's comma): a call object
                if not self._skip_ws():
                    return self._cut_off(final)
                if self._buf[0] == "[" and not self._in_list:
                    self._raw += self._buf[0]
                    self._buf = self._buf[1:]
                    self._in_list = True
                    continue
                self._stream = CallObjectStream()
                self._state = "call"
            elif state == "call":
                outcome = self._pump(self._stream, final)
                if outcome is None:
                    return
                started = self._stream.call_started
                if outcome == "done":
                    self._state = "list" if self._in_list else "skip"
                else:
                    self._state = "skip" if started else "text"
            elif state == "list":  # between the objects of a list
                if not self._skip_ws():
                    return self._cut_off(final)
                c = self._buf[0]
                self._buf = self._buf[1:]
                self._state = "open" if c == "," else "skip"
                if c != "," and c != "]":
                    self._buf = c + self._buf
            else:  # skip: drop up to the end of the block (or the next block's start)
                if not self._skip_past(CLOSE, OPEN, final):
                    return
                self._state = "text"

    def _cut_off(self, final: bool) -> None:
        """Whitespace only so far; at the end, a block with no call is content (whitespace
        after a list's comma is not: the block had calls)."""
        if final and self._state == "open" and self._raw:
            if self._raw.strip():
                self._text(self._raw)
            self._raw = ""
            self._state = "text"
