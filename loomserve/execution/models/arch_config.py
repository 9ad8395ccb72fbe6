"""Architecture config of an attention decoder, parsed from an HF config.json dict.

One dataclass holds what the attention models share, as switches: a bias on q/k/v, q and k
normed per head, RoPE scaling (llama3, linear, YaRN, dynamic NTK), a sliding window over some or
all layers (`layer_types`); context_length: how long a context the config's RoPE covers. A
model's own config subclasses it in the model's file (llama.py's LlamaConfig, gemma3.py,
gpt_oss.py) and says what is its own: the HF model types it parses, its activation, its defaults
and extra fields (model_fields), its RoPE (rope_from_hf) and its layer pattern
(default_layer_types). Anything the model code cannot honour is rejected in from_hf, before a
weight is read, with a message that says why. Models with other layers (linear-attention hybrids,
MLA) have config classes of their own and share parse_rope and eos_token_ids from here.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")
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
    # {"rope_type": "llama3" | "linear" | "yarn" | "dynamic", "factor": ..., ...}; None = plain.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # a bias on the q/k/v projections
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_act: str = "silu"
    # Per layer "full_attention" | "sliding_attention"; sliding layers see `sliding_window` keys.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    hf: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # What a model's subclass states: the HF model_type values it parses (() = any) and the
    # MLP activation its code computes.
    model_types: ClassVar[tuple[str, ...]] = ()
    activation: ClassVar[str] = "silu"

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "ArchConfig":
        mtype = d.get("model_type", cls.model_types[0] if cls.model_types else "")
        if cls.model_types and mtype not in cls.model_types:
            raise ValueError(f"unsupported model_type {mtype!r} for {cls.__name__}; "
                             f"supported: {cls.model_types}")
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if act != cls.activation:
            raise ValueError(f"unsupported hidden_act {act!r} for {mtype}")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        own = cls.model_fields(d)
        max_pos = int(d.get("max_position_embeddings", 2048))
        num_layers = int(d["num_hidden_layers"])
        window, layer_types = _layer_types(d, num_layers, max_pos, cls.default_layer_types)
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of kv heads "
                             f"{kv_heads}")
        fields = dict(
            model_type=mtype,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_token_ids(d),
            hidden_act=act,
            layer_types=layer_types,
            sliding_window=window,
            hf=d,
        )
        return cls(**{**fields, **cls.rope_from_hf(d), **own})

    @classmethod
    def model_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        """The model's own fields and defaults from the HF dict (raise for what it cannot run)."""
        return {}

    @classmethod
    def rope_from_hf(cls, d: dict[str, Any]) -> dict[str, Any]:
        theta, scaling = parse_rope(d.get("rope_parameters"), d.get("rope_scaling"),
                                    d.get("rope_theta"), original=original_max_len(d))
        return {"rope_theta": theta, "rope_scaling": scaling}

    @classmethod
    def default_layer_types(cls, d: dict[str, Any], num_layers: int,
                            window: int | None) -> list[str]:
        """Per-layer types for a config without `layer_types`: one window over every layer."""
        return [SLIDING if window is not None else FULL] * num_layers


def parse_rope(params: dict[str, Any] | None, old: dict[str, Any] | None, theta: float | None,
               default_theta: float = 10000.0, original: int | None = None
               ) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from an HF config's RoPE keys, checked against what rotary.py
    computes. original: the pretraining length llama3 and yarn scale from where the scaling
    does not say (transformers' default: original_max_len)."""
    # transformers 5 folds theta and scaling into rope_parameters; older configs keep
    # rope_theta and rope_scaling apart (scaling sometimes says "type" instead of "rope_type").
    # Both present (an --hf-overrides rope_scaling over a transformers 5 config), rope_scaling
    # wins key by key and the rest stays: scaling a model's RoPE keeps its base.
    params = dict(params or {})
    if old:
        old = dict(old)
        if "type" in old:  # the legacy spelling of the type must win over rope_parameters' too
            old.setdefault("rope_type", old.pop("type"))
        params.update(old)
    theta = float(params.pop("rope_theta", theta if theta is not None else default_theta))
    rtype = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rtype!r}; "
                         f"supported: {SUPPORTED_ROPE_TYPES}")
    if rtype == "default":
        return theta, None
    if "factor" not in params:
        raise ValueError(f"rope scaling {rtype!r} needs a 'factor'")
    if rtype in ("llama3", "yarn") and original is not None:
        params.setdefault("original_max_position_embeddings", original)
    needs = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("original_max_position_embeddings",)}.get(rtype, ())
    for key in needs:
        if key not in params:
            raise ValueError(f"{rtype} rope scaling needs {key!r}")
    return theta, {"rope_type": rtype, **params}


