"""GGUF -> HF folder (config.json, model.safetensors, tokenizer files), read natively with `gguf`.

Quantized tensors are dequantized to fp32 once and the result is written as an ordinary HF
folder, so a restart loads safetensors and skips both dequantization and tokenizer building.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np
import torch

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time Q/K row order for llama-arch models.

    HF rotates the two halves of each head (rotate_half); llama.cpp rotates adjacent pairs, so
    its converter interleaves each head's rows: row (i, half h) moves to position 2*i + h. Here
    that is reversed: per head, view rows as [head_dim/2, 2] and swap the two axes back.
    """
    rows = w.shape[0]
    per_head = rows // n_heads
    return w.reshape(n_heads, per_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def hf_config(reader) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_TO_MODEL_TYPE:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCH_TO_MODEL_TYPE)}")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name for t in reader.tensors}
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    vocab = a("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg: dict[str, Any] = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": _ARCH_TO_MODEL_TYPE[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": int(a("attention.key_length", hidden // heads)),
        "intermediate_size": int(a("feed_forward_length")),
        "vocab_size": int(vocab),
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(a("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    if arch == "qwen2":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    stype = a("rope.scaling.type")
    if stype and stype != "none":
        if stype != "linear":
            raise ValueError(f"unsupported GGUF rope scaling {stype!r}")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    return cfg


def convert_gguf(path: str, out_dir: str) -> None:
    """Write the HF folder for `path` into out_dir (created; the caller renames it into place)."""
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(path)
    cfg = hf_config(reader)
    permute = cfg["model_type"] == "llama"
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; HF/torch want them slowest-first.
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
        if permute and t.name.endswith("attn_q.weight"):
            w = unpermute_rope_rows(w, cfg["num_attention_heads"])
        elif permute and t.name.endswith("attn_k.weight"):
            w = unpermute_rope_rows(w, cfg["num_key_value_heads"])
        tensors[hf_name(t.name)] = torch.from_numpy(np.array(w, copy=True))  # memmap is read-only
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    _write_tokenizer(path, reader, out_dir)


def _write_tokenizer(path: str, reader, out_dir: str) -> None:
    # transformers knows how to turn GGUF vocab + merges into a fast tokenizer; we only keep its
    # output files and set the chat template ourselves, from the GGUF metadata.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                        gguf_file=os.path.basename(path))
    tok.save_pretrained(out_dir)
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok_cfg["chat_template"] = template
        stray = os.path.join(out_dir, "chat_template.jinja")
        if os.path.exists(stray):
            os.remove(stray)
    with open(cfg_path, "w") as f:
        json.dump(tok_cfg, f, indent=2, ensure_ascii=False)


def cached_conversion(path: str, cache_dir: str) -> str:
    """HF folder for a GGUF file, converting on first use. Safe against concurrent converters."""
    folder = os.path.join(cache_dir, f"{os.path.splitext(os.path.basename(path))[0]}-{_file_key(path)}")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    tmp = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert_gguf(path, tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first; its folder is as good as ours
            if not os.path.exists(os.path.join(folder, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _file_key(path: str) -> str:
    import hashlib

    st = os.stat(path)
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]
