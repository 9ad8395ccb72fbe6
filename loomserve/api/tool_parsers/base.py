"""The tool-call parser contract and the machinery the formats share.

A ToolParser reads a turn's generated text in chunks (`feed`) and reports events
(chat/events.py); `finish` flushes what it held. Invariants, whatever the chunking:
- text that may still become a call marker is held back, never emitted as content, and released
  as content at finish() if it never became one;
- a call's ToolCallStart (index, id, complete name) comes before any of its ToolCallArgs, and
  its ToolCallArgs concatenate to a valid JSON object text by the end of the call;
- a call that fails before its name is known is content: its raw text is emitted as TextDelta;
- a call that fails after its ToolCallStart (arguments that stop being valid JSON, or cut off by
  the end of output) is closed at the last point where its arguments were valid JSON, with the
  closing quotes and brackets; the text after that point, up to the format's end-of-call marker,
  is dropped (a started call cannot be taken back, and the client gets valid JSON).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import ClassVar

from loomserve.api.chat.events import ChatEvent, TextDelta, ToolCallArgs, ToolCallStart
from loomserve.api.tool_parsers.json_stream import JsonScanner
from loomserve.sampling_params import CallFormat


def new_call_id() -> str:
    """OpenAI-style id: call_ + 24 hex characters."""
    return "call_" + secrets.token_hex(12)


_FIRST_CHARS: dict[tuple[str, ...], tuple[re.Pattern, int]] = {}


def partial_marker_len(text: str, markers: list[str] | tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of markers."""
    key = markers if isinstance(markers, tuple) else tuple(markers)
    info = _FIRST_CHARS.get(key)
    if info is None:  # a marker's start can only begin at one of its first characters
        firsts = "".join(sorted({m[0] for m in key if m}))
        info = _FIRST_CHARS[key] = (re.compile("[" + re.escape(firsts) + "]"),
                                    max((len(m) for m in key), default=1) - 1)
    first, longest = info
    n = len(text)
    m = first.search(text, max(0, n - longest))
    while m is not None:
        tail = text[m.start():]
        if any(len(mk) > len(tail) and mk.startswith(tail) for mk in key):
            return len(tail)
        m = first.search(text, m.start() + 1)
    return 0


