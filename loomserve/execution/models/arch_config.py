"""Architecture config of a decoder-only model, parsed from an HF config.json dict.

One dataclass covers the attention models as they differ in switches: Qwen2 adds a bias on
q/k/v, Qwen3 normalizes q and k per head, Llama 3 rescales RoPE frequencies, Mistral slides a
window over every layer, Gemma 3 and gpt-oss alternate sliding and full layers (`layer_types`).
Anything the model code cannot honour is rejected here, before a weight is read, with a message
that says why. Models with their own config needs (linear-attention hybrids) parse `hf`, the raw
dict, themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # {"rope_type": "llama3" | "linear" | "yarn", "factor": ..., ...}; None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections (gpt-oss: on o too)
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "LlamaForCausalLM"
    hidden_act: str = "silu"
    # Per layer "full_attention" | "sliding_attention"; sliding layers see `sliding_window` keys.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # Gemma 3: sliding layers rotate with their own base (and no scaling).
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # Gemma 3: scores scaled by its -1/2 power
    final_logit_softcapping: float | None = None  # Gemma 3: cap * tanh(logits / cap)
    # gpt-oss mixture of experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    hf: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ArchConfig":
        mtype = d.get("model_type", "llama")
        if mtype not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {mtype!r}; supported: {SUPPORTED_MODEL_TYPES}")
        gemma = mtype == "gemma3_text"
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise ValueError(f"unsupported hidden_act {act!r} for {mtype}")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if gemma and d.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping is not supported (Gemma 2-style score capping)")
        if gemma and d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True is not supported (decoder only)")
        max_pos = int(d.get("max_position_embeddings", 2048))
        num_layers = int(d["num_hidden_layers"])
        window, layer_types = _layer_types(d, mtype, num_layers, max_pos)

        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of kv heads {kv_heads}")
        if gemma:
            theta, scaling, local_theta = _gemma3_rope(d)
        else:
            theta, scaling = _rope(d.get("rope_parameters"), d.get("rope_scaling"), d.get("rope_theta"))
            local_theta = None
        eos_ids = eos_token_ids(d)
        archs = d.get("architectures") or [_DEFAULT_ARCH[mtype]]
        return cls(
            model_type=mtype,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            # Qwen2 configs predate the attention_bias key: their q/k/v always carry a bias.
            attention_bias=bool(d.get("attention_bias", mtype in ("qwen2", "gpt_oss"))),
            qk_norm=mtype in ("qwen3", "gemma3_text"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=archs[0],
            hidden_act=act,
            layer_types=layer_types,
            sliding_window=window,
            local_rope_theta=local_theta,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)) if gemma else None,
            final_logit_softcapping=d.get("final_logit_softcapping") if gemma else None,
            num_experts=int(d.get("num_local_experts", 0)) if mtype == "gpt_oss" else 0,
            num_experts_per_tok=int(d.get("num_experts_per_tok", 0)) if mtype == "gpt_oss" else 0,
            swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(d.get("swiglu_limit", 7.0)),
            hf=d,
        )


_DEFAULT_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "gpt_oss": "GptOssForCausalLM"}


def _rope(params: dict[str, Any] | None, old: dict[str, Any] | None,
          theta: float | None, default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 folds theta and scaling into rope_parameters; older configs keep
    # rope_theta and rope_scaling apart (scaling sometimes says "type" instead of "rope_type").
    params = dict(params or {})
    if old:
        params.update(old)
    theta = float(params.pop("rope_theta", theta if theta is not None else default_theta))
    rtype = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rtype!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rtype == "default":
        return theta, None
    if "factor" not in params:
        raise ValueError(f"rope scaling {rtype!r} needs a 'factor'")
    needs = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("original_max_position_embeddings",)}.get(rtype, ())
    for key in needs:
        if key not in params:
            raise ValueError(f"{rtype} rope scaling needs {key!r}")
    return theta, {"rope_type": rtype, **params}


def _gemma3_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """Gemma 3: full layers use rope_theta (+ scaling), sliding layers rope_local_base_freq.
    transformers 5 writes both under rope_parameters, keyed by layer type."""
    params = d.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        theta, scaling = _rope(params.get(FULL), d.get("rope_scaling"), None, 1_000_000.0)
        local, local_scaling = _rope(params.get(SLIDING), None, None, 10_000.0)
    else:
        theta, scaling = _rope(params, d.get("rope_scaling"), d.get("rope_theta"), 1_000_000.0)
        local, local_scaling = float(d.get("rope_local_base_freq", 10_000.0)), None
    if local_scaling is not None:
        raise ValueError("rope scaling on Gemma 3 sliding layers is not supported")
    return theta, scaling, local


def _layer_types(d: dict[str, Any], mtype: str, num_layers: int,
                 max_pos: int) -> tuple[int | None, tuple[str, ...]]:
    """(window, per-layer types); (None, all full) when nothing slides."""
    window = d.get("sliding_window")
    # Qwen2/3 ship a sliding_window value but switch it off with use_sliding_window=False.
    if d.get("use_sliding_window") is False:
        window = None
    types = d.get("layer_types")
    if types is None:
        if mtype == "gemma3_text":
            pattern = int(d.get("sliding_window_pattern", 6))
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
        elif mtype == "gpt_oss":
            types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
        elif mtype in ("qwen2", "qwen3") and window is not None:
            first = int(d.get("max_window_layers", num_layers))
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        else:
            types = [SLIDING if window is not None else FULL] * num_layers
    types = tuple(types)
    if len(types) != num_layers or not set(types) <= {FULL, SLIDING}:
        raise ValueError(f"unsupported layer_types {types!r} (full_attention/sliding_attention, one per layer)")
    if window is None or SLIDING not in types:
        return None, (FULL,) * num_layers
    if int(window) >= max_pos:
        return None, (FULL,) * num_layers  # a window as long as the context is full attention
    if int(window) < 1:
        raise ValueError(f"sliding_window={window} must be positive")
    return int(window), types


def eos_token_ids(d: dict[str, Any]) -> tuple[int, ...]:
    """config.json's eos_token_id: absent, one id, or a list of ids."""
    eos = d.get("eos_token_id")
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
