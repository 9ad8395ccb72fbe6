"""Prefill context parallelism: the row split, and the engine at P = 2 (two processes on gloo)
against P = 1 on the tiny fixtures: identical greedy tokens and cached_tokens, with prompts long
enough to be chunked, so pieces of later chunks attend over cached context that other ranks
computed, in batches that mix decodes with prefill chunks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve.execution.attention.metadata import PrefillChunk
from loomserve.execution.parallel.prefill_context_parallel import PcpSplit, PcpStateLayer
from loomserve.sampling_params import SamplingParams
from tests.execution.tp_util import GREEDY, SYSTEM, _fixture, one_thread_per_rank  # noqa: F401


@settings(max_examples=60, deadline=None)
@given(decodes=st.integers(0, 4), sizes=st.lists(st.integers(2, 40), max_size=4),
       ranks=st.integers(2, 4))
def test_split_gives_every_row_to_one_rank_in_contiguous_pieces(decodes, sizes, ranks):
    chunks, row = [], decodes
    for n in sizes:
        chunks.append(PrefillChunk(row, row + n, 100, np.zeros(1, dtype=np.int32)))
        row += n
    splits = [PcpSplit.of(decodes, chunks, r, ranks) for r in range(ranks)]
    prefill = np.concatenate([s.prefill_rows[s_r] for s_r, s in enumerate(splits)])
    assert sorted(prefill.tolist()) == list(range(decodes, row))  # each prefill row once
    for r, s in enumerate(splits):
        assert s.local_rows[:decodes].tolist() == list(range(decodes))  # every decode
        assert s.local_rows[decodes:].tolist() == s.prefill_rows[r].tolist()
        for i, lo, hi in s.pieces:
            c = chunks[i]
            assert c.start <= lo < hi <= c.end
            assert s.prefill_rows[r].tolist().count(lo) == 1
    for i, c in enumerate(chunks):  # pieces of one chunk follow each other in rank order
        bounds = [(lo, hi) for s in splits for j, lo, hi in s.pieces if j == i]
        assert bounds[0][0] == c.start and bounds[-1][1] == c.end
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def _run(model: str, pcp: int):
    from loomserve.engine.llm import LLM
    # 48-token steps: the 150-token prompt prefills in chunks beside the others' decodes;
    # 16-token blocks for the hit thresholds (hybrid page sizing would give tiny-nemotron-h
    # 64-token blocks, longer than SYSTEM: tests/kv/test_page_sizing.py)
    llm = LLM(model, prefill_context_parallel_size=pcp, kv_cache_memory="2MiB",
              dtype="float32", max_num_batched_tokens=48, max_hybrid_block_size=0)
    try:
        long = [3 + (i * 7) % 300 for i in range(150)]
        first = llm.generate([SYSTEM + [50, 51], SYSTEM + [60] * 9, long], GREEDY)
        second = llm.generate([SYSTEM + [70, 71, 72], long + [9, 8, 7]],
                              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        outs = first + second
        return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs], llm.core.runner
    finally:
        llm.close()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-mistral-swa", "tiny-gpt-oss",
                                  "tiny-deepseek-v3", "tiny-qwen3-next", "tiny-nemotron-h"])
def test_greedy_and_cached_tokens_match_one_rank(name):
    """Llama; Qwen3; Mistral's 32-token sliding window; gpt-oss (sinks, MoE, windowed and
    full); DeepSeek-V3 (MLA latent rows exchanged, MoE); the linear-state hybrids (their state
    layers see every row on every rank)."""
    model = _fixture(name)
    tokens1, cached1, _ = _run(model, 1)
    tokens2, cached2, runner = _run(model, 2)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[3] >= 32 and cached1[4] >= 144  # the hits happened
    assert runner.attention.name == "pcp" and runner.attention.exchanged_bytes > 0
    wrapped = sum(isinstance(m, PcpStateLayer) for m in runner.model.modules())
    assert wrapped == (0 if not runner.state_groups else
                       sum(len(runner.kv_cache_config.groups[g].layer_ids) for g in runner.state_groups))


def test_refusals():
    from loomserve.config import ParallelConfig
    for other in ({"tensor_parallel_size": 2}, {"decode_context_parallel_size": 2}):
        with pytest.raises(ValueError, match="prefill-context-parallel-size > 1 is supported"):
            ParallelConfig(prefill_context_parallel_size=2, **other)
    assert ParallelConfig(prefill_context_parallel_size=2, data_parallel_size=2).world_size == 2
    with pytest.raises(ValueError, match="expert-parallel"):
        ParallelConfig(prefill_context_parallel_size=2, data_parallel_size=2,
                       enable_expert_parallel=True)
    assert ParallelConfig(prefill_context_parallel_size=2).world_size == 2
