"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B and
480B-A35B) over the paged KV cache.

As transformers' modeling_qwen3_moe does it:
- attention is Qwen3's (llama.py's Attention): GQA, q and k RMSNormed per head before RoPE, a
  bias on q/k/v and o only with attention_bias;
- the MLP of layer i is a sparse MoE unless i is in mlp_only_layers, (i + 1) is off the
  decoder_sparse_step grid or num_experts is 0 (then a dense SwiGLU of intermediate_size): a
  bias-free linear router, softmax over all experts in fp32, the top num_experts_per_tok
  probabilities (renormalized to sum 1 with norm_topk_prob) weight SwiGLU experts of
  moe_intermediate_size; no shared expert;
- with use_sliding_window every layer slides over sliding_window keys (HF's one mask).

Experts are stacked as transformers 5 stores them, `mlp.experts.gate_up_proj` [experts, 2 * inter,
hidden] (gate; up) and `mlp.experts.down_proj` [experts, hidden, inter], and run as grouped
products (layers/grouped_experts.py; the per-expert loop where they do not apply). load_weights
takes both checkpoint layouts: the Hub's per-expert `mlp.experts.{e}.gate_proj.weight` (up_proj,
down_proj) and the stacked one.

Tensor parallelism (Qwen3MoeTP): attention heads split like Llama's; the dense MLPs and every
expert split by intermediate columns (experts replicated, each one's MLP split); the attention
and MLP outputs all-reduced by hooks. Expert parallelism (DEP): the ExpertParallel mixin.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers.expert_parallel import ExpertParallel
from loomserve.execution.layers.fused import silu_and_mul
from loomserve.execution.layers.mlp import SwiGLU
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.models.arch_config import FULL, SLIDING, ArchConfig
from loomserve.execution.models.llama import (
    Attention,
    HookedDecoderLayer,
    LlamaForCausalLM,
    load_fused,
)
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import TPPlan, attention_weight, swiglu_weight


@dataclass(frozen=True)
class Qwen3MoeConfig(ArchConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    model_types = ("qwen3_moe",)

    def is_moe(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def model_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        experts = int(d.get("num_experts", d.get("num_local_experts", 0)) or 0)
        top_k = int(d.get("num_experts_per_tok", 0) or 0)
        inter = int(d.get("moe_intermediate_size", 0) or 0)
        step = int(d.get("decoder_sparse_step", 1) or 1)
        if experts and not (1 <= top_k <= experts and inter > 0):
            raise ValueError(f"qwen3_moe needs 1 <= num_experts_per_tok ({top_k}) <= num_experts "
                             f"({experts}) and moe_intermediate_size > 0 ({inter})")
        if step < 1:
            raise ValueError(f"decoder_sparse_step={step} must be positive")
        return {"qk_norm": True, "num_experts": experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": inter, "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
                "decoder_sparse_step": step,
                "mlp_only_layers": tuple(int(i) for i in d.get("mlp_only_layers") or ())}

    @classmethod
    def default_layer_types(cls, d: dict[str, Any], num_layers: int,
                            window: int | None) -> list[str]:
        # HF's Qwen3MoeConfig drops the window unless use_sliding_window (default False); with it
        # one sliding mask serves every layer (no max_window_layers here).
        slides = window is not None and bool(d.get("use_sliding_window", False))
        return [SLIDING if slides else FULL] * num_layers


class Qwen3MoeTP(TPPlan):
    """Heads split; dense MLPs and every expert by intermediate columns; block outputs summed by
    all-reduce hooks (the MoE layers have no down_proj to make row-parallel)."""

    reduced_blocks = ("self_attn", "mlp")

    def divisions(self, cfg: Qwen3MoeConfig) -> dict[str, int]:
        moe = [cfg.is_moe(i) for i in range(cfg.num_layers)]
        out = {"num_heads": cfg.num_heads}
        if not all(moe):
            out["intermediate_size"] = cfg.intermediate_size
        if any(moe):
            out["moe_intermediate_size"] = cfg.moe_intermediate_size
        return out

    def shard_layer(self, rest: str, t: torch.Tensor, cfg: Qwen3MoeConfig, tp: TPGroup
                    ) -> torch.Tensor:
        a = attention_weight(rest, t, cfg, tp)
        if a is not None:
            return a
        return swiglu_weight(rest, t, tp, cfg.intermediate_size, cfg.moe_intermediate_size)


class Experts(nn.Module):
    """SwiGLU experts stacked as transformers 5 keeps them (its parameter names and shapes)."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.inter = i


class SparseMoE(ExpertParallel, nn.Module):
    """Softmax router over every expert, top-k (renormalized with norm_topk_prob); the experts run
    locally or sharded over DP ranks (layers/expert_parallel.py)."""

    expert_params = ("experts.gate_up_proj", "experts.down_proj")
    expert_act = "swiglu"  # grouped products (layers/grouped_experts.py)

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, ids = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return self.run_experts(x, weights.to(logits.dtype), ids)

    @property
    def routed_width(self) -> int:
        return self.experts.down_proj.shape[1]

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        ex = self.experts
        return F.linear(silu_and_mul(F.linear(rows, ex.gate_up_proj[e]), ex.inter), ex.down_proj[e])


class Qwen3MoeDecoderLayer(HookedDecoderLayer):
    def __init__(self, cfg: Qwen3MoeConfig, i: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, o_bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.is_moe(i) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# The Hub's per-expert tensors and transformers 5's stacked ones.
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_STACKS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")  # filled by load_weights


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    config_class = Qwen3MoeConfig
    tp_plan = Qwen3MoeTP()

    def _build_model(self, cfg: Qwen3MoeConfig) -> nn.Module:
        return Qwen3MoeModel(cfg)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors in, experts per expert or stacked; every parameter covered once."""
        experts = {n: m for n, m in self.named_modules() if isinstance(m, Experts)}
        seen: Counter[str] = Counter()

        def rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                m = _PER_EXPERT.match(name)
                if m and m.group(1) in experts:
                    ex, e, proj = experts[m.group(1)], int(m.group(2)), m.group(3)
                    if proj == "down_proj":
                        dst, key = ex.down_proj.data[e], f"{m.group(1)}.down_proj#{e}"
                    else:
                        j = 0 if proj == "gate_proj" else 1
                        dst = ex.gate_up_proj.data[e].narrow(0, j * ex.inter, ex.inter)
                        key = f"{m.group(1)}.gate_up_proj#{e}.{j}"
                    _copy(dst, t, name)
                    seen[key] += 1
                    continue
                m = _STACKED.match(name)
                if m and m.group(1) in experts:
                    ex, proj = experts[m.group(1)], m.group(2)
                    _copy(getattr(ex, proj).data, t, name)
                    seen.update(_keys(m.group(1), proj, ex.gate_up_proj.shape[0]))
                    continue
                yield name, t

        load_fused(self, rest(), self.config, skip=_STACKS)
        expected = {k for n, ex in experts.items() for p in ("gate_up_proj", "down_proj")
                    for k in _keys(n, p, ex.gate_up_proj.shape[0])}
        dup = sorted(k for k, c in seen.items() if c > 1)
        missing = sorted(expected - set(seen))
        if dup or missing:
            raise ValueError(f"checkpoint experts: missing {missing[:5]}, duplicated {dup[:5]}")


def _keys(prefix: str, proj: str, experts: int) -> list[str]:
    if proj == "down_proj":
        return [f"{prefix}.down_proj#{e}" for e in range(experts)]
    return [f"{prefix}.gate_up_proj#{e}.{j}" for e in range(experts) for j in (0, 1)]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)
