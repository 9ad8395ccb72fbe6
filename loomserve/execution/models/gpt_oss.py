"""gpt-oss (GptOssForCausalLM) over the paged KV cache: sliding and full layers alternate.

What differs from the Llama family, as transformers' modeling_gpt_oss does it:
- attention has sinks (a learned logit per head in every softmax denominator) and biases on
  q/k/v and o; RoPE is YaRN-scaled (cos and sin carry its attention factor);
- the MLP is a mixture of experts: a biased linear router, top-k experts per token weighted by
  the softmax of their k logits; each expert is a clamped SwiGLU with biases whose fused
  gate_up columns interleave gate and up, computing (up + 1) * gate * sigmoid(alpha * gate).

The experts run as a dense loop over the experts the step routes to (CPU-friendly, no grouped
GEMM). Checkpoints are read unquantized: the released MXFP4 expert weights need dequantizing
first (not done here).

Tensor parallelism (GptOssTP): attention heads and their sinks split like Llama's; every expert's
intermediate columns split (experts replicated, each expert's MLP split); attention and MoE
outputs all-reduced by hooks (o_proj's and the experts' down biases kept on rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loomserve.execution.layers.expert_parallel import ExpertParallel
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.models.arch_config import FULL, SLIDING, ArchConfig
from loomserve.execution.models.llama import Attention, LlamaForCausalLM, LlamaModel
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import TPPlan, attention_weight, bias_once, part


@dataclass(frozen=True)
class GptOssConfig(ArchConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    model_types = ("gpt_oss",)

    @classmethod
    def model_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        return {"attention_bias": bool(d.get("attention_bias", True)),  # q/k/v and o
                "num_experts": int(d.get("num_local_experts", 0)),
                "num_experts_per_tok": int(d.get("num_experts_per_tok", 0)),
                "swiglu_alpha": float(d.get("swiglu_alpha", 1.702)),
                "swiglu_limit": float(d.get("swiglu_limit", 7.0))}

    @classmethod
    def default_layer_types(cls, d: dict[str, Any], num_layers: int,
                            window: int | None) -> list[str]:
        return [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]


class GptOssTP(TPPlan):
    reduced_blocks = ("self_attn", "mlp")

    def divisions(self, cfg: GptOssConfig) -> dict[str, int]:
        return {"num_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size}

    def shard_layer(self, rest: str, t: torch.Tensor, cfg: GptOssConfig, tp: TPGroup
                    ) -> torch.Tensor:
        a = attention_weight(rest, t, cfg, tp)
        if a is not None:
            return a
        i = cfg.intermediate_size
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
            # columns interleave gate and up (g0 u0 g1 u1 ...): a contiguous slice keeps the pairs
            return part(t, t.dim() - 1, i, tp)
        if rest == "mlp.experts.down_proj":  # [experts, inter, hidden]
            return part(t, 1, i, tp)
        if rest == "mlp.experts.down_proj_bias":
            return bias_once(t, tp)
        return t  # norms, router


class Experts(nn.Module):
    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.addmm(self.gate_up_proj_bias[e], x, self.gate_up_proj[e])
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
        return torch.addmm(self.down_proj_bias[e], (up + 1) * gate * torch.sigmoid(gate * self.alpha),
                           self.down_proj[e])


class MoE(ExpertParallel, nn.Module):
    """Softmax-over-top-k routing; the experts run locally or sharded over DP ranks
    (layers/expert_parallel.py)."""

    expert_params = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj",
                     "experts.down_proj_bias")

    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = Experts(cfg)
        self.top_k = cfg.num_experts_per_tok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, idx = torch.topk(self.router(x), self.top_k, dim=-1)
        return self.run_experts(x, torch.softmax(top, dim=-1), idx)

    @property
    def routed_width(self) -> int:
        return self.experts.down_proj.shape[2]

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return self.experts.run(e, rows)


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, o_bias=cfg.attention_bias, sinks=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg)

    def forward(self, x, rope, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(LlamaForCausalLM):
    config_class = GptOssConfig
    tp_plan = GptOssTP()
    supports_dcp = True

    def _build_model(self, cfg: GptOssConfig) -> nn.Module:
        if cfg.num_experts < 1 or not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"gpt-oss needs 1 <= num_experts_per_tok ({cfg.num_experts_per_tok}) "
                             f"<= num_local_experts ({cfg.num_experts})")
        return LlamaModel(cfg, layer=GptOssDecoderLayer)
