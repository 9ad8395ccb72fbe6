"""n > 1 through AsyncLLM: samples with sibling_of wait for the first sample's prompt prefill
and hit its cached prompt blocks; logprobs and structured output reach the front end."""

from __future__ import annotations

import asyncio
import json

import pytest

from loomserve import SamplingParams
from loomserve.config import EngineConfig
from loomserve.engine.async_llm import AsyncLLM
from loomserve.sampling_params import StructuredOutputs
from tests.execution.conftest import TINY_LLAMA, make_llm

BLOCK = 16
PROMPT = [1] + [(7 * i) % 400 + 3 for i in range(60)]  # 61 tokens: 3 full blocks


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM(EngineConfig.from_kwargs(model=TINY_LLAMA, kv_cache_memory="8MiB",
                                            block_size=BLOCK), in_process=True)
    yield eng
    eng.shutdown()


async def _last(engine, prompt, params, rid, **kw):
    last, lps = None, []
    async for out in engine.generate(prompt, params, rid, **kw):
        last = out
        if out.new_logprobs is not None:
            assert len(out.new_logprobs) == len(out.new_token_ids)
            lps += out.new_logprobs
    return last, lps


def _samples(engine, n, params, prompt, base):
    async def main():
        return await asyncio.gather(*(
            _last(engine, prompt, params, f"{base}-{i}", sibling_of=f"{base}-0" if i else None)
            for i in range(n)))
    return asyncio.run(main())


def test_siblings_reuse_the_first_samples_prompt_blocks(engine):
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    outs = _samples(engine, 4, params, PROMPT, "n4")
    full = len(PROMPT) // BLOCK * BLOCK
    assert outs[0][0].num_cached_tokens == 0
    for last, _ in outs[1:]:
        assert last.finished and len(last.token_ids) == 4
        assert last.num_cached_tokens >= full


@pytest.mark.parametrize("siblings", [True, False])
def test_core_holds_siblings_until_the_prompt_is_prefilled(siblings):
    # Added before one step runs, the prompt prefilled 16 tokens a step: without sibling_of
    # each sample only hits the blocks allocated before it was admitted, and recomputes the rest.
    llm = make_llm(block_size=BLOCK, long_prefill_threshold=BLOCK)  # a prompt: 4 steps
    try:
        params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
        for i in range(3):
            llm.core.add(llm.inputs.make_core_request(
                f"c-{i}", PROMPT, params, sibling_of="c-0" if siblings and i else None))
        cached = {}
        while llm.core.has_work():
            for out in llm.core.step():
                cached[out.request_id] = out.num_cached_tokens
        full = len(PROMPT) // BLOCK * BLOCK
        assert cached["c-0"] == 0
        assert all((cached[f"c-{i}"] >= full) == siblings for i in (1, 2))
    finally:
        llm.close()


def test_logprobs_and_structured_output_through_async_llm(engine):
    schema = {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"],
              "additionalProperties": False}
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, logprobs=2,
                            structured=StructuredOutputs(json_schema=json.dumps(schema)))
    outs = _samples(engine, 2, params, PROMPT, "js")
    for last, lps in outs:
        assert json.loads(last.text)["x"] in ("a", "b")
        assert len(lps) == len(last.token_ids) == len(last.logprobs)
        assert all(len(top) == 2 and lp <= 0 for lp, top in lps)


def test_invalid_regex_is_a_value_error_from_generate(engine):
    async def main():
        async for _ in engine.generate("x", SamplingParams(structured=StructuredOutputs(
                regex="(unclosed"))):
            pass
    with pytest.raises(ValueError, match="regex"):
        asyncio.run(main())


def test_sibling_cycle_does_not_hold_forever():
    llm = make_llm(block_size=BLOCK)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        for rid, first in (("a", "b"), ("b", "a")):
            llm.core.add(llm.inputs.make_core_request(rid, PROMPT, params, sibling_of=first))
        done = set()
        for _ in range(20):
            done |= {o.request_id for o in llm.core.step() if o.finished}
            if not llm.core.has_work():
                break
        assert done == {"a", "b"}
    finally:
        llm.close()