def find_first(text: str, markers: list[str] | tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """(position, marker) of the earliest marker in text from start; (-1, '') when none."""
    best, which = -1, ""
    for m in markers:
        p = text.find(m, start)
        if p != -1 and (best == -1 or p < best or (p == best and len(m) > len(which))):
            best, which = p, m
    return best, which


class ArgsStream:
    """Streams one call's arguments from a JSON object text; `name` is set by the format."""

    def __init__(self, name: str | None = None):
        self.scanner = JsonScanner(require_object=True)
        self.name = name
        self.call_started = False  # its ToolCallStart was sent

    def feed(self, text: str) -> int:
        return self.scanner.feed(text)

    @property
    def done(self) -> bool:
        return self.scanner.done

    @property
    def failed(self) -> bool:
        return self.scanner.failed

    def visible_span(self) -> tuple[int, int]:
        """(start, end) in scanner.out of the arguments text certainly part of the final
        arguments (a span, not a copy: arguments may be long and this runs every token)."""
        return 0, self.scanner.safe_len

    def final(self) -> str:
        """The complete arguments text; closed at the safe point when cut off or invalid."""
        s = self.scanner
        if not s.started:
            return "{}"
        return s.out[: s.safe_len] + s.closing()


class CallObjectStream(ArgsStream):
    """A call written as a JSON object {"name": ..., "arguments" | "parameters": {...}}, keys in
    any order (Hermes, Llama 3, Mistral). Arguments are streamed once the name is known."""

    ARG_KEYS = ("arguments", "parameters")

    def feed(self, text: str) -> int:
        n = self.scanner.feed(text)
        if self.name is None and "name" in self.scanner.members:
            self.name = self._member_value("name")
            if not isinstance(self.name, str) or not self.name:
                self.scanner.failed = True
                self.name = None
        return n

    @property
    def failed(self) -> bool:
        return self.scanner.failed or (self.scanner.done and self.name is None)

    def _member_value(self, key: str):
        start, end = self.scanner.members[key]
        try:
            return json.loads(self.scanner.out[start:end])
        except ValueError:
            return None

    def _args_span(self) -> tuple[int, int, bool] | None:
        """(start, end, complete) of the arguments object in the scanner's text."""
        s = self.scanner
        for key in self.ARG_KEYS:
            if key in s.members:
                start, end = s.members[key]
                return (start, end, True) if s.out[start:end].startswith("{") else None
        if s.current and s.current[0] in self.ARG_KEYS:
            start = s.current[1]
            if s.out[start:start + 1] == "{":
                return start, s.safe_len, False
        return None

    def visible_span(self) -> tuple[int, int]:
        span = self._args_span()
        if span is None:
            return 0, 0
        start, end, _ = span
        return start, max(start, end)

    def final(self) -> str:
        s = self.scanner
        span = self._args_span()
        if span is not None:
            start, end, complete = span
            if complete:
                return s.out[start:end]
            # cut off inside the arguments: close them (drop the outer object's closer)
            return s.out[start:max(start, end)] + s.closing()[:-1]
        for key in self.ARG_KEYS:  # arguments given as a JSON string holding the object
            if key in s.members:
                value = self._member_value(key)
                if isinstance(value, str):
                    try:
                        obj = json.loads(value)
                    except ValueError:
                        obj = None
                    if isinstance(obj, dict):
                        return json.dumps(obj, ensure_ascii=False)
        return "{}"


class ToolParser:
    """Base of the per-format parsers: a buffer of unread text, the events of the current
    feed, and the calls started so far. Subclasses implement `_run(final)`, which consumes
    `self._buf` as far as it can and reports through `_text`, `_start`, `_pump`."""

    name: ClassVar[str] = ""
    needs_special_tokens: ClassVar[bool] = False
    handles_reasoning: ClassVar[bool] = False
    triggers: ClassVar[list[str]] = []
    call_separator: ClassVar[str] = "\n"

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []
        self._buf = ""
        self._events: list[ChatEvent] = []
        self._index = -1  # index of the latest started call
        self._sent_args = 0  # characters of the current call's arguments already sent
        self._raw = ""  # raw text of the call being read, for the content fallback
        self._after_call = False  # whitespace right after a call is its separator: dropped
        self._finished = False

    # -- the contract ----------------------------------------------------------------------

    def feed(self, text: str) -> list[ChatEvent]:
        if text:
            self._buf += text
            self._run(final=False)
        return self._take()

    def finish(self) -> list[ChatEvent]:
        if not self._finished:
            self._finished = True
            self._run(final=True)
        return self._take()

    @classmethod
    def call_format(cls, name: str, parameters: dict) -> CallFormat | None:
        return None

    # -- helpers for subclasses ------------------------------------------------------------

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    def _take(self) -> list[ChatEvent]:
        events, self._events = self._events, []
        return events

    def _text(self, text: str) -> None:
        if text:
            ev = self._events
            if ev and isinstance(ev[-1], TextDelta):
                ev[-1] = TextDelta(ev[-1].text + text)
            else:
                ev.append(TextDelta(text))

    def _start(self, name: str, call_id: str | None = None) -> None:
        self._index += 1
        self._sent_args = 0
        self._events.append(ToolCallStart(self._index, call_id or new_call_id(), name))

    def _args_upto(self, text: str) -> None:
        """Send the current call's arguments up to `text` (which extends what was sent)."""
        if len(text) > self._sent_args:
            self._events.append(ToolCallArgs(self._index, text[self._sent_args:]))
            self._sent_args = len(text)

    def _scan_text(self, markers: list[str] | tuple[str, ...], final: bool) -> str | None:
        """Emit buffered content up to the first marker and consume the marker (returned);
        without a marker, emit all but a possible marker prefix (all of it when final)."""
        if self._after_call:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return None
            self._after_call = False
        buf = self._buf
        pos, marker = find_first(buf, markers)
        if pos != -1:
            self._text(buf[:pos])
            self._buf = buf[pos + len(marker):]
            return marker
        keep = 0 if final else partial_marker_len(buf, markers)
        self._text(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return None

    def _take_until(self, markers: tuple[str, ...]) -> tuple[str, str] | None:
        """(text before the first marker, marker), both consumed; None while none came."""
        pos, marker = find_first(self._buf, markers)
        if pos == -1:
            return None
        text = self._buf[:pos]
        self._raw += text + marker
        self._buf = self._buf[pos + len(marker):]
        return text, marker

    def _skip_past(self, close: str, reopen: str, final: bool) -> bool:
        """After a call: drop text through `close` (or up to `reopen`, the next call's start),
        then back to content; False while neither came."""
        buf = self._buf
        end, start = buf.find(close), buf.find(reopen)
        if end != -1 and (start == -1 or end < start):
            self._buf = buf[end + len(close):]
        elif start != -1:
            self._buf = buf[start:]
        else:
            keep = 0 if final else partial_marker_len(buf, (close, reopen))
            self._buf = buf[len(buf) - keep:]
            return False
        self._after_call, self._raw = True, ""
        return True

    def _skip_ws(self) -> bool:
        """Consume leading whitespace of the buffer (kept in the call's raw text, for the
        content fallback); True when something else follows."""
        rest = self._buf.lstrip()
        self._raw += self._buf[: len(self._buf) - len(rest)]
        self._buf = rest
        return bool(rest)

    def _pump(self, stream: ArgsStream, final: bool, call_id: str | None = None) -> str | None:
        """Feed the buffer to a call's arguments stream; emit its start (once its name is known)
        and its arguments. Returns None while the call goes on, 'done' when complete, 'failed'
        when it failed or was cut off (then it is closed, or turned into content if it had not
        started), consuming what the stream read."""
        n = stream.feed(self._buf)
        if not stream.call_started:  # the raw text matters only until the call starts
            self._raw += self._buf[:n]
        self._buf = self._buf[n:]
        if stream.name is not None and not stream.call_started:
            stream.call_started = True
            self._start(stream.name, call_id)
        if stream.call_started and not stream.failed:
            start, end = stream.visible_span()
            if end - start > self._sent_args:
                text = stream.scanner.out[start + self._sent_args:end]
                self._events.append(ToolCallArgs(self._index, text))
                self._sent_args = end - start
        if stream.done and not stream.failed:
            self._args_upto(stream.final())
            self._raw = ""
            return "done"
        if stream.failed or final:
            if not stream.call_started:  # the text was not a call
                self._text(self._raw)
            else:
                self._args_upto(stream.final())
            self._raw = ""
            return "failed"
        return None


def tool_schemas(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema of the neutral tool list."""
    out = {}
    for tool in tools:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and fn.get("name"):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def json_call_format(begin: str, name: str, parameters: dict, end: str) -> CallFormat:
    """CallFormat whose begin/end have NAME replaced by the tool's name."""
    quoted = json.dumps(name)[1:-1]
    return CallFormat(begin.replace("NAME", quoted), json.dumps(parameters), end)
