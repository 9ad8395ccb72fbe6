"""ModelRunner set-up: KV sizing and the layer-major page layout, length limits, and a Qwen2 (q/k/v
bias) checkpoint built on the fly against transformers."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from loomserve.config import EngineConfig
from loomserve.execution.batch import ModelInput
from loomserve.execution.model_runner import ModelRunner
from loomserve.kv.spec import FullAttentionSpec
from tests.execution.models.conftest import FIXTURES, Blocks, logits_of, ref_logits, seq


def test_kv_cache_config_and_layer_major_views():
    r = ModelRunner(EngineConfig.from_kwargs(model=str(FIXTURES / "tiny-llama"), device="cpu", block_size=8,
                                 kv_cache_memory="1MiB"))
    kc = r.kv_cache_config
    (group,) = kc.groups
    assert group.spec == FullAttentionSpec(8, 2, 16, torch.float32) and group.layer_ids == (0, 1)
    assert kc.page_bytes == 2 * 2 * 8 * 2 * 16 * 4
    assert kc.num_blocks == (1 << 20) // kc.page_bytes
    slot = kc.page_bytes // 2  # one layer's K and V of a block
    assert r.pool.layer_major and r.kv_buffer.dtype == torch.uint8
    assert r.kv_buffer.shape == (kc.num_blocks, 2, slot) and r.tier_page_bytes == kc.page_bytes
    # Layer 1's K of block 3 lies in layer 1's region, right after its blocks 0-2; V follows K.
    attn1 = r.model.model.layers[1].self_attn
    base = r.pool.storage.data_ptr()
    assert attn1.k_cache[3].data_ptr() - base == kc.num_blocks * slot + 3 * slot
    assert attn1.v_cache[3].data_ptr() - attn1.k_cache[3].data_ptr() == slot // 2
    # Block 3's page, flattened as the tiers see it: layer 0 (K, V), then layer 1 (K, V).
    attn1.k_cache[3].fill_(1.5)
    page = r.kv_buffer[3].reshape(-1)
    assert torch.equal(page[slot:slot + slot // 2].view(torch.float32), torch.full((8 * 2 * 16,), 1.5))
    assert not page[:slot].any() and not page[slot + slot // 2:].any()
    assert r.model_name == "tiny-llama" and r.max_model_len == 256 and r.vocab_size == 512
    assert r.num_params > 0


class _PackedStandIn(nn.Module):
    """What the bf16 CPU layout makes of a linear layer (PackedLinear): the weight becomes a plain
    tensor, no parameter. Stands in where the host has no oneDNN bf16 kernels."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int) -> None:
        super().__init__()
        self.packed, self.bias_t = weight.detach().clone(), None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.packed, self.bias_t)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])  # untied, tied embeddings
def test_num_params_counts_the_checkpoint_in_every_dtype(name, monkeypatch):
    """num_params is transformers' num_parameters() whatever the dtype, even where the bf16 layout
    turns every linear into a packed tensor; weight_bytes is what a decode step reads: every
    weight once, the input embedding only where it doubles as the LM head."""
    from transformers import AutoModelForCausalLM

    from loomserve.execution.models.loading import weight_layout

    monkeypatch.setattr(weight_layout, "onednn_bf16_available", lambda: True)
    monkeypatch.setattr(weight_layout, "_packed", _PackedStandIn)
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / name), dtype=torch.float32)
    want, tied = ref.num_parameters(), ref.config.tie_word_embeddings
    table = ref.get_input_embeddings().weight.numel()
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        r = ModelRunner(EngineConfig.from_kwargs(model=str(FIXTURES / name), device="cpu", dtype=dtype,
                                                 kv_cache_memory="1MiB"))
        assert r.num_params == want, dtype
        assert r.weight_bytes == size * (want if tied else want - table), dtype
        if dtype == "bfloat16":  # the layout did hide the linears from parameters()
            assert sum(p.numel() for p in r.model.parameters()) < want


def test_max_model_len_limits():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelRunner(EngineConfig.from_kwargs(model=str(FIXTURES / "tiny-qwen3"), device="cpu", max_model_len=10_000))
    r = ModelRunner(EngineConfig.from_kwargs(model=str(FIXTURES / "tiny-qwen3"), device="cpu", max_model_len=64,
                                 kv_cache_memory="1MiB"))
    assert r.max_model_len == 64


def test_qwen2_bias_matches_hf(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
                      tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    ref = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF inits biases to zero; make them matter
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    ref.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "tiny-llama" / f, tmp_path / f)
    r = ModelRunner(EngineConfig.from_kwargs(model=str(tmp_path), device="cpu", block_size=4, kv_cache_memory="1MiB"))
    tokens = torch.randint(3, 400, (14,), generator=torch.Generator().manual_seed(0)).tolist()
    want = ref_logits(ref, tokens)
    blocks, table = Blocks(4), []
    got = logits_of(r, [seq("q", tokens[:9], 0, blocks.cover(table, 9))])
    torch.testing.assert_close(got["q"], want[8], atol=1e-4, rtol=1e-4)
    got = logits_of(r, [seq("q", tokens[9:], 9, blocks.cover(table, 14))])
    torch.testing.assert_close(got["q"], want[13], atol=1e-4, rtol=1e-4)
    out = r.execute(ModelInput([seq("q", [tokens[13]], 14, blocks.cover(table, 15), sample=False)]))
    assert out.sampled == {}


def test_bfloat16_runner_tracks_fp32_reference():
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / "tiny-llama"), dtype=torch.float32).eval()
    r = ModelRunner(EngineConfig.from_kwargs(model=str(FIXTURES / "tiny-llama"), device="cpu", dtype="bfloat16",
                                 block_size=4, kv_cache_memory="1MiB"))
    assert r.kv_cache_config.groups[0].spec.dtype == torch.bfloat16
    tokens = torch.randint(3, 400, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    want = ref_logits(ref, tokens)
    blocks, table = Blocks(4), []
    got = logits_of(r, [seq("b", tokens[:12], 0, blocks.cover(table, 12))])
    torch.testing.assert_close(got["b"], want[11], atol=0.1, rtol=0.05)
    got = logits_of(r, [seq("b", tokens[12:], 12, blocks.cover(table, 13))])
    torch.testing.assert_close(got["b"], want[12], atol=0.1, rtol=0.05)
