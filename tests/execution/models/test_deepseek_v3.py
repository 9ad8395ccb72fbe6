"""DeepSeek-V3 (multi-head latent attention + group-limited MoE) against transformers, fp32, on the
tiny fixtures: the paged latent cache gives HF's logits however a step is cut (cold prefill,
chunks, prefix hits, decodes batched with a prefill), greedy generation matches HF's, the pool
keeps one latent row per token per layer, and the model serves through LLM."""

from __future__ import annotations

import pytest
import torch

from tests.execution.models.conftest import (
    FIXTURES,
    Blocks,
    logits_of,
    ref_logits,
    seq,
    tiny_runner,
)

NAMES = ["tiny-deepseek-v3", "tiny-deepseek-v3-noqlora"]
ATOL = 1e-4


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / request.param), dtype=torch.float32).eval()
    return tiny_runner(request.param), ref


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4)


def test_fixture_exercises_every_part(pair):
    runner, ref = pair
    model, cfg = runner.model, runner.model_config
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds[0] == "SwiGLU" and set(kinds[1:]) == {"DeepseekMoE"}
    assert cfg.n_group == 2 and cfg.topk_group == 1 and cfg.n_shared_experts == 1
    assert (cfg.q_lora_rank is None) == (model.model.layers[0].self_attn.q_proj is not None)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0  # a real correction bias, not HF's zeros
    if cfg.q_lora_rank:  # YaRN: both the cos/sin factor (mscale / mscale_all_dim) and the softmax scale
        assert cfg.rope_scaling["rope_type"] == "yarn"
        assert model.model.layers[0].self_attn.scale > cfg.head_dim ** -0.5
    logits = ref_logits(ref, _tokens(8, 9))
    assert logits.std() > 0.1  # the fixture's logits are not flat: the comparisons below bite


