"""What a chat turn's output parser reports, API-neutral: each API maps these to its wire format.

Invariants (every parser keeps them, whatever the chunking of the text it is fed):
- the first event of a tool call is ToolCallStart with its index (0, 1, ... in order), its id
  and its complete name; no ToolCallArgs for an index comes before its ToolCallStart;
- the ToolCallArgs texts of one index concatenate to the call's arguments, a valid JSON object
  text once the call is complete;
- TextDelta / ReasoningDelta texts concatenate to the content / reasoning of the turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    text: str


ChatEvent = Union[TextDelta, ReasoningDelta, ToolCallStart, ToolCallArgs]


@dataclass
class ToolCall:
    """A complete call: arguments is JSON object text."""

    id: str
    name: str
    arguments: str


@dataclass
class ChatResult:
    """A finished turn, folded from its events."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] | None = None
