"""GGUF -> HF folder (config.json, model.safetensors, tokenizer files), read natively with `gguf`.

Quantized tensors are dequantized to fp32 once and the result is written as an ordinary HF
folder, so a restart loads safetensors and skips both dequantization and tokenizer building.

Architectures: llama, qwen2, qwen3, qwen3moe, gemma3, gpt-oss, deepseek2. The authority for what
a file holds is llama.cpp's converter (convert_hf_to_gguf.py, gguf-py's tensor names): what it
changed is undone (_undo_converter, _hf_layout) so the folder is the HF checkpoint it was made
from; what it left out is what llama.cpp's reader assumes (hf_config). Checked on files made by
that converter from the tiny fixtures (tests/execution/models/test_gguf_architectures.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N."): llama.cpp's names
# (gguf-py constants.py / tensor_mapping.py) for the families loomserve runs.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # Gemma 3's extra norms; gpt-oss's post-attention norm has the same GGUF name.
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    # DeepSeek MLA (q_proj when there is no q LoRA: attn_q)
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    # the newer converter's kv_b_proj halves; convert_gguf joins them back into kv_b_proj
    "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
    # MoE: router, shared experts, and 3D expert stacks [experts, rows, cols] that convert_gguf
    # splits per expert (mlp.experts.{e}.*_proj.weight) or, for gpt-oss, fuses
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
}
# Whole names (part.suffix) whose HF parameter has no .weight / .bias suffix.
_LAYER_FULL_NAMES = {"attn_sinks.weight": "self_attn.sinks",
                     "exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
# Where an architecture names a part differently from the table above.
_ARCH_LAYER_NAMES = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "gpt-oss": {"ffn_gate_inp": "mlp.router"},
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                       "gemma3": "gemma3_text", "gpt-oss": "gpt_oss", "deepseek2": "deepseek_v3"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                  "gemma3": "Gemma3ForCausalLM", "gpt-oss": "GptOssForCausalLM",
                  "deepseek2": "DeepseekV3ForCausalLM"}


def hf_name(gguf_name: str, arch: str | None = None) -> str:
    """The HF name of a GGUF tensor. Without `arch`, the names every family shares (a part that
    one family names differently -- Gemma 3's ffn_norm, gpt-oss's router -- gets the common name).
    3D expert stacks and MLA's k_b / v_b get names convert_gguf rewrites (no HF checkpoint has
    them): mlp.experts.{gate,up,down}_proj.{weight,bias}, self_attn.{k,v}_b_proj.weight."""
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight | bias
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        full = _LAYER_FULL_NAMES.get(f"{part}.{suffix}")
        if full is not None:
            return f"model.layers.{layer}.{full}"
        name = _ARCH_LAYER_NAMES.get(arch or "", {}).get(part) or _LAYER_NAMES.get(part)
        if name is None:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{name}.{suffix}"
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
    """A metadata value; a float32 one as the shortest decimal that is that float32 (1e-06, not
    9.999999974752427e-07), as the source config.json spelled it."""
    import gguf

    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    if f.types == [gguf.GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value


def hf_config(reader) -> dict[str, Any]:
    """The HF config.json a GGUF file's metadata stands for: the keys llama.cpp's converter
    (convert_hf_to_gguf.py) writes, read back as llama.cpp reads them (src/models/<arch>.cpp).
    What a GGUF does not record is what llama.cpp assumes for that family (per family below)."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH_TO_MODEL_TYPE:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCH_TO_MODEL_TYPE)}")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    names = {t.name for t in reader.tensors}
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = (int(embd.shape[1]) if embd is not None else None) or a("vocab_size") \
        or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": _ARCH_TO_MODEL_TYPE[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": int(a("attention.key_length", hidden // heads)),
        "intermediate_size": int(a("feed_forward_length", 0)),
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
    if arch in ("llama", "qwen2", "qwen3", "qwen3moe"):
        rope = _rope(a, ("linear",))
        if rope["rope_type"] != "default":
            cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if arch == "qwen3moe":
        # As llama.cpp's qwen3moe reads it (and every Qwen3-MoE release is): experts in every
        # layer, the top-k weights renormalized (norm_topk_prob).
        cfg.update(num_experts=int(a("expert_count")), num_experts_per_tok=int(a("expert_used_count")),
                   moe_intermediate_size=int(a("expert_feed_forward_length")),
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif arch == "gemma3":
        _gemma3(cfg, a)
    elif arch == "gpt-oss":
        _gpt_oss(cfg, a)
    elif arch == "deepseek2":
        _deepseek2(cfg, a, names)
    return cfg


def _rope(a, allowed: tuple[str, ...]) -> dict[str, Any]:
    """HF rope_parameters from rope.freq_base and rope.scaling.* (linear | yarn)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(a("rope.freq_base", 10000.0))}
    stype = a("rope.scaling.type")
    if not stype or stype == "none":
        return rope
    if stype not in allowed:
        raise ValueError(f"unsupported GGUF rope scaling {stype!r} (this family: {list(allowed)})")
    rope.update(rope_type=stype, factor=float(a("rope.scaling.factor")))
    if stype == "yarn":
        rope["original_max_position_embeddings"] = int(a("rope.scaling.original_context_length"))
        for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_ext_factor", "extrapolation_factor"),
                        ("yarn_attn_factor", "attention_factor")):
            if a(f"rope.scaling.{key}") is not None:
                rope[hf] = float(a(f"rope.scaling.{key}"))
    return rope


def _layer_types(a, layers: int, pattern: int) -> list[str]:
    """llama.cpp's load_swa_pattern: a per-layer bool array or a period under
    attention.sliding_window_pattern, else the family's period; layer i slides unless it is the
    last of its period."""
    got = a("attention.sliding_window_pattern")
    if isinstance(got, list):
        return ["sliding_attention" if s else "full_attention" for s in got[:layers]]
    n = int(got) if got is not None else pattern
    return ["sliding_attention" if n == 0 or i % n < n - 1 else "full_attention" for i in range(layers)]


def _gemma3(cfg: dict[str, Any], a) -> None:
    """Gemma 3. Not in the file, so taken as llama.cpp takes it: the layer pattern (5 sliding, 1
    full unless attention.sliding_window_pattern says otherwise) and the query scale -- the
    27B's hidden / heads (62 layers), every other size's head_dim (query_pre_attn_scalar)."""
    layers, window = cfg["num_hidden_layers"], a("attention.sliding_window")
    full = _rope(a, ("linear",))
    full["rope_theta"] = float(a("rope.freq_base", 1_000_000.0))
    cfg.update(
        hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=(cfg["hidden_size"] // cfg["num_attention_heads"] if layers == 62
                               else cfg["head_dim"]),
        final_logit_softcapping=a("final_logit_softcapping"), attn_logit_softcapping=None,
        rope_parameters={"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(a("rope.freq_base_swa", 10_000.0))}})
    if window:
        cfg.update(sliding_window=int(window), layer_types=_layer_types(a, layers, 6))
    else:
        cfg.update(sliding_window=None, layer_types=["full_attention"] * layers)
    del cfg["rope_theta"]


def _gpt_oss(cfg: dict[str, Any], a) -> None:
    """gpt-oss. Not in the file, as llama.cpp's openai-moe takes it: layers alternate sliding,
    full; the clamped SwiGLU's alpha 1.702 and limit 7.0. One exception: YaRN here keeps the
    released configs' truncate=false (OpenAI's reference and transformers), where llama.cpp
    rounds the ramp's bounds to whole dims (truncate=true); on the tiny test file that moves
    llama.cpp's log-probs by up to 0.38 from loomserve's (0.001 with truncate=true)."""
    rope = _rope(a, ("yarn",))
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False
    cfg.update(attention_bias=True, num_local_experts=int(a("expert_count")),
               num_experts_per_tok=int(a("expert_used_count")),
               intermediate_size=int(a("expert_feed_forward_length")),
               sliding_window=int(a("attention.sliding_window")),
               layer_types=_layer_types(a, cfg["num_hidden_layers"], 2),
               swiglu_alpha=1.702, swiglu_limit=7.0, rope_parameters=rope)
    del cfg["rope_theta"]


def _deepseek2(cfg: dict[str, Any], a, names: set[str]) -> None:
    """DeepSeek-V2/V3 (llama.cpp's deepseek2). The converter writes MLA as MQA: head_count_kv 1,
    key_length kv_lora_rank + rope dims, the per-head sizes under key_length_mla /
    value_length_mla (older files: key_length / value_length themselves). Its yarn_log_multiplier
    is 0.1 * mscale_all_dim; llama.cpp takes mscale equal to it (as in every DeepSeek release),
    so the rope's cos/sin factor is 1. Sigmoid gating is V3's noaux_tc routing (DeepseekV3);
    softmax (and no gating key: llama.cpp's default for older V2 files) is V2's."""
    rope_dims = int(a("rope.dimension_count"))
    qk = int(a("attention.key_length_mla") or a("attention.key_length"))
    v = int(a("attention.value_length_mla") or a("attention.value_length"))
    rope = _rope(a, ("yarn",))
    if rope["rope_type"] == "yarn" and a("rope.scaling.yarn_log_multiplier") is not None:
        # as llama.cpp reads it back (log_mul / 0.1f, in float32)
        m = float(str(np.float32(a("rope.scaling.yarn_log_multiplier")) / np.float32(0.1)))
        rope.update(mscale=m, mscale_all_dim=m)
    sigmoid = int(a("expert_gating_func", 1)) == 2  # gguf.ExpertGatingFuncType.SIGMOID
    n_group = int(a("expert_group_count", 1))
    cfg.update(
        q_lora_rank=int(a("attention.q_lora_rank")) if a("attention.q_lora_rank") else None,
        kv_lora_rank=int(a("attention.kv_lora_rank")), qk_nope_head_dim=qk - rope_dims,
        qk_rope_head_dim=rope_dims, qk_head_dim=qk, v_head_dim=v, head_dim=rope_dims,
        num_key_value_heads=cfg["num_attention_heads"],
        moe_intermediate_size=int(a("expert_feed_forward_length", 0)),
        n_routed_experts=int(a("expert_count", 0)) or None,
        num_experts_per_tok=int(a("expert_used_count", 1)),
        n_shared_experts=int(a("expert_shared_count", 0)),
        n_group=n_group, topk_group=int(a("expert_group_used_count", 1)),
        routed_scaling_factor=float(a("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(a("expert_weights_norm", False)),
        first_k_dense_replace=int(a("leading_dense_block_count", 0)),
        scoring_func="sigmoid" if sigmoid else "softmax",
        topk_method="noaux_tc" if sigmoid else ("group_limited_greedy" if n_group > 1 else "greedy"),
        rope_interleave=True, attention_bias=False, rope_parameters=rope)
    if not sigmoid:
        cfg.update(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"])
    del cfg["rope_theta"]


def convert_gguf(path: str, out_dir: str) -> None:
    """Write the HF folder for `path` into out_dir (created; the caller renames it into place)."""
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(path)
    cfg = hf_config(reader)
    arch = _field(reader, "general.architecture")
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; HF/torch want them slowest-first.
        w = np.asarray(w, dtype=np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
        tensors[hf_name(t.name, arch)] = _undo_converter(arch, cfg, t.name, w)
    tensors = _hf_layout(arch, cfg, tensors)
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: torch.from_numpy(np.array(w, dtype=np.float32, order="C")) for k, w in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    _write_tokenizer(path, reader, out_dir)


def _undo_converter(arch: str, cfg: dict[str, Any], name: str, w: np.ndarray) -> np.ndarray:
    """Undo what convert_hf_to_gguf.py did to one tensor's values: llama's Q/K row permutation;
    Gemma 3's +1 on every RMSNorm weight (llama.cpp multiplies by the stored value, HF by 1 + w:
    the stored 1 + w minus 1 is exact, so 1 + it is the source's 1 + w bit for bit)."""
    if arch == "llama" and name.endswith("attn_q.weight"):
        return unpermute_rope_rows(w, cfg["num_attention_heads"])
    if arch == "llama" and name.endswith("attn_k.weight"):
        return unpermute_rope_rows(w, cfg["num_key_value_heads"])
    if arch == "gemma3" and name.endswith("norm.weight"):
        return w - np.float32(1.0)
    return w


_STACK = re.compile(r"^(model\.layers\.\d+\.)(mlp\.experts|self_attn)\.(\w+)\.(weight|bias)$")


def _hf_layout(arch: str, cfg: dict[str, Any], tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Tensors the converter split, stacked or fused back into the HF checkpoint's:
    - MoE expert stacks [experts, rows, cols]: per expert, mlp.experts.{e}.{gate,up,down}_proj
      (the Hub's Qwen3-MoE / DeepSeek names); a fused gate_up stack is gate rows then up rows;
    - gpt-oss: its own fused layout, mlp.experts.gate_up_proj [experts, hidden, 2 * inter] with
      gate and up columns interleaved (g0 u0 g1 u1 ...), biases alike, and down_proj
      [experts, inter, hidden] (the converter de-interleaved and transposed them);
    - MLA: kv_b_proj from k_b (per head [kv_lora_rank, nope], transposed by the converter for
      llama.cpp's absorbed attention) and v_b (per head [v, kv_lora_rank]): per head, the nope
      rows then the v rows."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[str, np.ndarray]] = {}
    for name, w in tensors.items():
        m = _STACK.match(name)
        if m and m.group(3) in ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "k_b_proj",
                                "v_b_proj"):
            stacks.setdefault(m.group(1), {})[f"{m.group(3)}.{m.group(4)}"] = w
        else:
            out[name] = w
    for pre, parts in stacks.items():
        if "k_b_proj.weight" in parts:
            k_b = parts.pop("k_b_proj.weight").transpose(0, 2, 1)  # [heads, nope, rank]
            v_b = parts.pop("v_b_proj.weight")  # [heads, v, rank]
            kv_b = np.concatenate([k_b, v_b], axis=1)
            out[f"{pre}self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
        for suffix in ("weight", "bias"):
            fused = parts.pop(f"gate_up_proj.{suffix}", None)
            if fused is not None:  # [experts, 2 * inter, ...]: gate rows, then up rows
                half = fused.shape[1] // 2
                parts[f"gate_proj.{suffix}"], parts[f"up_proj.{suffix}"] = fused[:, :half], fused[:, half:]
        if not parts:
            continue
        if arch == "gpt-oss":
            out.update(_gpt_oss_experts(pre, parts))
            continue
        for key, w in parts.items():
            proj, _, suffix = key.partition(".")
            for e in range(w.shape[0]):
                out[f"{pre}mlp.experts.{e}.{proj}.{suffix}"] = w[e]
    return out


def _gpt_oss_experts(pre: str, parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    gate, up = parts["gate_proj.weight"], parts["up_proj.weight"]  # [experts, inter, hidden]
    e, i, h = gate.shape
    gate_up = np.empty((e, h, 2 * i), dtype=np.float32)
    gate_up[..., 0::2], gate_up[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
    bias = np.empty((e, 2 * i), dtype=np.float32)
    bias[:, 0::2], bias[:, 1::2] = parts["gate_proj.bias"], parts["up_proj.bias"]
    return {f"{pre}mlp.experts.gate_up_proj": gate_up, f"{pre}mlp.experts.gate_up_proj_bias": bias,
            f"{pre}mlp.experts.down_proj": parts["down_proj.weight"].transpose(0, 2, 1),
            f"{pre}mlp.experts.down_proj_bias": parts["down_proj.bias"]}


# llama.cpp pre-tokenizer regexes (src/llama-vocab.cpp) for byte-level vocabularies that
# transformers' GGUF tokenizer conversion does not know (it then splits like GPT-2); each is
# applied as the model's own tokenizer.json does: Split(isolated) per regex, then ByteLevel.
_PRE_SPLITS = {
    "deepseek-v3": (  # DeepSeek-V3 / R1
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}


def _write_tokenizer(path: str, reader, out_dir: str) -> None:
    """The file's own tokenizer, built by transformers' GGUF tokenizer conversion (vocabulary,
    merges, token types -> a fast tokenizer), and its chat template (tokenizer.chat_template).
    For llama / qwen2 / qwen3 transformers also picks the tokenizer class from the file's config;
    its GGUF config reader does not know deepseek2 and fails on gpt-oss files, so for the other
    families the same conversion builds a plain PreTrainedTokenizerFast. A pre-tokenizer it does not know (deepseek-v3) gets llama.cpp's
    regexes (_PRE_SPLITS)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if _field(reader, "general.architecture") in ("llama", "qwen2", "qwen3"):
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    else:
        tok = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    pre = _field(reader, "tokenizer.ggml.pre")
    if _field(reader, "tokenizer.ggml.model") == "gpt2" and pre in _PRE_SPLITS:
        from tokenizers import Regex, pre_tokenizers

        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif _field(reader, "tokenizer.ggml.model") == "gpt2" and pre not in (None, "default", "gpt-2"):
        try:  # transformers' own table (5.x)
            from transformers.integrations.gguf.gguf_tokenizer_mapping import (
                GGUF_PRE_TOKENIZER_SPLITS as known,
            )
        except ImportError:
            known = {}
        if pre not in known:
            log.warning("GGUF pre-tokenizer %r is known neither to transformers nor to loomserve: "
                        "text is split as GPT-2 splits it, which may not be this model's split", pre)
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
