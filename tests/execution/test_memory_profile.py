"""The profile step that sizes a GPU's KV pool (memory_profile.py), run on the CPU: the probe
input every model family takes (dense, sliding window, sinks, hybrid linear-state and Mamba,
MLA), leaving no request state behind and no effect on later outputs. The peak measurement
itself needs CUDA (benchmarks/gpu_check.py runs the engine there)."""

from __future__ import annotations

import pytest
import torch

from loomserve import LLM, SamplingParams
from loomserve.config import EngineConfig
from loomserve.execution import memory_profile
from loomserve.kv.spec import LinearStateSpec
from tests.execution.models.conftest import FIXTURES

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _llm(name: str) -> LLM:
    return LLM(str(FIXTURES / name), dtype="float32", device="cpu", block_size=4,
               kv_cache_memory="2MB")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-next",
                                  "tiny-nemotron-h", "tiny-deepseek-v3"])
def test_probe_step_runs_and_leaves_nothing_behind(name):
    prompt = torch.randint(3, 400, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    fresh = _llm(name)
    want = fresh.generate([prompt], GREEDY)[0].token_ids
    fresh.close()
    llm = _llm(name)
    runner = llm.core.runner
    memory_profile.run_probe(runner, tokens=45, seqs=4)
    assert len(runner.block_tables) == 0
    assert llm.generate([prompt], GREEDY)[0].token_ids == want
    llm.close()


def test_probe_input_gives_each_group_its_own_pages():
    llm = _llm("tiny-qwen3-next")  # an attention group and a linear-state group
    groups = llm.core.runner.kv_cache_config.groups
    inp, pages = memory_profile.probe_input(groups, 4, tokens=10, seqs=3)
    assert [len(s.token_ids) for s in inp.seqs] == [4, 3, 3]
    assert all(s.sample and s.start_pos == 0 for s in inp.seqs)
    used = [b for s in inp.seqs for ids in s.block_ids for b in ids]
    assert sorted(used) == list(range(pages)) and len(set(used)) == len(used)
    state = [g for g, grp in enumerate(groups) if isinstance(grp.spec, LinearStateSpec)]
    assert state and all(s.states[g].zero_init for s in inp.seqs for g in state)
    llm.close()


def test_probe_shape_follows_the_scheduler_budget():
    cfg = EngineConfig.from_kwargs(max_num_batched_tokens=2048, max_num_seqs=64)
    assert memory_profile.probe_shape(cfg, 8192) == (2048, 64)
    assert memory_profile.probe_shape(cfg, 16) == (64 * 15, 64)  # each seq under the model's length
    small = EngineConfig.from_kwargs(max_num_batched_tokens=8, max_num_seqs=64)
    assert memory_profile.probe_shape(small, 8192) == (8, 8)


def test_cpu_runs_size_the_pool_from_the_budget_without_a_profile():
    llm = _llm("tiny-llama")
    assert llm.core.runner._profiled_fraction() is None
    llm.close()


def test_pool_budget_is_the_share_left_after_resident_memory_and_peak():
    gib = 1 << 30
    # 100 GiB device, 80 free with a 1 GiB probe pool in: 19 resident; 0.9 share, 5 GiB peak
    assert memory_profile.budget_from(0.9, 100 * gib, 80 * gib, gib, 5 * gib) == 66 * gib
    with pytest.raises(ValueError, match="leaves no room.*resident.*peak at 40.00 GiB"):
        memory_profile.budget_from(0.5, 100 * gib, 80 * gib, gib, 40 * gib)
