"""Feeding parsers in chunks, and the event invariants of chat/events.py."""

from __future__ import annotations

import json

from loomserve.api.chat.events import (
    ChatResult,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArgs,
    ToolCallStart,
)


def chunks(text: str, cuts) -> list[str]:
    """text split at the given positions (any order, duplicates allowed)."""
    points = sorted({min(max(c, 0), len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def run(parser, pieces: list[str]) -> list:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events


def fold(events: list) -> ChatResult:
    """ChatResult of an event stream, checking the invariants on the way."""
    content, reasoning, calls = [], [], []
    for ev in events:
        if isinstance(ev, TextDelta):
            assert ev.text, "empty TextDelta"
            content.append(ev.text)
        elif isinstance(ev, ReasoningDelta):
            assert ev.text, "empty ReasoningDelta"
            reasoning.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            assert ev.index == len(calls), "calls start in index order"
            assert ev.name and ev.id
            calls.append(ToolCall(ev.id, ev.name, ""))
        else:
            assert isinstance(ev, ToolCallArgs)
            assert ev.index == len(calls) - 1, "arguments only for the latest started call"
            assert ev.text
            calls[ev.index].arguments += ev.text
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict), call.arguments
    return ChatResult("".join(content), "".join(reasoning), calls or None)


def calls_of(result: ChatResult) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls or []]


def shape(result: ChatResult) -> tuple:
    """What must not depend on chunking: everything but the random ids."""
    calls = [(c.name, c.arguments) for c in result.tool_calls or []]
    return result.content, result.reasoning, calls
