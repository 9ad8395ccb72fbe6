"""Tool-call parsers, one per model family's format, and their registry.

`detect_tool_parser` picks a format from the chat template's text (the markers it writes for
calls) and the HF config's model_type; `--tool-call-parser NAME` overrides it. Every parser
keeps the invariants of base.py and chat/events.py whatever the chunking of its input.
"""

from __future__ import annotations

from loomserve.api.tool_parsers.base import ToolParser
from loomserve.api.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from loomserve.api.tool_parsers.deepseek_v32 import DeepSeekV32ToolParser
from loomserve.api.tool_parsers.glm45 import Glm45ToolParser
from loomserve.api.tool_parsers.harmony import HarmonyToolParser
from loomserve.api.tool_parsers.hermes import HermesToolParser
from loomserve.api.tool_parsers.kimi_k2 import KimiK2ToolParser
from loomserve.api.tool_parsers.llama3_json import Llama3JsonToolParser
from loomserve.api.tool_parsers.minimax_m2 import MinimaxM2ToolParser
from loomserve.api.tool_parsers.mistral import MistralToolParser
from loomserve.api.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (
        HermesToolParser,
        Qwen3CoderToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        DeepSeekV3ToolParser,
        DeepSeekV32ToolParser,
        KimiK2ToolParser,
        Glm45ToolParser,
        MinimaxM2ToolParser,
        HarmonyToolParser,
    )
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered under name; ValueError naming the choices otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}"
        ) from None


# (marker in the chat template, parser), most specific first: Qwen3-Coder and GLM templates
# also mention <tool_call>, so they come before hermes.
_TEMPLATE_MARKERS = (
    ("<|channel|>", "harmony"),
    ("<minimax:tool_call>", "minimax_m2"),
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("｜DSML｜", "deepseek_v32"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("<arg_key>", "glm45"),
    ("<function=", "qwen3_coder"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("ipython", "llama3_json"),
    ("<tool_call>", "hermes"),
)

_MODEL_TYPES = {
    "gpt_oss": "harmony",
    "kimi_k2": "kimi_k2",
    "kimi_linear": "kimi_k2",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v32": "deepseek_v32",  # V3.2 ships no Jinja template; V3.2-Exp's says V3.1
    "glm4_moe": "glm45",
    "minimax_m2": "minimax_m2",
    "qwen3_coder": "qwen3_coder",
    "mistral": "mistral",
    "mistral3": "mistral",
    "mixtral": "mistral",
}  # no "llama": Llama 2 and many llama-architecture models have no tool format


def detect_tool_parser(chat_template: str | None, model_type: str | None) -> str:
    """The format a model writes calls in: from its chat template's markers first (they say
    what the model was trained on), then its model_type; 'hermes' when neither tells."""
    if chat_template:
        for marker, name in _TEMPLATE_MARKERS:
            if marker in chat_template and name in TOOL_PARSERS:
                return name
    if model_type and _MODEL_TYPES.get(model_type) in TOOL_PARSERS:
        return _MODEL_TYPES[model_type]
    return "hermes"


__all__ = ["TOOL_PARSERS", "ToolParser", "detect_tool_parser", "get_tool_parser"]
