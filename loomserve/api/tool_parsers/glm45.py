"""GLM-4.5 / GLM-4.6 format (arguments typed by the tool's schema, see xml_args.py):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

The name ends at the first newline or tag. Arguments stream one complete pair at a time; a call
cut off by the end of output keeps its complete pairs.
"""

from __future__ import annotations

from loomserve.api.tool_parsers.base import ToolParser, tool_schemas
from loomserve.api.tool_parsers.xml_args import XmlArgs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"


class Glm45ToolParser(ToolParser):
    name = "glm45"
    needs_special_tokens = True  # the tags are special tokens of GLM-4.5's tokenizer
    triggers = [OPEN]
    call_separator = "\n"

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._schemas = tool_schemas(self.tools)
        self._state = "text"  # text | name | body | key | value_open | value
        self._args: XmlArgs | None = None
        self._key = ""

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass
        if final:
            if self._state == "name":
                self._text(self._raw + self._buf)
            elif self._state != "text":
                self._end_call()
            self._buf, self._state = "", "text"

    def _step(self, final: bool) -> bool:
        """One move of the state machine; False when it needs more text."""
        state = self._state
        if state == "text":
            if self._scan_text((OPEN,), final) is None:
                return False
            self._raw, self._state = OPEN, "name"
        elif state == "name":
            got = self._take_until(("\n", KEY, CLOSE))
            if got is None:
                return False
            name, end = got
            if not name.strip():
                if end == "\n":
                    return True  # a newline before the name
                self._text(self._raw)
                self._raw, self._state = "", "text"
                return True
            self._start(name.strip())
            self._args = XmlArgs(self._schemas.get(name.strip()))
            self._args_upto(self._args.text())
            self._state = "body"
            if end != "\n":
                self._buf = end + self._buf
        elif state == "body":
            got = self._take_until((KEY, CLOSE))
            if got is None:
                return False
            if got[1] == CLOSE:
                self._end_call()
                self._state = "text"
            else:
                self._state = "key"
        elif state == "key":
            got = self._take_until((KEY_END,))
            if got is None:
                return False
            self._key, self._state = got[0].strip(), "value_open"
        elif state == "value_open":
            got = self._take_until((VALUE, KEY, CLOSE))
            if got is None:
                return False
            if got[1] != VALUE:  # a key without a value: skipped
                self._buf = got[1] + self._buf
                self._state = "body"
            else:
                self._state = "value"
        else:  # value
            got = self._take_until((VALUE_END,))
            if got is None:
                return False
            self._args.add(self._key, got[0])
            self._args_upto(self._args.text())
            self._state = "body"
        return True

    def _end_call(self) -> None:
        self._args.close()
        self._args_upto(self._args.text())
        self._raw, self._after_call = "", True
