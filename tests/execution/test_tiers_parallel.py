"""KV tiers with more than one rank per engine core (loomserve.execution.parallel.shared_pool):
under tensor parallelism (KV heads split, or replicated) and decode context parallelism (tokens
split), a prefix pushed out of the device pool comes back from the host tier with the same
outputs and the same cached_tokens as one rank for the same request sequence: a tier hit is a
hit on every rank, since each logical page holds every rank's shard. Refusals where the shared
pool cannot serve (across nodes, prefill context parallelism)."""

from __future__ import annotations

import random

import pytest

from loomserve import SamplingParams
from tests.execution.tp_util import _fixture, one_thread_per_rank  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


A = prompt(1)
OTHERS = [prompt(s) for s in range(10, 16)]  # 42+ blocks: A leaves any pool of <= 32 blocks


def run(model: str, pool: int, **parallel) -> list:
    from loomserve.engine.llm import LLM
    llm = LLM(model, dtype="float32", block_size=16, kv_cache_memory=str(pool),
              host_cache_memory="8MiB", **parallel)
    try:
        outs = [llm.generate(p, GREEDY)[0] for p in [A, *OTHERS, A]]
        if parallel:
            assert llm.core.runner.tier_pages.shape[1] == (
                2 * llm.core.runner.kv_buffer.shape[1])  # every rank's shard in one page
        return [(o.token_ids, o.num_cached_tokens, o.num_tier_cached_tokens) for o in outs]
    finally:
        llm.close()


def page_bytes(model: str) -> int:
    from loomserve.engine.llm import LLM
    llm = LLM(model, dtype="float32", block_size=16, kv_cache_memory="1MiB")
    try:
        return llm.core.runner.kv_cache_config.page_bytes
    finally:
        llm.close()


@pytest.mark.parametrize("name,parallel", [
    ("tiny-llama", {"tensor_parallel_size": 2}),
    ("tiny-qwen3", {"tensor_parallel_size": 2}),
    ("tiny-llama", {"decode_context_parallel_size": 2}),
    ("tiny-deepseek-v3", {"decode_context_parallel_size": 2}),
    ("tiny-deepseek-v3", {"tensor_parallel_size": 2}),
])
def test_tier_hits_match_one_rank(name, parallel):
    model = _fixture(name)
    pool = 16 * page_bytes(model)  # 16 blocks at one rank, 16-32 with a rank's shard pages
    one = run(model, pool)
    two = run(model, pool, **parallel)
    assert two == one
    last = two[-1]
    assert last[1] == last[2] == 96, last  # A's 6 full blocks, all from the host tier
    assert last[0] == two[0][0]


def test_refusals():
    from loomserve.config import EngineConfig
    from loomserve.execution.parallel.shared_pool import check_supported
    with pytest.raises(NotImplementedError, match="prefill-context-parallel"):
        check_supported(EngineConfig.from_kwargs(prefill_context_parallel_size=2,
                                                 host_cache_memory="1MiB"))
    with pytest.raises(NotImplementedError, match="across nodes"):
        check_supported(EngineConfig.from_kwargs(tensor_parallel_size=2, nnodes=2,
                                                 master_port=29999, host_cache_memory="1MiB"))
