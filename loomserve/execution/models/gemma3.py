"""Gemma 3 (text only: Gemma3ForCausalLM) over the paged KV cache.

What differs from the Llama family, as transformers' modeling_gemma3 does it:
- sliding and full layers alternate (layer_types; by default 5 sliding then 1 full), and each
  kind rotates with its own RoPE: sliding layers use rope_local_base_freq without scaling, full
  layers rope_theta with the config's scaling;
- every RMSNorm scales by (1 + w), in fp32, before casting back; q and k are normed per head;
- four norms per layer: the attention and MLP outputs are normed before their residual adds;
- embeddings are multiplied by sqrt(hidden) (the factor rounded to the model dtype first);
- the MLP gate uses tanh-approximated GELU; scores are scaled by query_pre_attn_scalar^-1/2;
- final logits are soft-capped (cap * tanh(logits / cap)) when final_logit_softcapping is set.

Tensor parallelism and decode context parallelism: Llama's (the extra norms are replicated, the
soft-cap applies after the logits are gathered).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from loomserve.execution.layers.mlp import GeluTanhGLU
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.layers.rotary import RotaryEmbedding
from loomserve.execution.models.arch_config import FULL, SLIDING, ArchConfig, parse_rope
from loomserve.execution.models.llama import Attention, LlamaForCausalLM, LlamaModel


@dataclass(frozen=True)
class Gemma3Config(ArchConfig):
    local_rope_theta: float = 10_000.0  # sliding layers rotate with their own base (no scaling)
    query_pre_attn_scalar: float = 256.0  # scores scaled by its -1/2 power
    final_logit_softcapping: float | None = None  # cap * tanh(logits / cap)

    model_types = ("gemma3_text",)
    activation = "gelu_pytorch_tanh"

    @classmethod
    def model_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        if d.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping is not supported "
                             "(Gemma 2-style score capping)")
        if d.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=True is not supported (decoder only)")
        return {"tie_word_embeddings": bool(d.get("tie_word_embeddings", True)), "qk_norm": True,
                "query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", 256)),
                "final_logit_softcapping": d.get("final_logit_softcapping")}

    @classmethod
    def rope_from_hf(cls, d: dict[str, Any]) -> dict[str, Any]:
        """Full layers use rope_theta (+ scaling), sliding layers rope_local_base_freq.
        transformers 5 writes both under rope_parameters, keyed by layer type."""
        params = d.get("rope_parameters") or {}
        if FULL in params or SLIDING in params:
            theta, scaling = parse_rope(params.get(FULL), d.get("rope_scaling"), None, 1_000_000.0)
            local, local_scaling = parse_rope(params.get(SLIDING), None, None, 10_000.0)
        else:
            theta, scaling = parse_rope(params, d.get("rope_scaling"), d.get("rope_theta"),
                                        1_000_000.0)
            local, local_scaling = float(d.get("rope_local_base_freq", 10_000.0)), None
        if local_scaling is not None:
            raise ValueError("rope scaling on Gemma 3 sliding layers is not supported")
        return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local}

    @classmethod
    def default_layer_types(cls, d: dict[str, Any], num_layers: int,
                            window: int | None) -> list[str]:
        pattern = int(d.get("sliding_window_pattern", 6))  # every pattern-th layer is full
        return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]

# Weights stored as offsets from 1, scaled in fp32 before the cast back.
GemmaRMSNorm = partial(RMSNorm, zero_centered=True, scale_in_fp32=True)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Attention(cfg, norm=GemmaRMSNorm, scale=cfg.query_pre_attn_scalar ** -0.5)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GeluTanhGLU(cfg.hidden_size, cfg.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, rope, meta):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    config_class = Gemma3Config
    tp_plan = LlamaForCausalLM.tp_plan
    supports_dcp = True

    def _build_model(self, cfg: Gemma3Config) -> nn.Module:
        return LlamaModel(cfg, layer=Gemma3DecoderLayer, norm=GemmaRMSNorm)

    def init_rotary(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg, max_positions, device, dtype)
        self.local_rotary = RotaryEmbedding(cfg, max_positions, device, dtype, theta=cfg.local_rope_theta)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta,
                state_batch=None) -> torch.Tensor:
        cfg = self.config
        cos, sin = self.rotary.lookup(positions)
        rope = (cos, sin, self.rotary.half)
        lcos, lsin = self.local_rotary.lookup(positions)
        local = (lcos, lsin, self.local_rotary.half)
        x = self.model.embed_tokens(input_ids) * self.embed_scale
        for i, (layer, meta) in enumerate(zip(self.model.layers, self.layer_metadata(attn_meta))):
            x = layer(x, local if cfg.is_sliding(i) else rope, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
