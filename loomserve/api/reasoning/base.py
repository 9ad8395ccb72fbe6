"""The reasoning parser contract: split a turn's text into reasoning and content.

Invariants, whatever the chunking of the text fed: ReasoningDelta texts concatenate to the
reasoning, TextDelta texts to the content; text that may still be (part of) a reasoning marker
is held back and released at finish() if it never became one.
"""

from __future__ import annotations

from typing import ClassVar, Union

from loomserve.api.chat.events import ReasoningDelta, TextDelta

ReasoningEvent = Union[ReasoningDelta, TextDelta]


class ReasoningParser:
    name: ClassVar[str] = ""
    # markers are special tokens: detokenize with skip_special_tokens=False (as ToolParser's)
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, starts_in_reasoning: bool = False):
        self.starts_in_reasoning = starts_in_reasoning

    def feed(self, text: str) -> list[ReasoningEvent]:
        raise NotImplementedError

    def finish(self) -> list[ReasoningEvent]:
        raise NotImplementedError

    def end_reasoning(self) -> None:
        """A tool call began inside the reasoning (ChatOutputParser saw its trigger): all text
        fed from now on is content; a reasoning end marker that still comes is dropped."""
        raise NotImplementedError

    @staticmethod
    def prompt_opens_reasoning(prompt_text: str) -> bool:
        """Whether the rendered prompt already opened the reasoning block (the output then
        starts inside it): pass the answer as starts_in_reasoning."""
        return False


def append_event(events: list[ReasoningEvent], cls: type, text: str) -> None:
    """Append text as a cls event, merging with a last event of the same kind."""
    if not text:
        return
    if events and type(events[-1]) is cls:
        events[-1] = cls(events[-1].text + text)
    else:
        events.append(cls(text))
