"""Chat Completions chunks built from real parsers over scripted engine outputs: however the
text is cut into outputs, the deltas add up to the non-streaming message, and each tool call's
first delta carries its id and whole name."""

import os
import random

import pytest

from loomserve.api.chat.frontend import ChatFrontend, ChatRequest
from loomserve.api.openai_api import ChatStream
from loomserve.api.openai_output import TokenTexts, assistant_message
from loomserve.api.samples import Batch, Samples
from loomserve.engine.output import RequestOutput
from loomserve.engine.tokenizer import Tokenizer
from tests.api.server.conftest import TINY_AGENT
from tests.api.server.test_openai_tools import BOOKING, WEATHER

TEXT = ('<think>\nThe user wants weather.\n</think>\n\nLet me check. <tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "book_table", "arguments": {"name": "Ann", "people": 2, "time": "noon"}}\n'
        '</tool_call>')


def _outputs(cuts: list[int]) -> list[RequestOutput]:
    outs, prev = [], 0
    for i, end in enumerate(cuts + [len(TEXT)]):
        last = i == len(cuts)
        outs.append(RequestOutput("r", [1, 2], [5] * (i + 1), text=TEXT[:end],
                                  new_text=TEXT[prev:end], new_token_ids=[5], finished=last,
                                  finish_reason="stop" if last else None))
        prev = end
    return outs


@pytest.mark.parametrize("seed", range(8))
def test_stream_deltas_add_up_to_the_message(seed):
    if not os.path.isdir(TINY_AGENT):
        pytest.skip("tests/fixtures/tiny-agent is missing")
    tok = Tokenizer.from_folder(TINY_AGENT)
    prepared = ChatFrontend(tok).prepare(ChatRequest([{"role": "user", "content": "x"}],
                                                     [WEATHER, BOOKING]))
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 40)))
    outs = _outputs(cuts)
    samples = Samples([None], [outs[-1]], [None])
    stream = ChatStream("id", 0, "m", [prepared.output_parser()], TokenTexts(tok), False, True,
                        samples)
    chunks = [c for i, out in enumerate(outs) for c in stream(Batch([(0, out)], out.finished),
                                                              i == 0)]
    assert chunks[0].choices[0]["delta"] == {"role": "assistant", "content": ""}
    content = reasoning = ""
    calls: dict[int, dict] = {}
    for chunk in chunks[1:-2]:
        (choice,) = chunk.choices
        delta = choice["delta"]
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        assert delta.get("reasoning_content") == delta.get("reasoning")
        for d in delta.get("tool_calls", []):
            if d["index"] not in calls:
                assert d["id"] and d["type"] == "function" and d["function"]["arguments"] == ""
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"],
                                     "arguments": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert chunks[-2].choices[0]["finish_reason"] == "tool_calls"
    assert chunks[-1].choices == []
    usage = chunks[-1].usage  # the prompt's 2 tokens and one token per scripted output
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (2, len(outs), 2 + len(outs))
    whole = prepared.output_parser()
    whole.feed(TEXT)
    whole.finish()
    msg = assistant_message(whole.result())
    assert reasoning == msg.reasoning_content and reasoning.strip() == "The user wants weather."
    assert content == msg.content == "Let me check. "
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]


def test_parallel_tool_calls_false_keeps_the_first_call():
    if not os.path.isdir(TINY_AGENT):
        pytest.skip("tests/fixtures/tiny-agent is missing")
    tok = Tokenizer.from_folder(TINY_AGENT)
    prepared = ChatFrontend(tok).prepare(ChatRequest([{"role": "user", "content": "x"}],
                                                     [WEATHER, BOOKING]))
    outs = _outputs([40, 90, 150])
    stream = ChatStream("id", 0, "m", [prepared.output_parser()], TokenTexts(tok), False, False,
                        Samples([None], [outs[-1]], [None]), parallel=False)
    chunks = [c for i, out in enumerate(outs) for c in stream(Batch([(0, out)], out.finished),
                                                              i == 0)]
    indices = {d["index"] for c in chunks for d in c.choices[0]["delta"].get("tool_calls", [])}
    assert indices == {0}
    whole = prepared.output_parser()
    whole.feed(TEXT)
    whole.finish()
    assert [c.function.name for c in assistant_message(whole.result(), False).tool_calls] == \
        ["get_weather"]


def test_sse_lines_hold_text_with_unicode_line_separators():
    """Generated text may hold U+0085, U+2028, U+2029: str.splitlines() (httpx's aiter_lines)
    breaks lines there, so the server escapes them in every SSE payload, and the JSON decodes to
    the same text; the replay's client splits lines only where SSE does."""
    import asyncio
    import json

    import httpx

    from loomserve.api.handler import sse, sse_event
    from loomserve.api.openai_protocol import Completion, CompletionChoice
    from loomserve.bench.replay.transport import sse_lines

    text = "a\x85b\u2028c\u2029d"
    chunk = Completion(id="cmpl-1", model="m", choices=[CompletionChoice(text=text)])
    for wire in (sse(chunk), sse_event("delta", chunk)):
        lines = httpx._decoders.LineDecoder().decode(wire)  # what aiter_lines yields
        data = [x[len("data: "):] for x in lines if x.startswith("data: ")]
        assert len(data) == 1 and json.loads(data[0])["choices"][0]["text"] == text

    async def lines(raw: str) -> list[str]:
        async def chunks():
            yield raw[:9]
            yield raw[9:]
        return [x async for x in sse_lines(chunks())]

    raw = f'data: {{"t": "{text}"}}\r\n\r\ndata: [DONE]\n\n'
    assert asyncio.run(lines(raw)) == [f'data: {{"t": "{text}"}}', "", "data: [DONE]", ""]
