"""DeepSeek-V3.2's DSML format (｜ is U+FF5C; V3.2-Exp still wrote V3.1's, see deepseek_v3.py):

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

MiniMax-M2's invoke/parameter grammar (minimax_m2.py: several invokes per block, a missing
end tag closed by the next open one, one complete parameter streamed at a time, a block with no
call in it is content) with DSML tags and a string attribute: string="true" values are the raw
text, whitespace kept (DeepSeek's encoder writes them verbatim, and vLLM's parser keeps them);
string="false" values are JSON. The tool's schema still types the value where it says one type
(xml_args.convert_value). The "\\n\\n" DeepSeek's encoder writes before the block stays content.
"""

from __future__ import annotations

import re

from loomserve.api.tool_parsers.minimax_m2 import MinimaxM2ToolParser, _unquote
from loomserve.api.tool_parsers.xml_args import XmlArgs

DSML = "｜DSML｜"
OPEN, CLOSE = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
INVOKE, INVOKE_END = f"<{DSML}invoke name=", f"</{DSML}invoke>"
PARAM, PARAM_END = f"<{DSML}parameter name=", f"</{DSML}parameter>"

# the rest of a parameter's open tag: its quoted (or bare) name, then string="true|false"
_NAME = re.compile(r"""\s*("[^"]*"|'[^']*'|[^\s"']+)""")
_STRING = re.compile(r"""\sstring\s*=\s*["']?(true|false)\b""", re.IGNORECASE)


class DeepSeekV32ToolParser(MinimaxM2ToolParser):
    name = "deepseek_v32"
    needs_special_tokens = True  # whether a tokenizer marks ｜DSML｜ special varies: keep it
    triggers = [OPEN]
    call_separator = "\n"
    tags = (OPEN, CLOSE, INVOKE, INVOKE_END, PARAM, PARAM_END)

    def _add_param(self, args: XmlArgs, head: str, value: str) -> None:
        name = _NAME.match(head)
        flag = _STRING.search(head, name.end() if name else 0)
        is_string = None if flag is None else flag.group(1).lower() == "true"
        key = _unquote(name.group(1)) if name else ""
        args.add(key, value if is_string else value.strip(), is_string)
