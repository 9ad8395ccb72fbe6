"""DEP: two data-parallel engine cores of the tiny DeepSeek-V3 (MLA + MoE) fixture with the
experts sharded across them (--enable-expert-parallel): greedy outputs equal one rank's, with
requests of different lengths so one rank idles (dummy steps) while the other still decodes,
and the prefill schedule interval in force (both ranks admit on the same global steps)."""

from __future__ import annotations

import asyncio
import os

import pytest

from loomserve import SamplingParams
from loomserve.config import EngineConfig
from loomserve.entrypoints.async_llm import AsyncLLM

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tiny-deepseek-v3")
PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 9, 30)]
MAX_TOKENS = [4, 12, 20, 6]  # unequal: ranks finish at different steps


def run(in_process: bool = False, **kw) -> list[list[int]]:
    config = EngineConfig.from_kwargs(model=os.path.abspath(FIXTURE), dtype="float32",
                                      kv_cache_memory="2MiB", block_size=4, **kw)
    engine = AsyncLLM(config, in_process=in_process)
    try:
        async def one(prompt, n):
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            last = None
            async for out in engine.generate(prompt, params):
                last = out
            return list(last.token_ids)

        async def main():
            return await asyncio.gather(*(one(p, n) for p, n in zip(PROMPTS, MAX_TOKENS)))

        return asyncio.run(main())
    finally:
        engine.shutdown()


def test_dep_dp2_greedy_matches_dp1(monkeypatch):
    if not os.path.isdir(FIXTURE):
        pytest.skip("tests/fixtures/tiny-deepseek-v3 is missing")
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    expected = run(in_process=True)  # one rank, in a thread: the reference
    got = run(data_parallel_size=2, enable_expert_parallel=True, prefill_schedule_interval=2)
    assert got == expected
    assert [len(t) for t in got] == MAX_TOKENS
