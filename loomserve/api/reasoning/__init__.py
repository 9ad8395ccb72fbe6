"""Reasoning parsers and their registry.

`qwen3` and `deepseek_r1` read <think>...</think> (think.py). `gpt_oss` is the harmony format's
analysis channel: the harmony tool parser handles it (handles_reasoning), and ChatOutputParser
then skips the reasoning parser; used without a tool parser, GptOssReasoningParser runs the
harmony parser itself and keeps its reasoning and content (tool calls dropped).
"""

from __future__ import annotations

from loomserve.api.reasoning.base import ReasoningParser
from loomserve.api.reasoning.gpt_oss import GptOssReasoningParser
from loomserve.api.reasoning.think import DeepSeekR1ReasoningParser, ThinkReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls
    for cls in (ThinkReasoningParser, DeepSeekR1ReasoningParser, GptOssReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered under name; ValueError naming the choices otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of "
            f"{', '.join(sorted(REASONING_PARSERS))}"
        ) from None


def detect_reasoning_parser(chat_template: str | None, model_type: str | None) -> str | None:
    """The reasoning format of a model, or None when it does not reason in a known format."""
    template = chat_template or ""
    if model_type == "gpt_oss" or "<|channel|>" in template:
        return "gpt_oss"
    if "<think>" in template:
        deepseek = (model_type or "").startswith("deepseek") or "｜Assistant｜" in template
        return "deepseek_r1" if deepseek else "qwen3"
    return None


__all__ = [
    "REASONING_PARSERS",
    "ReasoningParser",
    "detect_reasoning_parser",
    "get_reasoning_parser",
]
