"""ChatOutputParser: reasoning and tool parsers chained, any chunking; result() is the fold."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve.api.chat.output_parser import ChatOutputParser
from loomserve.api.reasoning import get_reasoning_parser
from loomserve.api.tool_parsers import get_tool_parser
from tests.api.parsers.helpers import calls_of, chunks, fold, run, shape
from tests.api.parsers.samples import SAMPLES, TOOLS

CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n</tool_call>'
Q = [("search", {"query": "q"})]
CASES = [
    # (tool parser, reasoning parser, text, reasoning, content, calls)
    ("hermes", "qwen3", "<think>\nI should search.\n</think>\n\n" + CALL, "\nI should search.\n",
     "", Q),
    ("hermes", "qwen3", "<think>Search first.\n" + CALL + "\n</think>\n\nDone.",
     "Search first.\n", "Done.", Q),
    ("hermes", "qwen3", "<think>Never closed, calls anyway: " + CALL,
     "Never closed, calls anyway: ", "", Q),
    ("hermes", "qwen3", "<think>mentions <tool_ca but no call</think>ok", "mentions <tool_ca "
     "but no call", "ok", []),
    ("hermes", None, "Hi. " + CALL, "", "Hi. ", Q),
    (None, "qwen3", "<think>a</think>b " + CALL, "a", "b " + CALL, []),
    ("deepseek_v3", "deepseek_r1", "Need search.</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin"
     "｜>function<｜tool▁sep｜>search\n```json\n{\"query\": \"q\"}\n```<｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜>", "Need search.", "", Q),
    ("harmony", "gpt_oss", "<|channel|>analysis<|message|>Search.<|end|><|start|>assistant"
     "<|channel|>commentary to=functions.search <|constrain|>json<|message|>"
     '{"query": "q"}<|call|>', "Search.", "", Q),
    (None, "gpt_oss", "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>"
     "final<|message|>Hello.<|return|>", "Hm.", "Hello.", []),
    ("qwen3_coder", "qwen3", "<think>use the tool</think>\n\n<tool_call>\n<function=search>\n"
     "<parameter=query>\nq\n</parameter>\n</function>\n</tool_call>", "use the tool", "", Q),
]


def make(tool, reasoning):
    return ChatOutputParser(get_tool_parser(tool)(TOOLS) if tool else None,
                            get_reasoning_parser(reasoning)() if reasoning else None)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_chained(case):
    tool, reasoning, text, want_reasoning, content, calls = case
    for pieces in ([text], list(text)):
        parser = make(tool, reasoning)
        result = fold(run(parser, pieces))
        assert (result.reasoning, result.content, calls_of(result)) == (
            want_reasoning, content, calls)
        assert parser.result() == result  # result() is the fold of the events
        assert (parser.result().tool_calls is None) == (not calls)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=12))
def test_chained_any_chunking(case, cuts):
    tool, reasoning, text = case[:3]
    assert shape(fold(run(make(tool, reasoning), chunks(text, cuts)))) == shape(
        fold(run(make(tool, reasoning), [text])))


@pytest.mark.parametrize("sample", SAMPLES, ids=[f"{s[0]}-{i}" for i, s in enumerate(SAMPLES)])
@settings(max_examples=15, deadline=None)
@given(cuts=st.lists(st.integers(0, 600), max_size=12))
def test_every_format_after_reasoning(sample, cuts):
    """Each recorded output, after a closed <think> block, parses as it does alone."""
    name, text, content, calls = sample
    reasoning = None if name == "harmony" else "qwen3"
    full = "<think>plan</think>\n\n" + text if reasoning else text
    result = fold(run(make(name, reasoning), chunks(full, cuts)))
    assert calls_of(result) == calls
    assert result.content == content
    assert result.reasoning == ("plan" if reasoning else result.reasoning)


def test_forced_call_after_a_prompt_that_opened_reasoning():
    """tool_choice required with a prompt ending in <think>: the grammar makes the output the
    call alone, and the open reasoning block must not swallow it."""
    fmt = get_tool_parser("hermes").call_format("search", {})
    text = fmt.begin + '{"query": "q"}' + fmt.end
    for pieces in ([text], list(text)):
        parser = ChatOutputParser(get_tool_parser("hermes")(TOOLS),
                                  get_reasoning_parser("qwen3")(starts_in_reasoning=True))
        result = fold(run(parser, pieces))
        assert (result.reasoning, result.content, calls_of(result)) == ("", "", Q)