def _layer_types(d: dict[str, Any], num_layers: int, max_pos: int,
                 default) -> tuple[int | None, tuple[str, ...]]:
    """(window, per-layer types); (None, all full) when nothing slides."""
    window = d.get("sliding_window")
    # Qwen2/3 ship a sliding_window value but switch it off with use_sliding_window=False.
    if d.get("use_sliding_window") is False:
        window = None
    types = d.get("layer_types")
    if types is None:
        types = default(d, num_layers, window)
    types = tuple(types)
    if len(types) != num_layers or not set(types) <= {FULL, SLIDING}:
        raise ValueError(f"unsupported layer_types {types!r} "
                         "(full_attention/sliding_attention, one per layer)")
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
    if isinstance(eos, list):
        return tuple(int(e) for e in eos)
    return () if eos is None else (int(eos),)


def original_max_len(d: dict[str, Any]) -> int | None:
    """The pretraining length of an HF config dict, as transformers' standardize_rope_params
    reads it: a top-level original_max_position_embeddings (Phi-3), else max_position_embeddings."""
    value = d.get("original_max_position_embeddings") or d.get("max_position_embeddings")
    return None if value is None else int(value)


# --- context length -----------------------------------------------------------------------------

log = logging.getLogger("loomserve.execution")


def context_limit(cfg: Any) -> int:
    """The longest context a parsed config's RoPE covers: vLLM's derived max_model_len, except
    that where a config's scaling says more than max_position_embeddings it is believed.

    linear, dynamic: max_position_embeddings * factor (the config's length is the trained one).
    yarn, llama3: original_max_position_embeddings * factor, or max_position_embeddings where
    that is more (Llama 3.1 ships 131072 over llama3 8192 x 8; DeepSeek-V3 and gpt-oss ship the
    product). Gemma 3's linear scaling is the one it ships, counted in its max_position_embeddings
    already (vLLM skips Gemma 3 too)."""
    max_pos = int(cfg.max_position_embeddings)
    s = getattr(cfg, "rope_scaling", None)
    if s is None:
        return max_pos
    factor = float(s["factor"])
    if s["rope_type"] == "linear" and getattr(cfg, "model_type", "").startswith("gemma3"):
        return max_pos
    if s["rope_type"] in ("linear", "dynamic"):
        return int(max_pos * factor)
    return max(max_pos, int(int(s["original_max_position_embeddings"]) * factor))


def context_length(requested: int | None, cfg: Any, trained: int | None = None) -> int:
    """The context the engine runs: `requested` (--max-model-len) or context_limit(cfg).

    trained: the checkpoint's own limit, before --hf-overrides (None: cfg's). Past
    context_limit is an error naming the --hf-overrides that would allow it; past `trained`
    one log line says so (quality past the trained length is the model's, not guaranteed)."""
    limit = context_limit(cfg)
    trained = limit if trained is None else trained
    length = limit if requested is None else requested
    if length > limit:
        raise ValueError(_past_limit(length, limit, trained, cfg))
    if length > trained:
        s = getattr(cfg, "rope_scaling", None)
        if s is None:
            log.warning("context %d tokens is past the model's trained %d with no RoPE scaling "
                        "(max_position_embeddings raised by --hf-overrides): positions past %d "
                        "are ones the model never saw", length, trained, trained)
        else:
            log.info("context %d tokens is past the model's trained %d under --hf-overrides: %s "
                     "RoPE scaling, factor %g, allows up to %d; quality past %d tokens is the "
                     "model's", length, trained, s["rope_type"], float(s["factor"]), limit,
                     trained)
    return length


def _past_limit(length: int, limit: int, trained: int, cfg: Any) -> str:
    """The error for a context past the limit, with the --hf-overrides that would allow it."""
    s = getattr(cfg, "rope_scaling", None)
    why = ("max_position_embeddings, no RoPE scaling" if s is None else
           f"{s['rope_type']} RoPE scaling, factor {float(s['factor']):g}")
    factor = float(-(-length // trained))
    override = {"rope_scaling": {
        "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": trained}}
    return (f"max_model_len={length} is past the model's context of {limit} tokens ({why}). "
            f"To run longer, scale RoPE past the trained {trained}, e.g. "
            f"--hf-overrides '{json.dumps(override)}' (quality past the trained length is the "
            "model's, not guaranteed), or lower --max-model-len")
