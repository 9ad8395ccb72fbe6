"""Architecture config parsing and the tokenizer wrapper on the tiny fixtures."""

from __future__ import annotations

import json

import pytest

from loomserve.engine.tokenizer import Tokenizer
from loomserve.execution.models.gemma3 import Gemma3Config
from loomserve.execution.models.gpt_oss import GptOssConfig
from loomserve.execution.models.llama import LlamaConfig
from tests.execution.models.conftest import FIXTURES

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            vocab_size=100)


def test_llama3_scaling_old_and_new_keys():
    old = LlamaConfig.from_hf({**BASE, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert old.rope_theta == 5e5 and old.rope_type == "llama3" and old.num_kv_heads == 4
    new = LlamaConfig.from_hf(json.load(open(FIXTURES / "tiny-llama" / "config.json")))
    assert new.rope_type == "llama3" and new.num_kv_heads == 2 and new.head_dim == 16
    assert not new.tie_word_embeddings


def test_qwen_switches():
    q3 = LlamaConfig.from_hf(json.load(open(FIXTURES / "tiny-qwen3" / "config.json")))
    assert q3.qk_norm and q3.tie_word_embeddings and not q3.attention_bias
    q2 = LlamaConfig.from_hf({**BASE, "model_type": "qwen2", "sliding_window": 32768,
                              "use_sliding_window": False})
    assert q2.attention_bias and not q2.qk_norm


def test_sliding_window_layer_types():
    m = LlamaConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 4096,
                             "max_position_embeddings": 32768})
    assert m.sliding_window == 4096 and m.layer_types == ("sliding_attention",) * 2
    for window in (None, 32768):  # no window, or one as long as the context: full attention
        m = LlamaConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": window,
                                 "max_position_embeddings": 32768})
        assert m.sliding_window is None and not m.is_sliding(0)
    q2 = LlamaConfig.from_hf({**BASE, "model_type": "qwen2", "sliding_window": 16,
                              "use_sliding_window": True, "max_window_layers": 1})
    assert q2.layer_types == ("full_attention", "sliding_attention")
    g = Gemma3Config.from_hf({**BASE, "model_type": "gemma3_text", "num_hidden_layers": 7,
                              "sliding_window": 8, "hidden_activation": "gelu_pytorch_tanh",
                              "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                              "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert [g.is_sliding(i) for i in range(7)] == [True] * 5 + [False, True]
    assert g.rope_theta == 1e6 and g.local_rope_theta == 1e4 and g.rope_type == "linear"
    assert g.tie_word_embeddings and g.qk_norm and g.query_pre_attn_scalar == 256


def test_each_model_parses_its_own_config():
    from loomserve.execution.models.registry import resolve
    o = GptOssConfig.from_hf({**BASE, "model_type": "gpt_oss", "sliding_window": 8,
                              "num_local_experts": 4, "num_experts_per_tok": 2})
    assert o.layer_types == ("sliding_attention", "full_attention") and o.attention_bias
    assert (o.num_experts, o.num_experts_per_tok, o.swiglu_limit) == (4, 2, 7.0)
    for fixture, want in (("tiny-llama", LlamaConfig), ("tiny-qwen3", LlamaConfig),
                          ("tiny-gemma3", Gemma3Config), ("tiny-gpt-oss", GptOssConfig)):
        _, cfg = resolve(json.load(open(FIXTURES / fixture / "config.json")))
        assert type(cfg) is want
    with pytest.raises(ValueError, match="model_type 'gemma3_text' for LlamaConfig"):
        resolve({**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "gemma3_text"})


def test_rejects_what_the_model_cannot_run():
    with pytest.raises(ValueError, match="layer_types"):
        LlamaConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 8,
                             "layer_types": ["chunked_attention"] * 2})
    with pytest.raises(ValueError, match="softcapping"):
        Gemma3Config.from_hf({**BASE, "model_type": "gemma3_text",
                              "hidden_activation": "gelu_pytorch_tanh",
                              "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="rope"):
        LlamaConfig.from_hf({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type"):
        LlamaConfig.from_hf({**BASE, "model_type": "gpt2"})


def test_tokenizer_roundtrip_chat_and_eos():
    tok = Tokenizer.from_folder(str(FIXTURES / "tiny-llama"))
    text = "Hello world! def main():"
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert im_end == [2] and 2 in tok.eos_token_ids
    assert tok.vocab_size <= 512 and tok.bos_token_id == 1
    assert "<|im_end|>" not in tok.decode(tok.encode(prompt))


def test_no_chat_template_is_a_value_error():
    tok = Tokenizer.from_folder(str(FIXTURES / "tiny-llama"))
    tok.chat_template = None
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("fixture", ["tiny-llama", "tiny-qwen3", "tiny-gemma3", "tiny-gpt-oss"])
def test_decode_equals_transformers(fixture):
    """Tokenizer.decode may call the Rust tokenizer directly: it must give transformers' text
    (special tokens kept or skipped, split multi-byte characters, single ids)."""
    import random
    tok = Tokenizer.from_folder(str(FIXTURES / fixture))
    assert tok._decode != tok.hf.decode  # these fixtures take the direct path
    rng = random.Random(0)
    special = sorted(tok.hf.all_special_ids)
    cases = [tok.encode("Hello, world! café 😀 ünïcode\n\tdone", add_special_tokens=False)]
    cases += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))] + special[:2]
              for _ in range(50)]
    cases += [[i] for i in range(0, tok.vocab_size, max(1, tok.vocab_size // 200))]
    for ids in cases:
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(
                ids, skip_special_tokens=skip)
