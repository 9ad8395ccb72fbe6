"""gpt-oss's harmony format, parsed from text:

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>
    ... <|channel|>final<|message|>It is sunny.<|return|>

A message's header runs up to <|message|>: its channel (analysis -> ReasoningDelta, final and
commentary -> TextDelta) and its recipient (`to=`, before or after the channel: a tool call
whose arguments are the message). The body ends at <|end|>, <|call|>, <|return|>, <|start|> or
a new <|channel|>. Output that does not begin with "<|" is plain content.

Why by hand: openai-harmony's StreamableParser reads token ids of its o200k_harmony encoding,
which openai-harmony 0.0.8 downloads at load time (the vocabulary is not in the wheel) and no
hub may be reached at run time; our parsers get text anyway.
"""

from __future__ import annotations

import re

from loomserve.api.chat.events import ReasoningDelta
from loomserve.api.tool_parsers.base import (
    ArgsStream,
    ToolParser,
    find_first,
    json_call_format,
    partial_marker_len,
)
from loomserve.sampling_params import CallFormat

MESSAGE, CHANNEL, START = "<|message|>", "<|channel|>", "<|start|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", START, CHANNEL)
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyToolParser(ToolParser):
    name = "harmony"
    needs_special_tokens = True
    handles_reasoning = True
    triggers = [CHANNEL + "commentary to="]
    call_separator = START + "assistant"

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = "begin"  # begin | header | body | call | drop
        self._channel = "final"
        self._stream: ArgsStream | None = None

    @classmethod
    def call_format(cls, name: str, parameters: dict) -> CallFormat:
        begin = CHANNEL + "commentary to=functions.NAME <|constrain|>json" + MESSAGE
        return json_call_format(begin, name, parameters, "<|call|>")

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass
        if final:  # a header never completed is markup: dropped
            self._buf, self._state = "", "drop"

    def _step(self, final: bool) -> bool:
        """One move of the state machine; False when it needs more text."""
        state = self._state
        if state == "begin":
            rest = self._buf.lstrip()
            if not final and len(rest) < 2 and "<|".startswith(rest):
                return False
            self._state = "header" if rest.startswith("<|") else "body"
        elif state == "header":
            got = self._take_until((MESSAGE,))
            if got is None:
                return False
            self._raw = ""
            self._open_message(got[0])
        elif state == "body":
            return self._body(final)
        elif state == "call":
            outcome = self._pump(self._stream, final)
            if outcome is None:
                return False
            self._state = "drop"
        else:  # drop: what follows a call's JSON, through the end of its message
            got = self._take_until(BODY_ENDS)
            if got is None:
                self._buf = self._buf[len(self._buf) - partial_marker_len(self._buf, BODY_ENDS):]
                return False
            self._end_message(got[1])
        return True

    def _open_message(self, header: str) -> None:
        channels = _CHANNEL.findall(header)
        self._channel = channels[-1] if channels else "final"
        recipient = _RECIPIENT.findall(header)
        name = recipient[-1] if recipient else ""
        name = name[len("functions."):] if name.startswith("functions.") else name
        if name:  # "to=functions." with no name is no call: its body stays text
            self._stream, self._state = ArgsStream(name), "call"
        else:
            self._state = "body"

    def _body(self, final: bool) -> bool:
        buf = self._buf
        pos, marker = find_first(buf, BODY_ENDS)
        end = pos if pos != -1 else len(buf) - (0 if final else partial_marker_len(buf, BODY_ENDS))
        self._emit(buf[:end])
        if pos == -1:
            self._buf = buf[end:]
            return False
        self._buf = buf[pos + len(marker):]
        self._end_message(marker)
        return True

    def _emit(self, text: str) -> None:
        if self._channel != "analysis":
            self._text(text)
        elif text:
            ev = self._events
            if ev and isinstance(ev[-1], ReasoningDelta):
                ev[-1] = ReasoningDelta(ev[-1].text + text)
            else:
                ev.append(ReasoningDelta(text))

    def _end_message(self, marker: str) -> None:
        if marker == CHANNEL:  # a new message without an end: its header starts here
            self._buf = marker + self._buf
        self._state, self._raw = "header", ""