def test_pool_holds_one_latent_row_per_token(pair):
    runner, _ = pair
    cfg, kc = runner.model_config, runner.kv_cache_config
    assert len(kc.groups) == 1 and kc.groups[0].spec.kind == "full_attention"
    per_token = kc.page_bytes // kc.block_size
    assert per_token == cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    mha = cfg.num_layers * cfg.num_heads * (cfg.head_dim + cfg.v_head_dim) * 4  # K and V per head
    assert per_token <= mha / 4  # (32 + 8) / (4 heads x (24 + 16)): a quarter here, ~1/71 in DeepSeek-V3
    attn = runner.model.model.layers[0].self_attn
    assert attn.latent_cache.shape == (kc.num_blocks, kc.block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    # Layers write disjoint bytes: in the layer-major pool layer 1's region starts where
    # layer 0's latent rows of every block end.
    a0 = runner.model.model.layers[0].self_attn.latent_cache
    a1 = runner.model.model.layers[1].self_attn.latent_cache
    assert runner.pool.layer_major
    assert a1.data_ptr() - a0.data_ptr() == kc.num_blocks * kc.block_size * a0.shape[-1] * 4


def test_prefill_then_decode(pair):
    runner, ref = pair
    blocks = Blocks(runner.block_size)
    full = _tokens(29, 0)
    want = ref_logits(ref, full)
    table = []
    got = logits_of(runner, [seq("a", full[:23], 0, blocks.cover(table, 23))])
    _close(got["a"], want[22])
    for pos in range(23, 29):  # absorbed decode, crossing block boundaries
        got = logits_of(runner, [seq("a", [full[pos]], pos, blocks.cover(table, pos + 1))])
        _close(got["a"], want[pos])


def test_chunked_prefill(pair):
    runner, ref = pair
    blocks = Blocks(runner.block_size)
    full = _tokens(30, 1)
    want = ref_logits(ref, full)
    table, start = [], 0
    for size in (11, 9, 10):  # later chunks read the earlier ones' latent rows from the pages
        end = start + size
        got = logits_of(runner, [seq("a", full[start:end], start, blocks.cover(table, end))])
        _close(got["a"], want[end - 1])
        start = end


def test_prefix_hit_reuses_latent_blocks(pair):
    runner, ref = pair
    bs = runner.block_size
    blocks = Blocks(bs)
    prefix = _tokens(4 * bs, 5)
    first, second = prefix + _tokens(5, 6), prefix + _tokens(7, 7)
    t1 = []
    logits_of(runner, [seq("one", first, 0, blocks.cover(t1, len(first)))])
    hit = len(prefix)
    t2 = blocks.cover(t1[:hit // bs], len(second))
    want = ref_logits(ref, second + [9])
    got = logits_of(runner, [seq("two", second[hit:], hit, t2)])
    _close(got["two"], want[len(second) - 1])
    got = logits_of(runner, [seq("two", [9], len(second), blocks.cover(t2, len(second) + 1))])
    _close(got["two"], want[len(second)])


def test_mixed_decodes_and_prefill(pair):
    runner, ref = pair
    blocks = Blocks(runner.block_size)
    a, b, c = _tokens(20, 2), _tokens(21, 3), _tokens(12, 4)
    wa, wb, wc = ref_logits(ref, a), ref_logits(ref, b), ref_logits(ref, c)
    ta, tb, tc = [], [], []
    got = logits_of(runner, [seq("b", b[:17], 0, blocks.cover(tb, 17)), seq("c", c[:9], 0, blocks.cover(tc, 9))])
    _close(got["b"], wb[16])
    _close(got["c"], wc[8])
    for step, (lo, hi) in enumerate([(0, 12), (12, 20)]):  # A prefills while B and C decode
        pb, pc = 17 + step, 9 + step
        got = logits_of(runner, [
            seq("b", [b[pb]], pb, blocks.cover(tb, pb + 1)),
            seq("a", a[lo:hi], lo, blocks.cover(ta, hi), sample=hi == 20),
            seq("c", [c[pc]], pc, blocks.cover(tc, pc + 1)),
        ])
        _close(got["b"], wb[pb])
        _close(got["c"], wc[pc])
    _close(got["a"], wa[19])
    # Three decodes of different lengths in one padded absorbed pass.
    got = logits_of(runner, [seq("a", [a[19]], 20, blocks.cover(ta, 21)), seq("b", [b[19]], 19, blocks.cover(tb, 20)),
                             seq("c", [c[11]], 11, blocks.cover(tc, 12))])
    _close(got["a"], ref_logits(ref, a + [a[19]])[20])
    _close(got["b"], wb[19])
    _close(got["c"], wc[11])


def test_greedy_matches_hf_generate(pair):
    runner, ref = pair
    from loomserve.execution.batch import ModelInput

    blocks = Blocks(runner.block_size)
    prompt, table, out = _tokens(10, 8), [], []
    s = seq("g", prompt, 0, blocks.cover(table, 10))
    for _ in range(16):
        tok = runner.execute(ModelInput([s])).sampled["g"]
        out.append(tok)
        s = seq("g", [tok], s.start_pos + len(s.token_ids), table)
        blocks.cover(table, s.start_pos + 1)
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 10:].tolist()
    assert out == hf


def test_absorbed_decode_equals_decompressed_attention():
    """The decode path (latent-space query) against the chunk path (kv_b_proj expansion) on the
    same cached rows: one query at the end of a cached context, both ways."""
    runner = tiny_runner(NAMES[0])
    blocks = Blocks(runner.block_size)
    toks, table = _tokens(15, 10), []
    logits_of(runner, [seq("x", toks[:14], 0, blocks.cover(table, 14))])
    dec = logits_of(runner, [seq("x", [toks[14]], 14, blocks.cover(table, 15))])["x"]
    chunk = logits_of(runner, [seq("y", toks[13:15], 13, table)])["y"]  # a 2-token chunk over the same pages
    _close(dec, chunk)


def test_served_through_llm_with_prefix_cache():
    from transformers import AutoModelForCausalLM

    from loomserve import LLM

    name = NAMES[0]
    llm = LLM(str(FIXTURES / name), dtype="float32", device="cpu", block_size=4, kv_cache_memory="1MiB")
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=torch.float32).eval()
    try:
        prompt = _tokens(24, 11)
        first = llm.generate(prompt, _greedy(6))[0]
        second = llm.generate(prompt[:20] + _tokens(3, 12), _greedy(6))[0]
        with torch.no_grad():
            hf = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, 24:].tolist()
        assert first.token_ids == hf
        assert second.num_cached_tokens == 20  # five full blocks of latent rows reused
    finally:
        llm.close()


def _greedy(n: int):
    from loomserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_bf16_close_to_hf_bf16():
    from transformers import AutoModelForCausalLM

    name = NAMES[0]
    runner = tiny_runner(name, dtype="bfloat16")
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=torch.bfloat16).eval()
    blocks, table, toks = Blocks(runner.block_size), [], _tokens(22, 13)
    want = ref_logits(ref, toks)
    got = logits_of(runner, [seq("a", toks[:20], 0, blocks.cover(table, 20))])["a"]
    torch.testing.assert_close(got, want[19], atol=0.1, rtol=0.05)  # bf16 rounding, ~3 logits range
    for pos in (20, 21):
        got = logits_of(runner, [seq("a", [toks[pos]], pos, blocks.cover(table, pos + 1))])["a"]
        torch.testing.assert_close(got, want[pos], atol=0.1, rtol=0.05)


