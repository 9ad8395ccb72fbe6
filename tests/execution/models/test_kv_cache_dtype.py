"""--kv-cache-dtype bfloat16 (and float16) under a float32 model, through the whole engine
(scheduler, chunked prefill, decode, the C decode stack where it applies), against transformers
in fp32 on every architecture fixture: full attention, sliding windows, sinks, MLA latents and
the hybrids (whose state layers keep the model's dtype).

Rounding K/V to bf16 (8 bits of mantissa) moves the log-probabilities a little; the documented
tolerance (README, --kv-cache-dtype) is 0.1 on every generated token's logprob, and each
greedy token must be HF's argmax or within 0.1 of it (a near tie). Measured on these fixtures:
at most 0.047 (the MLA fixture), 0.0006-0.011 elsewhere; a fp32 cache gives < 1e-5. A page
read as the wrong dtype or a row written to the wrong slot moves logprobs by whole units.
"""

from __future__ import annotations

import pytest
import torch

from loomserve.config import CacheConfig, EngineConfig
from loomserve.entrypoints.llm import LLM
from loomserve.sampling_params import SamplingParams
from tests.execution.models.conftest import FIXTURES

TOL = 0.1
NAMES = ["tiny-llama", "tiny-qwen3", "tiny-mistral-swa", "tiny-gemma3", "tiny-gpt-oss",
         "tiny-deepseek-v3", "tiny-qwen3-next", "tiny-nemotron-h"]


@pytest.mark.parametrize("name,kvd", [(n, "bf16") for n in NAMES]
                         + [("tiny-llama", "fp16"), ("tiny-gpt-oss", "fp16")])
def test_16bit_kv_cache_tracks_transformers(name, kvd):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (37, 21)]
    llm = LLM(str(FIXTURES / name), dtype="float32", kv_cache_dtype=kvd, kv_cache_memory="8MB",
              block_size=4, max_num_batched_tokens=16)  # prompts prefill in chunks
    try:
        groups = llm.core.runner.kv_cache_config.groups
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, logprobs=0,
                                                    ignore_eos=True))
    finally:
        llm.close()
    kv = torch.bfloat16 if kvd == "bf16" else torch.float16
    for grp in groups:  # attention rows in the KV dtype; state layers in the model's fp32
        want = kv if grp.spec.kind != "linear_state" else torch.float32
        assert grp.spec.dtype == want, grp.spec
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=torch.float32).eval()
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) == 12
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([p + o.token_ids])).logits[0].float(), -1)
        for i, (tok, (ours, _)) in enumerate(zip(o.token_ids, o.logprobs)):
            row = lp[len(p) + i - 1]
            assert abs(ours - row[tok].item()) < TOL, (i, ours, row[tok].item())
            assert (row.max() - row[tok]).item() < TOL, (i, tok, int(row.argmax()))


def test_kv_cache_dtype_names():
    assert CacheConfig(kv_cache_dtype="bf16").kv_cache_dtype == "bfloat16"
    assert CacheConfig(kv_cache_dtype="fp32").kv_cache_dtype == "float32"
    assert EngineConfig.from_kwargs(kv_cache_dtype="float16").cache.kv_cache_dtype == "float16"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int3")


def test_bf16_kv_cache_holds_twice_the_tokens():
    from loomserve.execution.model_runner import ModelRunner

    sizes = {}
    for kvd in ("auto", "bfloat16"):
        r = ModelRunner(EngineConfig.from_kwargs(model=str(FIXTURES / "tiny-llama"), dtype="float32",
                                                 device="cpu", kv_cache_memory="2MB",
                                                 kv_cache_dtype=kvd))
        sizes[kvd] = r.kv_cache_config.num_blocks
        assert not r.zero_new_blocks  # one dtype in every page: no zeroing needed
    assert sizes["bfloat16"] == 2 * sizes["auto"]
