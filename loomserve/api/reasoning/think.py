"""<think>...</think> reasoning (Qwen3, QwQ, DeepSeek-R1, GLM-4.5, Kimi thinking models).

The block opens at the start of the output (after whitespace), or in the prompt: Qwen3's and
DeepSeek-R1's templates end the prompt with "<think>\\n" when thinking (prompt_opens_reasoning),
and DeepSeek-R1 often omits the opening tag altogether, so `deepseek_r1` starts inside the
reasoning by default; an opening tag that still comes first is then dropped. Whitespace right
after </think> is the separator (dropped). An unclosed block is all reasoning.
"""

from __future__ import annotations

from loomserve.api.chat.events import ReasoningDelta, TextDelta
from loomserve.api.reasoning.base import ReasoningEvent, ReasoningParser, append_event
from loomserve.api.tool_parsers.base import partial_marker_len

OPEN, CLOSE = "<think>", "</think>"


class ThinkReasoningParser(ReasoningParser):
    name = "qwen3"

    def __init__(self, starts_in_reasoning: bool = False):
        super().__init__(starts_in_reasoning)
        # start: before any text, an opening tag may come; reasoning; content_start: after
        # </think>, whitespace dropped; content; content_drop_close: after end_reasoning()
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._may_skip_open = starts_in_reasoning
        self._buf = ""
        self._events: list[ReasoningEvent] = []

    @staticmethod
    def prompt_opens_reasoning(prompt_text: str) -> bool:
        return prompt_text.rstrip().endswith(OPEN)

    def feed(self, text: str) -> list[ReasoningEvent]:
        if self._state == "content":  # the common case after reasoning: no buffering
            return [TextDelta(text)] if text else []
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[ReasoningEvent]:
        self._run(final=True)
        buf, self._buf = self._buf, ""
        if self._state == "reasoning":
            append_event(self._events, ReasoningDelta, buf)
        elif self._state != "content_start":
            append_event(self._events, TextDelta, buf)
        return self._take()

    def end_reasoning(self) -> None:
        if self._state in ("start", "reasoning"):
            self._state = "content_drop_close"

    def _take(self) -> list[ReasoningEvent]:
        events, self._events = self._events, []
        return events

    def _run(self, final: bool) -> None:
        while self._buf:
            state = self._state
            if state in ("start", "reasoning") and (state == "start" or self._may_skip_open):
                if not self._opening(final):
                    return
            elif state == "reasoning":
                if not self._until(CLOSE, ReasoningDelta, "content_start", final):
                    return
            elif state == "content_start":
                self._buf = self._buf.lstrip()
                if self._buf:
                    self._state = "content"
            elif state == "content_drop_close":
                if not self._until(CLOSE, TextDelta, "content_start", final):
                    return
            else:
                append_event(self._events, TextDelta, self._buf)
                self._buf = ""

    def _opening(self, final: bool) -> bool:
        """Before any text: consume an opening tag; False while it may still come."""
        stripped = self._buf.lstrip()
        if stripped.startswith(OPEN):
            self._buf = stripped[len(OPEN):]
            self._state, self._may_skip_open = "reasoning", False
            return True
        if stripped and OPEN.startswith(stripped) and not final:
            return False
        if not stripped and not final:
            return False
        self._may_skip_open = False
        if self._state == "start":
            self._state = "content"
        return True

    def _until(self, marker: str, cls: type, next_state: str, final: bool) -> bool:
        """Emit text as cls up to marker and move to next_state; False while it has not come."""
        buf = self._buf
        pos = buf.find(marker)
        if pos != -1:
            append_event(self._events, cls, buf[:pos])
            self._buf = buf[pos + len(marker):]
            self._state = next_state
            return True
        keep = 0 if final else partial_marker_len(buf, (marker,))
        append_event(self._events, cls, buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return False


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1: starts inside the reasoning unless told otherwise (it often omits <think>);
    its original template ends the prompt with the assistant tag, the newer one with <think>."""

    name = "deepseek_r1"

    def __init__(self, starts_in_reasoning: bool = True):
        super().__init__(starts_in_reasoning)

    @staticmethod
    def prompt_opens_reasoning(prompt_text: str) -> bool:
        tail = prompt_text.rstrip()
        return tail.endswith(OPEN) or tail.endswith("<｜Assistant｜>")
