"""Architecture config of a decoder-only model, parsed from an HF config.json dict.

One dataclass covers the Llama family as it differs in small switches: Qwen2 adds a bias on
q/k/v, Qwen3 normalizes q and k per head, Llama 3 rescales RoPE frequencies. Anything the model
code cannot honour is rejected here, before a weight is read, with a message that says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
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
    # {"rope_type": "llama3" | "linear" | "default", "factor": ..., ...}; None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ModelConfig":
        mtype = d.get("model_type", "llama")
        if mtype not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {mtype!r}; supported: {SUPPORTED_MODEL_TYPES}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        max_pos = int(d.get("max_position_embeddings", 2048))
        _check_sliding_window(d, mtype, max_pos)

        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of kv heads {kv_heads}")
        theta, scaling = _rope(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=mtype,
            hidden_size=hidden,
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 configs predate the attention_bias key: their q/k/v always carry a bias.
            attention_bias=bool(d.get("attention_bias", mtype == "qwen2")),
            qk_norm=mtype == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 folds theta and scaling into rope_parameters; older configs keep
    # rope_theta and rope_scaling apart (scaling sometimes says "type" instead of "rope_type").
    params = dict(d.get("rope_parameters") or {})
    old = d.get("rope_scaling")
    if old:
        params.update(old)
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rtype = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rtype!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rtype == "default":
        return theta, None
    if "factor" not in params:
        raise ValueError(f"rope scaling {rtype!r} needs a 'factor'")
    if rtype == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise ValueError(f"llama3 rope scaling needs {key!r}")
    return theta, {"rope_type": rtype, **params}


def _check_sliding_window(d: dict[str, Any], mtype: str, max_pos: int) -> None:
    window = d.get("sliding_window")
    # Qwen2/3 ship a sliding_window value but switch it off with use_sliding_window=False.
    if window is None or d.get("use_sliding_window") is False:
        return
    if int(window) >= max_pos:
        return  # a window as long as the context is full attention
    raise ValueError(
        f"{mtype} config uses sliding_window={window} < max_position_embeddings={max_pos}; "
        "sliding-window attention is not supported yet")
