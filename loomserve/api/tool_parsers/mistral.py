"""Mistral formats: the list of call objects (v3 tokenizers, Mistral 7B v0.3, Nemo, Large 2)

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

and, from tokenizer v11 on (Mistral Small 3.2, Devstral, Magistral), one call per marker:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...

([CALL_ID]id between the name and [ARGS] is read and ignored: ids are ours). These formats have
no end-of-call marker: what follows a call is content.
"""

from __future__ import annotations

from loomserve.api.tool_parsers.base import (
    ArgsStream,
    CallObjectStream,
    ToolParser,
    json_call_format,
)
from loomserve.sampling_params import CallFormat

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MAX_NAME = 256


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    triggers = [TOOL_CALLS]
    call_separator = ""

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = "text"  # text | head | obj | list | name | args
        self._stream: ArgsStream | None = None

    @classmethod
    def call_format(cls, name: str, parameters: dict) -> CallFormat:
        begin = TOOL_CALLS + '[{"name": "NAME", "arguments": '
        return json_call_format(begin, name, parameters, "}]")

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass
        if final and self._state in ("head", "name"):
            self._text(self._raw + self._buf)
            self._buf, self._raw, self._state = "", "", "text"

    def _step(self, final: bool) -> bool:
        """One move of the state machine; False when it needs more text."""
        state = self._state
        if state == "text":
            if self._scan_text((TOOL_CALLS,), final) is None:
                return False
            self._raw, self._state = TOOL_CALLS, "head"
        elif state == "head":  # after [TOOL_CALLS]: a list, one object, or NAME[ARGS]
            if not self._skip_ws():
                return False
            if self._buf[0] == "[":
                self._raw += "["
                self._buf = self._buf[1:]
                self._state = "obj"
            else:
                self._state = "obj1" if self._buf[0] == "{" else "name"
            self._stream = CallObjectStream()
        elif state in ("obj", "obj1", "args"):
            outcome = self._pump(self._stream, final)
            if outcome is None:
                return False
            self._state = "list" if state == "obj" and outcome == "done" else "text"
            self._after_call = self._stream.call_started
        elif state == "list":  # between the list's objects
            if not self._skip_ws():
                return False
            c = self._buf[0]
            if c == ",":
                self._buf = self._buf[1:]
                self._stream, self._state = CallObjectStream(), "obj"
            else:
                self._buf = self._buf[1:] if c == "]" else self._buf
                self._state, self._after_call = "text", True
        elif state == "name":
            return self._name()
        return True

    def _name(self) -> bool:
        got = self._take_until((ARGS,))
        if got is None:
            # a name cannot be this long or hold a newline (the bound allows a split [ARGS])
            if len(self._buf) > _MAX_NAME + len(ARGS) - 1 or "\n" in self._buf:
                return self._not_a_call()
            return False
        name = got[0].split(CALL_ID, 1)[0].strip()
        if not name or len(got[0]) > _MAX_NAME or any(c.isspace() for c in got[0].strip()):
            self._buf = got[0] + ARGS + self._buf
            self._raw = self._raw[: -len(got[0] + ARGS)]
            return self._not_a_call()
        self._stream, self._state = ArgsStream(name), "args"
        return True

    def _not_a_call(self) -> bool:
        self._text(self._raw)
        self._raw, self._state = "", "text"
        return True
