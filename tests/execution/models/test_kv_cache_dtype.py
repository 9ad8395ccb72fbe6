"""--kv-cache-dtype bfloat16, float16 and fp8 under a float32 model, through the whole engine
(scheduler, chunked prefill, decode, the C decode stack where it applies), against transformers
in fp32 on every architecture fixture: full attention, sliding windows, sinks, MLA latents and
the hybrids (whose state layers keep the model's dtype).

Rounding K/V to bf16 (8 bits of mantissa) moves the log-probabilities a little; the documented
tolerance (README, --kv-cache-dtype) is 0.1 on every generated token's logprob, and each
greedy token must be HF's argmax or within 0.1 of it (a near tie). Measured on these fixtures:
at most 0.046 (the MLA fixture), 0.0006-0.011 elsewhere; a fp32 cache gives < 1e-5. fp8_e4m3
(3 mantissa bits): at most 0.13 (tiny-llama), tolerance 0.25; fp8_e5m2 (2 bits) up to 0.19
(1.04 on the MLA fixture, whose latents feed absorbed products: not held to a tolerance),
tolerance 0.5 on two fixtures. A page read as the wrong dtype or a row
written to the wrong slot moves logprobs by whole units. The fp8 engine also equals the torch
backend on the same rounded pages (gathered and widened there, in place in the C kernel).
"""

from __future__ import annotations

import pytest
import torch

from loomserve.config import CacheConfig, EngineConfig
from loomserve.engine.llm import LLM
from loomserve.execution.attention.kv_dtype import cache_dtype
from loomserve.sampling_params import SamplingParams
from tests.execution.models.conftest import FIXTURES

TOL = {"bf16": 0.1, "fp16": 0.1, "fp8_e4m3": 0.25, "fp8_e5m2": 0.5}
NAMES = ["tiny-llama", "tiny-qwen3", "tiny-mistral-swa", "tiny-gemma3", "tiny-gpt-oss",
         "tiny-deepseek-v3", "tiny-qwen3-next", "tiny-nemotron-h"]


@pytest.mark.parametrize("name,kvd", [(n, "bf16") for n in NAMES]
                         + [("tiny-llama", "fp16"), ("tiny-gpt-oss", "fp16")]
                         + [(n, "fp8_e4m3") for n in NAMES]
                         + [("tiny-llama", "fp8_e5m2"), ("tiny-gpt-oss", "fp8_e5m2")])
def test_narrow_kv_cache_tracks_transformers(name, kvd):
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
    kv = cache_dtype(CacheConfig(kv_cache_dtype=kvd).kv_cache_dtype, torch.float32)
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
            assert abs(ours - row[tok].item()) < TOL[kvd], (i, ours, row[tok].item())
            assert (row.max() - row[tok]).item() < TOL[kvd], (i, tok, int(row.argmax()))


def _logprobs(name: str, kvd: str, backend: str, prompts, chunk: int = 16, warm=None) -> list:
    """(tokens, logprobs) per prompt; warm: prompts run first (their prefixes then cached)."""
    llm = LLM(str(FIXTURES / name), dtype="float32", kv_cache_dtype=kvd, kv_cache_memory="8MB",
              block_size=4, max_num_batched_tokens=chunk, attention_backend=backend)
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=0, ignore_eos=True)
    try:
        assert llm.core.runner.attention.name == backend
        if warm:
            llm.generate(warm, params)
        outs = llm.generate(prompts, params)
    finally:
        llm.close()
    return [(o.token_ids, [lp for lp, _ in o.logprobs]) for o in outs]


@pytest.mark.parametrize("name,kvd", [("tiny-llama", "fp8_e4m3"), ("tiny-deepseek-v3", "bf16"),
                                      ("tiny-mistral-swa", "fp16")])
def test_narrow_kv_cache_cold_chunked_and_warm_agree(name, kvd):
    """Attention reads the step's own rows as the cache holds them (kv_dtype.as_cached), so a
    prompt prefilled in one chunk, in chunks of 16, or after its first 24 tokens were cached
    by an earlier request gives the same tokens and logprobs (before, the chunk's own rows
    were unrounded: ~1e-3 apart with bf16 rows, 1e-2 with fp8)."""
    g = torch.Generator().manual_seed(2)
    p = torch.randint(3, 400, (45,), generator=g).tolist()
    cold = _logprobs(name, kvd, "cpu_paged", [p], chunk=64)
    chunked = _logprobs(name, kvd, "cpu_paged", [p])
    warm = _logprobs(name, kvd, "cpu_paged", [p], warm=[p[:24]])
    for other in (chunked, warm):
        assert other[0][0] == cold[0][0]
        assert max(abs(x - y) for x, y in zip(other[0][1], cold[0][1])) < 1e-4


@pytest.mark.parametrize("name,kvd", [("tiny-llama", "fp8_e4m3"), ("tiny-mistral-swa", "fp8_e5m2"),
                                      ("tiny-gpt-oss", "fp8_e4m3")])
def test_fp8_kv_cache_kernel_equals_the_torch_backend(name, kvd):
    """The C kernel and decode stack (8-bit rows widened in registers, e4m3's 2^8 folded into
    the scores' scale) against gather + widen + SDPA on the same rounded pages: the same greedy
    tokens, logprobs to fp32 accuracy (a misread code would move them by far more than 1e-4)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (45, 19)]
    fast, ref = (_logprobs(name, kvd, b, prompts) for b in ("cpu_paged", "torch"))
    for (ta, la), (tb, lb) in zip(fast, ref):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4


def test_kv_cache_dtype_names():
    assert CacheConfig(kv_cache_dtype="bf16").kv_cache_dtype == "bfloat16"
    assert CacheConfig(kv_cache_dtype="fp32").kv_cache_dtype == "float32"
    assert EngineConfig.from_kwargs(kv_cache_dtype="float16").cache.kv_cache_dtype == "float16"
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8_e4m3"
    assert CacheConfig(kv_cache_dtype="float8_e5m2").kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int3")


def test_narrow_kv_cache_holds_more_tokens():
    from loomserve.execution.model_runner import ModelRunner

    sizes = {}
    for kvd in ("auto", "bfloat16", "fp8_e4m3"):
        r = ModelRunner(EngineConfig.from_kwargs(model=str(FIXTURES / "tiny-llama"), dtype="float32",
                                                 device="cpu", kv_cache_memory="2MB",
                                                 kv_cache_dtype=kvd))
        sizes[kvd] = r.kv_cache_config.num_blocks
        assert not r.zero_new_blocks  # one dtype in every page: no zeroing needed
    assert sizes["bfloat16"] == 2 * sizes["auto"]
    assert sizes["fp8_e4m3"] == 4 * sizes["auto"]
