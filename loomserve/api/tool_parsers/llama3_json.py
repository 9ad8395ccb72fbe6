"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (custom tools):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after <|python_tag|>, several separated by ";". A call object is recognised at the
start of the output, after <|python_tag|>, after a call's ";", and wherever '{"name"' begins
(what the grammar's trigger forces). An object with no "parameters" / "arguments" member, or
no name, is content; so is a JSON object that is not a call.
"""

from __future__ import annotations

from loomserve.api.tool_parsers.base import CallObjectStream, ToolParser, json_call_format
from loomserve.sampling_params import CallFormat

PYTHON_TAG, NAME_OPEN = "<|python_tag|>", '{"name"'


class _Llama3Call(CallObjectStream):
    """A call object whose name counts only once an arguments member has begun: a JSON object
    with a "name" member alone is data, not a call."""

    def feed(self, text: str) -> int:
        n = self.scanner.feed(text)
        if self.name is None and "name" in self.scanner.members and self._has_args():
            value = self._member_value("name")
            if isinstance(value, str) and value:
                self.name = value
            else:
                self.scanner.failed = True
        return n

    def _has_args(self) -> bool:
        s = self.scanner
        cur = s.current[0] if s.current else None
        return cur in self.ARG_KEYS or any(k in s.members for k in self.ARG_KEYS)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|>
    triggers = [NAME_OPEN]
    call_separator = "; "

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = "start"  # start | text | call | sep
        self._stream: _Llama3Call | None = None

    @classmethod
    def call_format(cls, name: str, parameters: dict) -> CallFormat:
        return json_call_format('{"name": "NAME", "parameters": ', name, parameters, "}")

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        """One move of the state machine; False when it needs more text."""
        state = self._state
        if state == "start":  # where a call object may begin: whitespace, a tag, then {
            rest = self._buf.lstrip()
            if rest.startswith(PYTHON_TAG):
                self._raw += self._buf[: len(self._buf) - len(rest) + len(PYTHON_TAG)]
                self._buf = rest[len(PYTHON_TAG):]
                return True
            if not final and (not rest or PYTHON_TAG.startswith(rest)):
                return False
            if rest.startswith("{"):
                self._raw += self._buf[: len(self._buf) - len(rest)]
                self._buf = rest
                self._stream, self._state = _Llama3Call(), "call"
            else:  # not a call: what was held is content
                self._text(self._raw)
                self._raw, self._state = "", "text"
        elif state == "text":
            marker = self._scan_text((PYTHON_TAG, NAME_OPEN), final)
            if marker is None:
                return False
            if marker == NAME_OPEN:
                self._buf = marker + self._buf
                self._stream, self._state = _Llama3Call(), "call"
            else:
                self._raw, self._state = marker, "start"
        elif state == "call":
            outcome = self._pump(self._stream, final)
            if outcome is None:
                return False
            self._state = "sep" if outcome == "done" else "text"
            self._after_call = self._stream.call_started
        elif state == "sep":  # after a call: "; " and the next call, or content
            rest = self._buf.lstrip()
            if not rest and not final:
                return False
            if rest.startswith(";"):
                self._buf, self._state = rest[1:], "start"
            else:
                self._state = "text"
        return True
