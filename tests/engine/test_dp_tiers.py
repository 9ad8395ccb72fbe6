"""KV tiers under data parallelism: each engine core has its own host tier and disk
directory, and tier hits keep their meaning. Two sessions, each on its own core (session
stickiness), each push their first prompt out of a 16-block device pool with other turns of the
same session, then resend it: the whole cached prefix comes back from the host tier, as on one
core (the same outputs, cached_tokens and tier-cached tokens as dp 1 for the same sequence),
and the resent prompt's output equals its first, computed one."""

from __future__ import annotations

import asyncio
import os

import pytest

from loomserve import SamplingParams
from loomserve.config import EngineConfig
from loomserve.engine.async_llm import AsyncLLM
from tests.kv.connector.conftest import BS, POOL_BLOCKS, A, prompt, tiny_page_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
B = prompt(2)
OTHERS = {"sa": [prompt(s) for s in (20, 21, 22)], "sb": [prompt(s) for s in (23, 24, 25)]}


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")


def sequence(engine) -> list:
    """Per session: first prompt, the others (evicting it), the first again."""
    async def session(sid, first):
        outs = []
        for p in [first, *OTHERS[sid], first]:
            last = None
            async for out in engine.generate(p, GREEDY, session_id=sid):
                last = out
            outs.append(last)
        return outs

    async def main():
        return await asyncio.gather(session("sa", A), session("sb", B))
    return asyncio.run(main())


def engine(page_bytes: int, dp: int, disk: str) -> AsyncLLM:
    from tests.execution.conftest import TINY_LLAMA
    return AsyncLLM(EngineConfig.from_kwargs(
        model=TINY_LLAMA, dtype="float32", block_size=BS, data_parallel_size=dp,
        kv_cache_memory=str(page_bytes * POOL_BLOCKS), host_cache_memory=str(page_bytes * 64),
        disk_cache_dir=disk))


def summary(outs) -> list:
    return [[(o.token_ids, o.num_cached_tokens, o.num_tier_cached_tokens) for o in s]
            for s in outs]


def test_dp2_tiers_hit_as_on_one_core(tmp_path):
    page_bytes = tiny_page_bytes()
    runs = {}
    for dp in (1, 2):
        eng = engine(page_bytes, dp, str(tmp_path / f"disk{dp}"))
        try:
            outs = sequence(eng)
            if dp == 2:
                placement = eng.client.placement
                assert sorted(placement._sessions[s] for s in ("sa", "sb")) == [0, 1]
        finally:
            eng.shutdown()
        runs[dp] = summary(outs)
    assert runs[2] == runs[1]
    for s in runs[2]:  # the resent first prompt: 6 full blocks, all from the host tier
        assert s[-1][1] == s[-1][2] == 96, s
        assert s[-1][0] == s[0][0]  # the tier-loaded KV gives the tokens the computed KV gave
    assert sorted(os.listdir(tmp_path / "disk2")) == ["dp0", "dp1"]  # a directory per core