def test_spec_pads_an_odd_latent_row_and_the_runner_views_fit():
    from loomserve.execution.layers.mla import latent_view
    from loomserve.kv.spec import FullAttentionSpec, MLAAttentionSpec

    spec = MLAAttentionSpec.for_latent(4, 41, torch.float32)
    assert spec.bytes_per_block_per_layer() == 4 * 42 * 4 and spec.kind == "full_attention"
    assert spec != FullAttentionSpec(4, 1, 21, torch.float32)  # never grouped with an MHA layer
    # The runner's packed page: [layers, 2, block, 1, head_dim] per page; its K half of layer 1
    # must read back as layer 1's latent rows.
    page = torch.arange(3 * 2 * spec.bytes_per_block_per_layer() // 4, dtype=torch.float32).view(3, -1)
    kv = page[:, 168:336].view(3, 2, 4, 1, 21)
    rows = latent_view(kv[:, 0], 42)
    assert rows.shape == (3, 4, 42) and torch.equal(rows.reshape(3, -1), page[:, 168:336])


def test_config_refuses_what_the_model_cannot_run():
    import json

    from loomserve.execution.models.deepseek_v3 import DeepseekV3Config

    d = json.loads((FIXTURES / NAMES[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="routing"):
        DeepseekV3Config.from_hf({**d, "scoring_func": "softmax"})


def test_host_tier_serves_evicted_latent_prefix():
    """Latent pages go through the KV tiers like any full-attention page: evicted from a small
    device pool, A's prefix comes back from the host tier and the output is unchanged."""
    from loomserve import LLM
    from tests.kv.connector.conftest import GREEDY as TIER_GREEDY
    from tests.kv.connector.conftest import OTHERS, A, settle

    path, bs = str(FIXTURES / NAMES[0]), 16
    plain = LLM(path, dtype="float32", device="cpu", enable_prefix_caching=False, kv_cache_memory="1MiB")
    want = {tuple(p): plain.generate(p, TIER_GREEDY)[0].token_ids for p in [A, *OTHERS]}
    page = plain.core.runner.kv_cache_config.page_bytes
    assert page == bs * 3 * 40 * 4  # the default block size: 16 latent rows of 3 layers
    llm = LLM(path, dtype="float32", device="cpu", block_size=bs, kv_cache_memory=str(page * 16),
              host_cache_memory=str(page * 64))
    try:
        assert llm.generate(A, TIER_GREEDY)[0].token_ids == want[tuple(A)]
        settle(llm)
        for p in OTHERS:  # push A out of the 16-block device pool
            assert llm.generate(p, TIER_GREEDY)[0].token_ids == want[tuple(p)]
        again = llm.generate(A, TIER_GREEDY)[0]
        assert again.token_ids == want[tuple(A)]
        assert again.num_tier_cached_tokens == 96  # 6 full blocks of latent rows from the host tier
    finally:
        llm.close()


def test_engine_batch_with_chunked_prefills_matches_hf():
    """Three prompts at once under a 16-token step budget: the scheduler cuts prefills into
    chunks and runs them beside other requests' decodes; each output is HF's greedy one."""
    from transformers import AutoModelForCausalLM

    from loomserve import LLM

    name = NAMES[1]
    llm = LLM(str(FIXTURES / name), dtype="float32", device="cpu", block_size=4, kv_cache_memory="1MiB",
              max_num_batched_tokens=16, long_prefill_threshold=0)
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=torch.float32).eval()
    prompts = [_tokens(n, 20 + n) for n in (7, 30, 19)]
    try:
        outs = llm.generate(prompts, _greedy(8))
    finally:
        llm.close()
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert out.token_ids == hf


def test_stacked_expert_checkpoint_loads_the_same():
    """transformers 5 may store experts stacked (mlp.experts.gate_up_proj [E, 2I, H],
    down_proj [E, H, I]); both layouts fill the same parameters."""
    import json
    import re

    from safetensors.torch import load_file

    from loomserve.execution.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

    folder = FIXTURES / NAMES[0]
    cfg = DeepseekV3Config.from_hf(json.loads((folder / "config.json").read_text()))
    per_expert = load_file(str(folder / "model.safetensors"))
    stacked, parts = {}, {}
    for k, t in per_expert.items():
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight", k)
        if m:
            parts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
        else:
            stacked[k] = t
    for pre, p in parts.items():
        n = len(p["down_proj"])
        stacked[pre + ".gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"][e], p["up_proj"][e]]) for e in range(n)])
        stacked[pre + ".down_proj"] = torch.stack([p["down_proj"][e] for e in range(n)])
    a, b = DeepseekV3ForCausalLM(cfg), DeepseekV3ForCausalLM(cfg)
    a.load_weights(per_expert.items())
    b.load_weights(stacked.items())
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), name
    with pytest.raises(ValueError, match="missing"):
        DeepseekV3ForCausalLM(cfg).load_weights((k, t) for k, t in per_expert.items() if ".experts.3." not in k)
