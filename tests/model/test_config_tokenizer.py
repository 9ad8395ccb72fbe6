"""Architecture config parsing and the tokenizer wrapper on the tiny fixtures."""

from __future__ import annotations

import json

import pytest

from loomserve.model.config import ModelConfig
from loomserve.model.tokenizer import Tokenizer
from tests.model.conftest import FIXTURES

BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            vocab_size=100)


def test_llama3_scaling_old_and_new_keys():
    old = ModelConfig.from_hf({**BASE, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert old.rope_theta == 5e5 and old.rope_type == "llama3" and old.num_kv_heads == 4
    new = ModelConfig.from_hf(json.load(open(FIXTURES / "tiny-llama" / "config.json")))
    assert new.rope_type == "llama3" and new.num_kv_heads == 2 and new.head_dim == 16
    assert not new.tie_word_embeddings


def test_qwen_switches():
    q3 = ModelConfig.from_hf(json.load(open(FIXTURES / "tiny-qwen3" / "config.json")))
    assert q3.qk_norm and q3.tie_word_embeddings and not q3.attention_bias
    q2 = ModelConfig.from_hf({**BASE, "model_type": "qwen2", "sliding_window": 32768,
                              "use_sliding_window": False})
    assert q2.attention_bias and not q2.qk_norm


def test_rejects_what_the_model_cannot_run():
    with pytest.raises(ValueError, match="sliding"):
        ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 4096,
                             "max_position_embeddings": 32768})
    ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": None})
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_hf({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({**BASE, "model_type": "gpt2"})


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
