"""--stream-interval: a request's tokens reach the front end N at a time, its first token and its
end at once; the tokens and text are those of an every-token stream; aborts still free blocks."""

import asyncio

import pytest

from loomserve import SamplingParams
from loomserve.config import EngineConfig
from loomserve.engine.async_llm import AsyncLLM
from tests.engine.test_async_llm import wait_idle
from tests.execution.conftest import TINY_LLAMA

INTERVAL = 8
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def make(interval: int) -> AsyncLLM:
    return AsyncLLM(EngineConfig.from_kwargs(model=TINY_LLAMA, kv_cache_memory="8MiB",
                                             stream_interval=interval))


@pytest.fixture(scope="module")
def engines():
    # Steps paced at 5 ms: a stats snapshot (which releases what is held) goes out at most every
    # 50 ms, so chunks of INTERVAL tokens form between them.
    mp = pytest.MonkeyPatch()
    mp.setenv("LOOMSERVE_STEP_DELAY_MS", "5")
    every, chunked = make(1), make(INTERVAL)
    mp.undo()
    yield every, chunked
    every.shutdown()
    chunked.shutdown()


async def chunks(engine, prompt):
    out = []
    async for o in engine.generate(prompt, PARAMS):
        out.append(o)
    return out


def test_tokens_arrive_in_chunks_first_at_once_same_text(engines):
    every, chunked = engines

    async def main():
        return await asyncio.gather(chunks(every, "the same prompt"),
                                    chunks(chunked, "the same prompt"),
                                    chunks(chunked, "another prompt, longer than the first"))

    plain, held, other = asyncio.run(main())
    assert held[-1].token_ids == plain[-1].token_ids and held[-1].text == plain[-1].text
    for outs in (held, other):
        sizes = [len(o.new_token_ids) for o in outs]
        assert sum(sizes) == PARAMS.max_tokens and outs[-1].finished
        assert sizes[0] == 1  # the first token is never held (time to first token)
        # the core releases at most INTERVAL tokens at a time; a consumer that lags behind (a
        # loaded host) drains its queue and gets two releases merged in one report
        assert max(sizes) <= 2 * INTERVAL
        assert len(outs) <= PARAMS.max_tokens // 2  # held: far fewer reports than tokens
        assert "".join(o.new_text for o in outs) == outs[-1].text
    assert len(plain) > len(held)


def test_closing_a_chunked_stream_aborts_and_frees_blocks(engines):
    _, chunked = engines
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        got = 0
        async for o in chunked.generate("a long one", params):
            got += len(o.new_token_ids)
            if got > INTERVAL:
                break  # closes the generator: the core aborts, dropping what it held
        return await wait_idle(chunked)

    stats = asyncio.run(main())
    assert stats.num_running == 0 and stats.kv_blocks_used == 0
    # still serving afterwards
    again = asyncio.run(chunks(chunked, "after the abort"))
    assert again[-1].finished and len(again[-1].token_ids) == PARAMS.max_tokens


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig.from_kwargs(model=TINY_LLAMA, stream_interval=0)
