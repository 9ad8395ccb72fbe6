"""Formats whose calls sit in a marked section, each call a head (name, id) and JSON arguments:

    SECTION_BEGIN (CALL_BEGIN head HEAD_END {json} CALL_END)* SECTION_END

(DeepSeek-V3, Kimi-K2). Text between the arguments' JSON and CALL_END is dropped; a section
holding no call is content. Arguments stream as JSON text (base.ArgsStream).
"""

from __future__ import annotations

from typing import ClassVar

from loomserve.api.tool_parsers.base import ArgsStream, ToolParser


class SectionedToolParser(ToolParser):
    section_begin: ClassVar[tuple[str, ...]] = ()
    section_end: ClassVar[tuple[str, ...]] = ()
    call_begin: ClassVar[str] = ""
    head_end: ClassVar[str] = ""
    call_end: ClassVar[str] = ""

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = "text"  # text | calls | head | args | tail (+ a subclass's own)
        self._stream: ArgsStream | None = None
        self._call_id: str | None = None
        self._calls_in_section = 0
        self._openers = self.section_begin + (self.call_begin,)

    def parse_head(self, head: str) -> tuple[str, str | None] | None:
        """(name, id or None for a generated one) of a call's head; None: not a call."""
        name = head.strip()
        return (name, None) if name else None

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass
        if final:
            if self._state in ("calls", "head", "v3name") and not self._calls_in_section:
                self._text(self._raw + self._buf)
            self._buf, self._state, self._raw = "", "text", ""

    def _step(self, final: bool) -> bool:
        """One move of the state machine; False when it needs more text."""
        state = self._state
        if state == "text":
            marker = self._scan_text(self._openers, final)
            if marker is None:
                return False
            self._raw, self._calls_in_section = marker, 0
            self._state = "head" if marker == self.call_begin else "calls"
        elif state == "calls":  # inside the section, between calls
            rest = self._buf.lstrip()
            for marker in (self.call_begin,) + self.section_end:
                if rest.startswith(marker):
                    self._raw += self._buf[: len(self._buf) - len(rest)] + marker
                    self._buf = rest[len(marker):]
                    self._state = "head" if marker == self.call_begin else "text"
                    if marker != self.call_begin:
                        self._section_closed()
                    return True
            pending = (self.call_begin,) + self.section_end
            if not rest or any(m.startswith(rest) for m in pending):
                return False
            if self._calls_in_section:  # no more calls: the rest is content
                self._buf = rest
                self._section_closed()
                self._state = "text"
            else:
                self._not_a_call()
        elif state == "head":
            got = self._take_until((self.head_end,))
            if got is None:
                return False
            head = self.parse_head(got[0])
            if head is None:
                return self._not_a_call()
            self._stream = ArgsStream(head[0])
            self._call_id, self._state = head[1], "args"
        elif state == "args":
            self._buf = self._buf.lstrip() if not self._stream.scanner.started else self._buf
            outcome = self._pump(self._stream, final, self._call_id)
            if outcome is None:
                return False
            self._calls_in_section += 1
            self._state = "tail"
        elif state == "tail":  # after the JSON: through the call's end marker
            got = self._take_until((self.call_end, self.call_begin) + self.section_end)
            if got is None:
                return False
            end = got[1]
            self._state = "calls" if end == self.call_end else "head"
            if end in self.section_end:
                self._section_closed()
                self._state = "text"
        return True

    def _not_a_call(self) -> bool:
        if self._calls_in_section:
            self._state = "tail"
            return True
        self._text(self._raw)
        self._raw, self._state = "", "text"
        return True

    def _section_closed(self) -> None:
        self._raw, self._after_call = "", True
