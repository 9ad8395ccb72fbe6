"""ChatOutputParser: a reasoning parser and a tool-call parser chained over a turn's text.

Text goes through the reasoning parser first; its content goes to the tool parser. A tool call
written inside the reasoning block (the tool parser's trigger appears in the reasoning text)
ends the reasoning there: the reasoning parser is told (end_reasoning), and the text from the
trigger on goes to the tool parser; a </think> that follows is dropped. Reasoning text that may
be the start of a trigger is held back until it cannot be. A tool parser that handles reasoning
itself (harmony) gets the text directly.

Invariant: result() is the fold of every event returned so far (content, reasoning, calls).
"""

from __future__ import annotations

from loomserve.api.chat.events import (
    ChatEvent,
    ChatResult,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallStart,
)
from loomserve.api.reasoning.base import ReasoningParser
from loomserve.api.tool_parsers.base import ToolParser, find_first, partial_marker_len


class ChatOutputParser:
    def __init__(self, tool_parser: ToolParser | None, reasoning_parser: ReasoningParser | None):
        if tool_parser is not None and tool_parser.handles_reasoning:
            reasoning_parser = None
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self._triggers = tuple(tool_parser.triggers) if tool_parser and reasoning_parser else ()
        self._held = ""  # reasoning text that may be the start of a trigger
        self._reasoning_ended = False  # by a trigger inside the reasoning
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[list[str]] = []  # [id, name, arguments parts...]

    def feed(self, text: str) -> list[ChatEvent]:
        if self.reasoning_parser is None:
            events = self._to_tool(text)
        else:
            events = self._route(self.reasoning_parser.feed(text))
        self._fold(events)
        return events

    def finish(self) -> list[ChatEvent]:
        events: list[ChatEvent] = []
        if self.reasoning_parser is not None:
            events = self._route(self.reasoning_parser.finish())
            if self._held:
                events.append(ReasoningDelta(self._held))
                self._held = ""
        if self.tool_parser is not None:
            events += self.tool_parser.finish()
        self._fold(events)
        return events

    def result(self) -> ChatResult:
        calls = [ToolCall(c[0], c[1], "".join(c[2:])) for c in self._calls]
        return ChatResult("".join(self._content), "".join(self._reasoning), calls or None)

    def _to_tool(self, text: str) -> list[ChatEvent]:
        if self.tool_parser is None:
            return [TextDelta(text)] if text else []
        return self.tool_parser.feed(text)

    def _route(self, events: list) -> list[ChatEvent]:
        out: list[ChatEvent] = []
        for ev in events:
            if isinstance(ev, TextDelta) or self._reasoning_ended:
                if self._held:  # the reasoning ended: what was held was reasoning
                    out.append(ReasoningDelta(self._held))
                    self._held = ""
                out += self._to_tool(ev.text)
            elif not self._triggers:
                out.append(ev)
            else:
                out += self._watch(ev.text)
        return out

    def _watch(self, text: str) -> list[ChatEvent]:
        """Reasoning text, watched for a tool-call trigger."""
        held = self._held + text
        pos, _ = find_first(held, self._triggers)
        if pos != -1:
            self._held = ""
            self._reasoning_ended = True
            self.reasoning_parser.end_reasoning()
            out: list[ChatEvent] = [ReasoningDelta(held[:pos])] if pos else []
            return out + self._to_tool(held[pos:])
        keep = partial_marker_len(held, self._triggers)
        self._held = held[len(held) - keep:]
        return [ReasoningDelta(held[: len(held) - keep])] if len(held) > keep else []

    def _fold(self, events: list[ChatEvent]) -> None:
        for ev in events:
            if isinstance(ev, TextDelta):
                self._content.append(ev.text)
            elif isinstance(ev, ReasoningDelta):
                self._reasoning.append(ev.text)
            elif isinstance(ev, ToolCallStart):
                self._calls.append([ev.id, ev.name])
            elif isinstance(ev, ToolCallArgs):
                self._calls[ev.index].append(ev.text)
