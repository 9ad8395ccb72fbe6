"""DEP: two data-parallel engine cores with the experts sharded across them
(--enable-expert-parallel): greedy outputs equal one rank's, with requests of different lengths
so one rank idles (dummy steps) while the other still decodes, and the prefill schedule interval
in force (both ranks admit on the same global steps). Every MoE family: DeepSeek-V3 (MLA + MoE),
Qwen3-Next, Qwen3.5-MoE (in the released vision-language layout) and Nemotron-H (hybrids),
gpt-oss, Qwen3-MoE, GLM-4.5 MoE and MiniMax-M2; each rank's shutdown line shows the expert
all-to-all really ran (pairs routed, bytes sent to the other rank)."""

from __future__ import annotations

import asyncio
import os
import re

import pytest

from loomserve import SamplingParams
from loomserve.config import EngineConfig
from loomserve.engine.async_llm import AsyncLLM

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
LOCKSTEP = re.compile(r"expert all-to-all: (\d+) \(token, expert\) pairs routed, (\d+) bytes")
PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 9, 30)]
MAX_TOKENS = [4, 12, 20, 6]  # unequal: ranks finish at different steps


def run(fixture: str, in_process: bool = False, **kw) -> list[list[int]]:
    config = EngineConfig.from_kwargs(model=os.path.abspath(fixture), dtype="float32",
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


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-qwen3-next", "tiny-nemotron-h",
                                  "tiny-gpt-oss", "tiny-qwen3-5-moe", "tiny-qwen3-moe",
                                  "tiny-glm4-moe", "tiny-minimax-m2"])
def test_dep_dp2_greedy_matches_dp1(name, monkeypatch, capfd):
    fixture = os.path.join(FIXTURES, name)
    if not os.path.isdir(fixture):
        pytest.skip(f"tests/fixtures/{name} is missing")
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    expected = run(fixture, in_process=True)  # one rank, in a thread: the reference
    capfd.readouterr()
    got = run(fixture, data_parallel_size=2, enable_expert_parallel=True,
              prefill_schedule_interval=2)
    assert got == expected
    assert [len(t) for t in got] == MAX_TOKENS
    ranks = [(int(p), int(b)) for p, b in LOCKSTEP.findall(capfd.readouterr().err)]
    assert len(ranks) == 2 and all(p > 0 and b > 0 for p, b in ranks), ranks


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen3-next"])
def test_dep_with_async_scheduling_matches_dp1(name, monkeypatch, capfd):
    """--async-scheduling under DEP: forwards run on each rank's execution thread, a turn's
    dummy step queued there after the step in flight, the turn's all-reduce on a group of its
    own; greedy outputs equal one rank's and the all-to-all ran on both ranks."""
    fixture = os.path.join(FIXTURES, name)
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    expected = run(fixture, in_process=True)
    capfd.readouterr()
    got = run(fixture, data_parallel_size=2, enable_expert_parallel=True,
              prefill_schedule_interval=2, async_scheduling=True)
    assert got == expected
    err = capfd.readouterr().err
    assert err.count("async scheduling: the next step is scheduled") == 2  # on both ranks
    ranks = [(int(p), int(b)) for p, b in LOCKSTEP.findall(err)]
    assert len(ranks) == 2 and all(p > 0 and b > 0 for p, b in ranks), ranks
