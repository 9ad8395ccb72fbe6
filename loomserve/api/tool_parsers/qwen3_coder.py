"""Qwen3-Coder format (XML-like; arguments typed by the tool's schema, see xml_args.py):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

One newline after <parameter=KEY> and before </parameter> belongs to the format. A parameter
also ends at the next <parameter= or at </function> (the model sometimes omits </parameter>).
Arguments stream one complete parameter at a time; a call cut off by the end of output keeps
its complete parameters. The opening <tool_call> is sometimes omitted: <function= also opens.
"""

from __future__ import annotations

from loomserve.api.tool_parsers.base import ToolParser, tool_schemas
from loomserve.api.tool_parsers.xml_args import XmlArgs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
VALUE_ENDS = (PARAM_END, "\n" + PARAM, "\n" + FUNC_END, PARAM, FUNC_END)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    needs_special_tokens = False
    triggers = [OPEN]
    call_separator = "\n"

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._schemas = tool_schemas(self.tools)
        self._state = "text"  # text | open | name | body | key | value | skip
        self._args: XmlArgs | None = None
        self._key = ""

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass
        if final:
            self._end_of_output()

    def _step(self, final: bool) -> bool:
        """One move of the state machine; False when it needs more text."""
        state = self._state
        if state == "text":
            marker = self._scan_text((OPEN, FUNC), final)
            if marker is None:
                return False
            self._raw = marker
            self._state = "open" if marker == OPEN else "name"
        elif state == "open":  # after <tool_call>: <function=
            self._skip_ws()
            if len(self._buf) < len(FUNC) and FUNC.startswith(self._buf):
                return False
            if not self._buf.startswith(FUNC):
                return self._not_a_call()
            self._buf = self._buf[len(FUNC):]
            self._raw += FUNC
            self._state = "name"
        elif state == "name":
            got = self._take_until((">",))
            if got is None:
                return False
            name = got[0].strip()
            if not name or "\n" in name:
                return self._not_a_call()
            self._start(name)
            self._args = XmlArgs(self._schemas.get(name))
            self._args_upto(self._args.text())
            self._state = "body"
        elif state == "body":  # between parameters
            pos = self._buf.find("<")
            if pos == -1:
                self._buf = ""
                return False
            self._buf = self._buf[pos:]
            for tag, nxt in ((PARAM, "key"), (FUNC_END, "skip"), (CLOSE, "text")):
                if self._buf.startswith(tag):
                    self._buf = self._buf[len(tag):]
                    self._state = nxt
                    if nxt != "key":
                        self._end_call()
                    return True
            if any(t.startswith(self._buf) for t in (PARAM, FUNC_END, CLOSE)):
                return False
            self._buf = self._buf[1:]  # stray text between parameters: dropped
        elif state == "key":
            got = self._take_until((">",))
            if got is None:
                return False
            self._key, self._state = got[0].strip(), "value"
        elif state == "value":
            got = self._take_until(VALUE_ENDS)
            if got is None:
                return False
            value, end = got
            if end in (PARAM, "\n" + PARAM, FUNC_END, "\n" + FUNC_END):
                self._buf = end.lstrip("\n") + self._buf  # it opens what follows
            self._args.add(self._key, _strip_newline(value))
            self._args_upto(self._args.text())
            self._state = "body"
        else:  # skip: after </function>, up to </tool_call>
            if not self._skip_past(CLOSE, OPEN, final):
                return False
            self._state = "text"
        return True

    def _not_a_call(self) -> bool:
        self._text(self._raw)
        self._raw, self._state = "", "text"
        return True

    def _end_call(self) -> None:
        self._args.close()
        self._args_upto(self._args.text())
        self._raw, self._after_call = "", True

    def _end_of_output(self) -> None:
        if self._state in ("open", "name"):
            self._text(self._raw + self._buf)
        elif self._state in ("body", "key", "value"):
            self._end_call()
        self._buf, self._state = "", "text"


def _strip_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value
