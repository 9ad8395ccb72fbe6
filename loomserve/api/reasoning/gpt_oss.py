"""gpt-oss reasoning: the harmony format's analysis channel.

The harmony tool parser already splits reasoning from content (handles_reasoning), and
ChatOutputParser skips the reasoning parser when the tool parser handles it. Without a tool
parser (no tools in the request), this parser runs the harmony parser itself and keeps its
reasoning and content; a tool call the model writes anyway is dropped.
"""

from __future__ import annotations

from loomserve.api.chat.events import ReasoningDelta, TextDelta
from loomserve.api.reasoning.base import ReasoningEvent, ReasoningParser
from loomserve.api.tool_parsers.harmony import HarmonyToolParser


class GptOssReasoningParser(ReasoningParser):
    name = "gpt_oss"
    needs_special_tokens = True  # harmony's markers are special tokens

    def __init__(self, starts_in_reasoning: bool = False):
        super().__init__(starts_in_reasoning)  # harmony headers say it: the flag is unused
        self._harmony = HarmonyToolParser()

    def feed(self, text: str) -> list[ReasoningEvent]:
        return _keep(self._harmony.feed(text))

    def finish(self) -> list[ReasoningEvent]:
        return _keep(self._harmony.finish())

    def end_reasoning(self) -> None:
        """Harmony's channels, not triggers, end its reasoning: nothing to do."""


def _keep(events: list) -> list[ReasoningEvent]:
    return [ev for ev in events if isinstance(ev, (ReasoningDelta, TextDelta))]
