"""gpt-oss (GptOssForCausalLM) over the paged KV cache: sliding and full layers alternate.

What differs from the Llama family, as transformers' modeling_gpt_oss does it:
- attention has sinks (a learned logit per head in every softmax denominator) and biases on
  q/k/v and o; RoPE is YaRN-scaled (cos and sin carry its attention factor);
- the MLP is a mixture of experts: a biased linear router, top-k experts per token weighted by
  the softmax of their k logits; each expert is a clamped SwiGLU with biases whose fused
  gate_up columns interleave gate and up, computing (up + 1) * gate * sigmoid(alpha * gate).

The experts run as a dense loop over the experts the step routes to (their biases and clamped
SwiGLU are not layers/grouped_experts.py's activations). The released checkpoints' MXFP4
experts (quantization_config quant_method "mxfp4") run in place when the loader sets
`mxfp4_experts` (every --quantization but `none`, which widens them at load):
Mxfp4GptOssExperts (layers/mxfp4.py: the CPU kernel on the 4-bit codes, or unpacked once to the
model dtype on another device).

Tensor parallelism (GptOssTP): attention heads and their sinks split like Llama's; every expert's
intermediate columns split (experts replicated, each expert's MLP split); attention and MoE
outputs all-reduced by hooks (o_proj's and the experts' down biases kept on rank 0). MXFP4
experts split the same way (gate_up by rows, down by whole 32-value blocks), so each rank's
intermediate_size / N must be a multiple of 32 (else `auto` widens them at load; check() refuses
a split model asked to keep them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loomserve.execution.layers.expert_parallel import ExpertParallel
from loomserve.execution.layers.mxfp4 import (
    BLOCK,
    Mxfp4Experts,
    gguf_blocks_to_hf,
    interleave_rows,
)
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
    # The experts' weights as the checkpoint's MXFP4 blocks, run in place (set by the loader for
    # an MXFP4 checkpoint: loading/checkpoint.py mxfp4_in_place), not a config.json field.
    mxfp4_experts: bool = False

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

    def check(self, cfg: GptOssConfig, size: int) -> None:
        super().check(cfg, size)
        if cfg.mxfp4_experts and (cfg.intermediate_size // size) % BLOCK:
            raise ValueError(
                f"MXFP4 experts split by tensor_parallel_size={size} leave "
                f"{cfg.intermediate_size // size} intermediate columns per rank, not whole "
                f"{BLOCK}-value blocks: serve with --quantization none (experts dequantized at "
                f"load) or a size that divides intermediate_size / {BLOCK}")

    def shard_layer(self, rest: str, t: torch.Tensor, cfg: GptOssConfig, tp: TPGroup
                    ) -> torch.Tensor:
        a = attention_weight(rest, t, cfg, tp)
        if a is not None:
            return a
        i = cfg.intermediate_size
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
            # columns interleave gate and up (g0 u0 g1 u1 ...): a contiguous slice keeps the pairs
            return part(t, t.dim() - 1, i, tp)
        if rest in ("mlp.experts.gate_up_proj_blocks", "mlp.experts.gate_up_proj_scales"):
            return part(t, 1, i, tp)  # MXFP4 [experts, 2 * inter rows, hidden / 32, (16)]
        if rest in ("mlp.experts.down_proj_blocks", "mlp.experts.down_proj_scales"):
            return part(t, 2, i, tp)  # MXFP4 [experts, hidden, inter / 32 blocks, (16)]
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
        return torch.addmm(self.down_proj_bias[e], clamped_swiglu(gate_up, self.alpha, self.limit),
                           self.down_proj[e])


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate = gate_up[:, ::2].clamp(max=limit)
    up = gate_up[:, 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


class Mxfp4GptOssExperts(Mxfp4Experts):
    """The experts with MXFP4 weights (layers/mxfp4.py), loaded from the checkpoint's
    `gate_up_proj_blocks` / `_scales` (rows 2I, K = hidden) and `down_proj_*` (rows hidden,
    K = I), packed by GptOssForCausalLM.load_weights."""

    def __init__(self, cfg: GptOssConfig) -> None:
        h, i = cfg.hidden_size, cfg.intermediate_size
        super().__init__(cfg.num_experts, {"gate_up_proj": (2 * i, h), "down_proj": (h, i)})
        self.alpha, self.limit, self.hidden_size = cfg.swiglu_alpha, cfg.swiglu_limit, h

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.project("gate_up_proj", e, x)
        return self.project("down_proj", e, clamped_swiglu(gate_up, self.alpha, self.limit))

    @classmethod
    def from_gguf(cls, cfg: GptOssConfig, dense: Experts, gate, up, down) -> "Mxfp4GptOssExperts":
        """Packed experts from a GGUF file's MXFP4 stacks (type 39; raw uint8 as GGUFReader
        reads them: ffn_gate_exps and ffn_up_exps [E, I, H/32 * 17], ffn_down_exps
        [E, H, I/32 * 17]) and the biases of `dense`, the experts loaded from its conversion.
        llama.cpp split HF's interleaved gate_up rows into gate and up; they are re-interleaved."""
        blocks, scales = {}, {}
        # torch.tensor copies: GGUFReader hands out read-only memory maps
        (gb, gs), (ub, us) = (gguf_blocks_to_hf(torch.tensor(t)) for t in (gate, up))
        blocks["gate_up_proj"], scales["gate_up_proj"] = interleave_rows(gb, ub), interleave_rows(gs, us)
        blocks["down_proj"], scales["down_proj"] = gguf_blocks_to_hf(torch.tensor(down))
        with torch.device(dense.gate_up_proj_bias.device):
            mod = cls(cfg).to(dense.gate_up_proj_bias.dtype)
        for name in mod.shapes:
            getattr(mod, f"{name}_blocks").data.copy_(blocks[name])
            getattr(mod, f"{name}_scales").data.copy_(scales[name])
            getattr(mod, f"{name}_bias").data.copy_(getattr(dense, f"{name}_bias"))
        mod.pack()
        return mod


class MoE(ExpertParallel, nn.Module):
    """Softmax-over-top-k routing; the experts run locally or sharded over DP ranks
    (layers/expert_parallel.py)."""

    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = Mxfp4GptOssExperts(cfg) if cfg.mxfp4_experts else Experts(cfg)
        self.top_k = cfg.num_experts_per_tok

    @property
    def expert_params(self) -> tuple[str, ...]:  # the experts' stacked tensors, as they are now
        if isinstance(self.experts, Mxfp4Experts):
            return tuple(f"experts.{n}" for n in self.experts.stacked_names())
        return ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj",
                "experts.down_proj_bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, idx = torch.topk(self.router(x), self.top_k, dim=-1)
        return self.run_experts(x, torch.softmax(top, dim=-1), idx)

    @property
    def routed_width(self) -> int:
        if isinstance(self.experts, Mxfp4Experts):
            return self.experts.hidden_size
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

    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        for m in self.modules():  # MXFP4 experts: tiled for the CPU kernel, or unpacked, once
            if isinstance(m, Mxfp4Experts):
                m.pack()
