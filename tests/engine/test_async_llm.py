"""The asyncio front: concurrent streams, a responsive event loop, aborts that free blocks."""

import asyncio

import pytest

from loomserve import SamplingParams
from loomserve.config import EngineConfig
from loomserve.engine.async_llm import AsyncLLM
from tests.execution.conftest import TINY_LLAMA


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM(EngineConfig.from_kwargs(model=TINY_LLAMA, kv_cache_memory="8MiB"))
    yield eng
    eng.shutdown()


async def collect(engine, prompt, params, **kw):
    deltas, last = [], None
    async for out in engine.generate(prompt, params, **kw):
        deltas.append(out.new_text)
        last = out
    return "".join(deltas), last


async def wait_idle(engine, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0:
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def test_concurrent_streams_match_their_final_text(engine):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(engine, f"prompt number {i}", params) for i in range(6)))

    for streamed, last in asyncio.run(main()):
        assert last.finished and last.finish_reason == "length"
        assert streamed == last.text and len(last.token_ids) == 16


def test_event_loop_stays_responsive_while_the_model_runs(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        gen = asyncio.create_task(collect(engine, "a long generation", params))
        ticks = 0
        for _ in range(5):  # would stall behind the whole generation if the loop were blocked
            await asyncio.sleep(0.001)
            ticks += 1
        assert not gen.done()
        await gen
        return ticks

    assert asyncio.run(main()) == 5


def test_closing_the_stream_aborts_and_frees_blocks(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        stream = engine.generate("abandoned", params)
        async for _ in stream:
            break
        await stream.aclose()
        return await wait_idle(engine)

    stats = asyncio.run(main())
    assert stats.kv_blocks_used == 0


def test_stop_string_aborts_in_the_core(engine):
    async def main():
        free = (await collect(engine, "xyz", SamplingParams(temperature=0, max_tokens=20,
                                                             ignore_eos=True)))[1]
        stop = free.text[3:5]
        streamed, cut = await collect(engine, "xyz", SamplingParams(
            temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
        await wait_idle(engine)
        return free, stop, streamed, cut

    free, stop, streamed, cut = asyncio.run(main())
    assert cut.finish_reason == "stop"
    assert streamed == cut.text == free.text[:free.text.index(stop)]


def test_validation_errors_raise_before_streaming(engine):
    async def main():
        with pytest.raises(ValueError):
            async for _ in engine.generate([10 ** 9], SamplingParams()):
                pass

    asyncio.run(main())
    assert engine.stats().num_waiting == 0
