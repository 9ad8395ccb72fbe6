"""MiniMax-M2 format (XML-like; arguments typed by the tool's schema, see xml_args.py):

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    <invoke name="search">
    ...
    </invoke>
    </minimax:tool_call>

One block holds one or more calls. Names may be quoted ("..." or '...') or bare. A value is
stripped of surrounding whitespace (as vLLM's minimax_m2 parser and MiniMax's reference parser
do); it also ends at the next <parameter name= or at </invoke> (a missing </parameter>), and a
call also ends at the next <invoke name= or at </minimax:tool_call>. Arguments stream one
complete parameter at a time; a call cut off by the end of output keeps its complete
parameters. A block with no call in it is content, tags included.

The tags are class attributes and `_add_param` reads one parameter: DeepSeek-V3.2's DSML
(deepseek_v32.py) is the same grammar with other tags and a string attribute.
"""

from __future__ import annotations

from loomserve.api.tool_parsers.base import ToolParser, tool_schemas
from loomserve.api.tool_parsers.xml_args import XmlArgs

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE, INVOKE_END = "<invoke name=", "</invoke>"
PARAM, PARAM_END = "<parameter name=", "</parameter>"


class MinimaxM2ToolParser(ToolParser):
    name = "minimax_m2"
    needs_special_tokens = True  # the block tags are added tokens of MiniMax-M2's tokenizer
    triggers = [OPEN]
    call_separator = "\n"
    tags = (OPEN, CLOSE, INVOKE, INVOKE_END, PARAM, PARAM_END)

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        open_, close, invoke, invoke_end, param, param_end = self.tags
        self._open, self._invoke, self._param_end = open_, invoke, param_end
        self._block_tags = (invoke, close)
        self._body_tags = (param, invoke_end, invoke, close)
        self._value_ends = (param_end, param, invoke_end, invoke, close)
        self._schemas = tool_schemas(self.tools)
        self._state = "text"  # text | block | name | body | key | value
        self._args: XmlArgs | None = None
        self._key = ""
        self._block_calls = 0  # calls started in the current block

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass
        if final:
            self._end_of_output()

    def _step(self, final: bool) -> bool:
        """One move of the state machine; False when it needs more text."""
        state = self._state
        if state == "text":
            if self._scan_text((self._open,), final) is None:
                return False
            self._raw, self._state, self._block_calls = self._open, "block", 0
        elif state == "block":  # between calls: <invoke name= or the block's end
            tag = self._tag(self._block_tags)
            if tag is None:
                return False
            if tag == "":  # stray text
                if not self._block_calls:
                    return self._not_a_call()
                self._buf = self._buf[1:]
            elif tag == self._invoke:
                self._state = "name"
            else:
                self._end_block()
        elif state == "name":
            got = self._take_until((">",))
            if got is None:
                return False
            name = _unquote(got[0])
            if not name or "\n" in name or "<" in name:
                return self._not_a_call()
            self._start(name)
            self._block_calls += 1
            self._args = XmlArgs(self._schemas.get(name))
            self._args_upto(self._args.text())
            self._state = "body"
        elif state == "body":  # between parameters
            tag = self._tag(self._body_tags)
            if tag is None:
                return False
            if tag == "":
                self._buf = self._buf[1:]  # stray text between parameters: dropped
            elif tag == self._body_tags[0]:
                self._state = "key"
            else:
                self._end_call()
                if tag == self._invoke:  # </invoke> omitted: the next call opens
                    self._state = "name"
                elif tag == self._body_tags[1]:
                    self._state = "block"
                else:
                    self._end_block()
        elif state == "key":
            got = self._take_until((">",))
            if got is None:
                return False
            self._key, self._state = got[0], "value"
        else:  # value
            got = self._take_until(self._value_ends)
            if got is None:
                return False
            value, end = got
            if end != self._param_end:
                self._buf = end + self._buf  # it opens or closes what follows
            self._add_param(self._args, self._key, value)
            self._args_upto(self._args.text())
            self._state = "body"
        return True

    def _add_param(self, args: XmlArgs, head: str, value: str) -> None:
        """One parameter: head is the text between the parameter tag and its '>'."""
        args.add(_unquote(head), value.strip())

    def _tag(self, tags: tuple[str, ...]) -> str | None:
        """After whitespace, the tag the buffer starts with (consumed), '' for other text, None
        while it may still become one."""
        self._skip_ws()
        buf = self._buf
        if not buf:
            return None
        for tag in tags:
            if buf.startswith(tag):
                self._buf = buf[len(tag):]
                self._raw += tag
                return tag
        if any(tag.startswith(buf) for tag in tags):
            return None
        return ""

    def _not_a_call(self) -> bool:
        self._text(self._raw)
        self._raw, self._state = "", "text"
        return True

    def _end_call(self) -> None:
        self._args.close()
        self._args_upto(self._args.text())
        self._raw = ""

    def _end_block(self) -> None:
        self._raw, self._state, self._after_call = "", "text", True

    def _end_of_output(self) -> None:
        if self._state == "name" or (self._state == "block" and not self._block_calls):
            self._text(self._raw + self._buf)
        elif self._state in ("body", "key", "value"):
            self._end_call()
        self._buf, self._raw, self._state = "", "", "text"


def _unquote(name: str) -> str:
    name = name.strip()
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        return name[1:-1].strip()
    return name
