"""Sliding-window models through the whole engine (scheduler, hybrid KV manager, runner): greedy
outputs equal with prefix caching on and off and equal to transformers, across multi-turn
prefix hits and chunked prefills that cross the window; out-of-window blocks go back to the
pool while a request runs."""

from __future__ import annotations

import pytest
import torch

from loomserve import LLM
from loomserve.config import EngineConfig
from loomserve.engine.core import EngineCore
from loomserve.engine.sched.request import Request
from loomserve.kv.spec import SlidingWindowSpec
from loomserve.sampling_params import SamplingParams
from tests.execution.models.conftest import FIXTURES

MODELS = ["tiny-mistral-swa", "tiny-gemma3", "tiny-gpt-oss"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def _llm(name: str, caching: bool) -> LLM:
    # 24-token steps and a 16-token per-request cap: prompts are prefilled in chunks that
    # start inside and outside the 32-token window.
    return LLM(str(FIXTURES / name), dtype="float32", device="cpu", block_size=4, kv_cache_memory="2MB",
               enable_prefix_caching=caching, max_num_batched_tokens=24, long_prefill_threshold=16)


def _session(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Two agents' turns over a shared system prompt; turn 2 resends turn 1 + its answer."""
    system = _tokens(44, 0)
    first = [system + _tokens(9, 1), system + _tokens(14, 2)]
    outs = [o.token_ids for o in llm.generate(first, GREEDY)]
    second = [p + o + _tokens(6, 3 + i) for i, (p, o) in enumerate(zip(first, outs))]
    res = llm.generate(second, GREEDY)
    return outs + [o.token_ids for o in res], [o.num_cached_tokens for o in res]


@pytest.mark.parametrize("name", MODELS)
def test_prefix_caching_on_off_and_hf_agree(name):
    from transformers import AutoModelForCausalLM

    on, cached = _session(_llm(name, True))
    off, not_cached = _session(_llm(name, False))
    assert on == off
    assert min(cached) >= 44 and not any(not_cached)  # turn 2 hits past the window
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=torch.float32).eval()
    prompt = _tokens(44, 0) + _tokens(9, 1)
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert on[0] == hf


def test_out_of_window_blocks_are_freed():
    core = EngineCore(EngineConfig.from_kwargs(model=str(FIXTURES / "tiny-gemma3"), dtype="float32", device="cpu",
                                   block_size=4, kv_cache_memory="2MB"))
    groups = core.runner.kv_cache_config.groups
    slidings = [g for g, grp in enumerate(groups) if isinstance(grp.spec, SlidingWindowSpec)]
    full = next(g for g in range(len(groups)) if g not in slidings)
    window = groups[slidings[0]].spec.sliding_window
    req = Request("r", _tokens(70, 4), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), 30)
    core.add_request(req)
    free_before = core.kv.num_free_blocks
    while req.num_output_tokens < 20:
        core.step()
    ids = core.kv.get_block_ids("r")
    pos = req.num_computed_tokens
    null = core.kv.pool.null_block.block_id
    first_needed = (pos - window + 1) // 4
    assert null not in ids[full]
    live = len(ids[full])
    for sliding in slidings:  # each sliding group holds one window's worth
        assert ids[sliding][:first_needed - 1] == [null] * (first_needed - 1)
        held = sum(b != null for b in ids[sliding])
        assert held <= window // 4 + 1
        live += held
    assert core.kv.num_free_blocks == free_before - live
    while core.has_work():
        core.step()
    assert core.kv.num_free_blocks == free_before
