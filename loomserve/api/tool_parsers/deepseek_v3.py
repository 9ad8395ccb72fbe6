"""DeepSeek-V3 / R1 format, and V3.1's shorter head:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    V3.1: <｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>

A head of "function" means the V3 layout: the name follows up to the newline, then an optional
```json fence around the arguments.
"""

from __future__ import annotations

from loomserve.api.tool_parsers.base import ArgsStream, json_call_format
from loomserve.api.tool_parsers.sectioned import SectionedToolParser
from loomserve.sampling_params import CallFormat

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCES = ("```json", "```")


class DeepSeekV3ToolParser(SectionedToolParser):
    name = "deepseek_v3"
    needs_special_tokens = True
    triggers = [CALLS_BEGIN]
    call_separator = ""
    section_begin = (CALLS_BEGIN,)
    section_end = (CALLS_END,)
    call_begin, head_end, call_end = CALL_BEGIN, SEP, CALL_END

    @classmethod
    def call_format(cls, name: str, parameters: dict) -> CallFormat:
        begin = CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "NAME\n```json\n"
        return json_call_format(begin, name, parameters, "\n```" + CALL_END + CALLS_END)

    def _step(self, final: bool) -> bool:
        state = self._state
        if state == "head":
            got = self._take_until((SEP,))
            if got is None:
                return False
            head = got[0].strip()
            if head == "function":  # the V3 layout: the name line follows
                self._state = "v3name"
                return True
            return self._open_call(head)
        if state == "v3name":
            got = self._take_until(("\n",))
            if got is None:
                return False
            self._open_call(got[0].strip())
            if self._state == "args":
                self._state = "fence"
            return True
        if state == "fence":  # an optional ```json before the arguments
            self._buf = self._buf.lstrip()
            if not final and any(f.startswith(self._buf) and f != self._buf for f in FENCES):
                return False  # empty, or what may still grow into ```json
            fence = next((f for f in FENCES if self._buf.startswith(f)), "")
            self._buf = self._buf[len(fence):]
            self._state = "args"
            return True
        return super()._step(final)

    def _open_call(self, name: str) -> bool:
        """Read the arguments of a call named name next (or, without a name, not a call)."""
        if not name or "\n" in name:
            return self._not_a_call()
        self._stream, self._call_id, self._state = ArgsStream(name), None, "args"
        return True
