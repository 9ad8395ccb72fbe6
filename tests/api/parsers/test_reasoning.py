"""<think> reasoning parsers (qwen3, deepseek_r1), gpt_oss, the registry and detection."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve.api.reasoning import (
    REASONING_PARSERS,
    detect_reasoning_parser,
    get_reasoning_parser,
)
from tests.api.parsers.helpers import chunks, fold, run

CASES = [
    # (parser, starts_in_reasoning, text, reasoning, content)
    ("qwen3", False, "<think>\nPlan: add.\n</think>\n\n2 + 2 = 4", "\nPlan: add.\n", "2 + 2 = 4"),
    ("qwen3", False, "  <think>x</think>y", "x", "y"),
    ("qwen3", False, "No thinking here; <think> later is text", "",
     "No thinking here; <think> later is text"),
    ("qwen3", False, "<thin", "", "<thin"),
    ("qwen3", False, "<think>unclosed </thi", "unclosed </thi", ""),
    ("qwen3", True, "Plan.\n</think>\n\nAnswer </think> kept", "Plan.\n", "Answer </think> kept"),
    ("qwen3", False, "<think></think>\n\nDirect.", "", "Direct."),
    ("deepseek_r1", None, "Okay, so 1+1.</think>\n\n2", "Okay, so 1+1.", "2"),
    ("deepseek_r1", None, "<think>\nHmm.</think>2", "\nHmm.", "2"),
    ("deepseek_r1", False, "Just an answer.", "", "Just an answer."),
    ("deepseek_r1", None, "Never closes", "Never closes", ""),
    ("gpt_oss", False, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
     "<|channel|>final<|message|>Done.<|return|>", "Think.", "Done."),
    ("gpt_oss", False, "<|channel|>analysis<|message|>Call.<|end|><|start|>assistant<|channel|>"
     'commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>', "Call.", ""),
]


def make(name, starts):
    cls = get_reasoning_parser(name)
    return cls() if starts is None else cls(starts_in_reasoning=starts)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_reasoning_split(case):
    name, starts, text, reasoning, content = case
    for pieces in ([text], list(text)):
        result = fold(run(make(name, starts), pieces))
        assert (result.reasoning, result.content) == (reasoning, content)
        assert result.tool_calls is None


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=10))
def test_reasoning_any_chunking(case, cuts):
    name, starts, text, reasoning, content = case
    result = fold(run(make(name, starts), chunks(text, cuts)))
    assert (result.reasoning, result.content) == (reasoning, content)


def test_prompt_opens_reasoning():
    qwen3, r1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
    assert qwen3.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not qwen3.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen3.prompt_opens_reasoning("<|im_start|>assistant\n")
    assert r1.prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜>")
    assert r1.prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜><think>\n")
    assert not r1.prompt_opens_reasoning("<｜User｜>hi<｜Assistant｜></think>")


def test_end_reasoning_makes_the_rest_content_and_drops_a_late_close():
    parser = get_reasoning_parser("qwen3")()
    events = parser.feed("<think>plan ")
    parser.end_reasoning()
    events += parser.feed("<tool_call>x</tool_call> more</think>\n\nafter")
    events += parser.finish()
    result = fold(events)
    assert result.reasoning == "plan "
    assert result.content == "<tool_call>x</tool_call> moreafter"


def test_detect_reasoning_parser():
    assert detect_reasoning_parser("{{ '<think>\\n' }}", "qwen3") == "qwen3"
    assert detect_reasoning_parser("<｜Assistant｜><think>", None) == "deepseek_r1"
    assert detect_reasoning_parser("<think>", "deepseek_v3") == "deepseek_r1"
    assert detect_reasoning_parser(None, "gpt_oss") == "gpt_oss"
    assert detect_reasoning_parser("<|start|>{{ m }}<|channel|>", None) == "gpt_oss"
    assert detect_reasoning_parser("{{ messages }}", "llama") is None
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "gpt_oss"}
    # <think> is an ordinary added token; harmony's markup is special tokens
    assert [REASONING_PARSERS[n].needs_special_tokens for n in ("qwen3", "deepseek_r1",
                                                                "gpt_oss")] == [False, False, True]
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")
