"""MiniMax-M2 (MiniMaxM2ForCausalLM: MiniMax-M2, M2.1, M2.5) over the paged KV cache.

As transformers' modeling_minimax_m2 does it:
- attention: GQA without biases; q and k each RMSNormed over all their heads at once (one norm
  of num_heads * head_dim, one of num_kv_heads * head_dim: the checkpoints' qk_norm_type
  "per_layer"), then RoPE on the first rotary_dim of each head only (the rest passes
  unrotated), half-split pairs as Llama's;
- every layer's MLP is a sparse MoE: sigmoid router scores, the choice biased by
  e_score_correction_bias, the top num_experts_per_tok renormalized to sum 1, over SwiGLU
  experts of intermediate_size; no shared expert. That is DeepSeek-V3's routing with one group
  and no scaling, so the block is layers/moe.py's DeepseekMoE (fp32 router, as vLLM keeps it).

Checkpoints load by their HF names: the Hub's `block_sparse_moe.gate.weight`,
`block_sparse_moe.e_score_correction_bias` and per-expert `block_sparse_moe.experts.{e}.w1`
(gate) / `w3` (up) / `w2` (down), or transformers 5's `mlp.gate.weight`,
`mlp.e_score_correction_bias` and stacked `mlp.experts.gate_up_proj` / `down_proj`; the MTP
modules past num_hidden_layers are skipped.

Tensor parallelism (MiniMaxM2TP): heads split like Llama's (q_norm / k_norm weights with their
heads), every expert by intermediate columns; the attention and MoE outputs all-reduced by
hooks. The q/k norms span every head, so under TP each rank's mean square is all-reduced (one
collective for q and k together) before it normalizes its own heads, as vLLM's
MiniMaxText01RMSNormTP does. Expert parallelism (DEP): DeepseekMoE's ExpertParallel mixin.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from loomserve.execution.layers.attention import AttentionMetadata, paged_attention
from loomserve.execution.layers.moe import DeepseekMoE
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.layers.rotary import RotaryEmbedding
from loomserve.execution.models.arch_config import FULL, ArchConfig
from loomserve.execution.models.glm4_moe import partial_rope
from loomserve.execution.models.llama import (
    Attention,
    HookedDecoderLayer,
    LlamaForCausalLM,
    load_fused,
)
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import (
    TPPlan,
    attention_weight,
    part,
    swiglu_weight,
)


@dataclass(frozen=True)
class MiniMaxM2Config(ArchConfig):
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    rotary_dim: int = 0

    model_types = ("minimax_m2",)

    @classmethod
    def model_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        experts = int(d.get("num_local_experts", d.get("num_experts", 0)) or 0)
        top_k = int(d.get("num_experts_per_tok", 0) or 0)
        if not 1 <= top_k <= experts:
            raise ValueError(f"minimax_m2 needs 1 <= num_experts_per_tok ({top_k}) <= "
                             f"num_local_experts ({experts})")
        if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("use_routing_bias") is False:
            raise ValueError("minimax_m2: only sigmoid routing with e_score_correction_bias "
                             "(scoring_func sigmoid, use_routing_bias) is supported")
        if int(d.get("shared_intermediate_size") or 0) or int(d.get("n_shared_experts") or 0):
            raise ValueError("minimax_m2 with shared experts is not supported")
        if d.get("use_qk_norm") is False or d.get("qk_norm_type", "per_layer") != "per_layer":
            raise ValueError("minimax_m2: only q/k norms over all heads (use_qk_norm, "
                             "qk_norm_type per_layer) are supported")
        if any(int(t) != 1 for t in d.get("attn_type_list") or ()):
            raise ValueError("minimax_m2: lightning (linear) attention layers (attn_type_list "
                             "0) are not supported")
        if d.get("attention_bias"):
            raise ValueError("minimax_m2 with attention_bias is not supported")
        head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
        rope = d.get("rope_parameters") or {}
        if d.get("rotary_dim") is not None:
            rotary = int(d["rotary_dim"])
        else:
            rotary = int(head_dim * float(rope.get("partial_rotary_factor",
                                                   d.get("partial_rotary_factor", 1.0))))
        if not 0 < rotary <= head_dim or rotary % 2:
            raise ValueError(f"rotary_dim={rotary} must be even, positive and at most "
                             f"head_dim {head_dim}")
        return {"num_local_experts": experts, "num_experts_per_tok": top_k, "rotary_dim": rotary}

    @classmethod
    def default_layer_types(cls, d: dict[str, Any], num_layers: int,
                            window: int | None) -> list[str]:
        return [FULL] * num_layers  # transformers' MiniMax-M2 masks causally only


class MiniMaxM2TP(TPPlan):
    """Heads split (the q/k norm weights with them); every expert by intermediate columns; block
    outputs summed by all-reduce hooks; the attentions learn the group for their norms."""

    reduced_blocks = ("self_attn", "mlp")

    def divisions(self, cfg: MiniMaxM2Config) -> dict[str, int]:
        return {"num_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size}

    def parallelize(self, model: nn.Module, cfg: MiniMaxM2Config, tp: TPGroup) -> None:
        super().parallelize(model, cfg, tp)
        for layer in model.model.layers:
            layer.self_attn.tp = tp

    def shard_layer(self, rest: str, t: torch.Tensor, cfg: MiniMaxM2Config, tp: TPGroup
                    ) -> torch.Tensor:
        if rest == "self_attn.q_norm.weight":
            return part(t, 0, cfg.num_heads, tp)
        if rest == "self_attn.k_norm.weight":  # by KV head, as k_proj's rows
            return attention_weight("self_attn.k_proj.weight", t, cfg, tp)
        a = attention_weight(rest, t, cfg, tp)
        if a is not None:
            return a
        return swiglu_weight(_transformers_name(rest), t, tp, cfg.intermediate_size,
                             cfg.intermediate_size)


_HUB_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_HUB_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def _transformers_name(rest: str) -> str:
    """A layer tensor's Hub name (block_sparse_moe, w1/w3/w2) as transformers 5 and
    swiglu_weight spell it (mlp, gate_proj/up_proj/down_proj)."""
    m = _HUB_EXPERT.match(rest)
    if m:
        return f"mlp.experts.{m.group(1)}.{_HUB_PROJ[m.group(2)]}.weight"
    if rest.startswith("block_sparse_moe."):
        return "mlp." + rest[len("block_sparse_moe."):]
    return rest


class MiniMaxM2Attention(Attention):
    """Llama's attention with q and k RMSNormed over all their heads, and partial RoPE."""

    def __init__(self, cfg: MiniMaxM2Config) -> None:
        super().__init__(cfg)  # cfg.qk_norm is False: no per-head norms
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)
        self.rotary_dim = cfg.rotary_dim
        self.tp: TPGroup | None = None  # set by MiniMaxM2TP: the norms span every rank's heads

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, int],
                meta: AttentionMetadata) -> torch.Tensor:
        n, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._norms(q, k)
        q = partial_rope(q.view(n, h, d), rope, self.rotary_dim)
        k = partial_rope(k.view(n, kvh, d), rope, self.rotary_dim)
        o = paged_attention(q, k, v.reshape(n, kvh, d), self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(o.reshape(n, self.q_size))

    def _norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tp is None:
            return self.q_norm(q), self.k_norm(k)
        # Each rank holds equal shares of the heads (or one KV head, replicated equally often):
        # the mean of the ranks' mean squares is the mean square over all heads.
        q32, k32 = q.float(), k.float()
        ms = torch.cat([q32.pow(2).mean(-1, keepdim=True), k32.pow(2).mean(-1, keepdim=True)], -1)
        ms = self.tp.all_reduce(ms) / self.tp.size
        out = []
        for h, norm, m in ((q32, self.q_norm, ms[:, :1]), (k32, self.k_norm, ms[:, 1:])):
            out.append(norm.weight * (h * torch.rsqrt(m + norm.eps)).to(q.dtype))
        return out[0], out[1]


class MiniMaxM2DecoderLayer(HookedDecoderLayer):
    def __init__(self, cfg: MiniMaxM2Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MiniMaxM2Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts,
                               cfg.num_experts_per_tok, 1, 1, True, 1.0, 0)


class MiniMaxM2Model(nn.Module):
    def __init__(self, cfg: MiniMaxM2Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MiniMaxM2DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class MiniMaxM2ForCausalLM(LlamaForCausalLM):
    config_class = MiniMaxM2Config
    tp_plan = MiniMaxM2TP()

    def _build_model(self, cfg: MiniMaxM2Config) -> nn.Module:
        return MiniMaxM2Model(cfg)

    def init_rotary(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        c = self.config
        partial = SimpleNamespace(head_dim=c.rotary_dim, rope_theta=c.rope_theta,
                                  rope_scaling=c.rope_scaling)
        self.rotary = RotaryEmbedding(partial, max_positions, device, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors in (the Hub's or transformers 5's names, experts per expert or
        stacked); MTP modules skipped; every parameter covered once."""
        layers = self.model.layers
        seen: Counter[str] = Counter()

        def rest() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                m = _LAYER.match(name)
                if m is None:
                    yield name, t
                    continue
                i, sub = int(m.group(1)), _transformers_name(m.group(2))
                if i >= len(layers):
                    continue  # the MTP modules (num_mtp_modules) past the model's own layers
                pre, moe = f"model.layers.{i}.mlp.", layers[i].mlp
                em = _EXPERT.match(sub)
                if em:
                    seen[pre + moe.load_expert(int(em.group(1)), em.group(2), t)] += 1
                elif sub in _STACKED:
                    up = sub.endswith("gate_up_proj")
                    _copy(moe.experts_gate_up.data if up else moe.experts_down.data, t, name)
                    seen.update(pre + k for k in moe.expected_keys()
                                if k.startswith("experts_gate_up" if up else "experts_down"))
                elif sub == "mlp.e_score_correction_bias":
                    yield f"{pre}gate.e_score_correction_bias", t
                else:
                    yield f"model.layers.{i}.{sub}", t

        load_fused(self, rest(), self.config, skip=(".experts_gate_up", ".experts_down"))
        expected = {f"model.layers.{i}.mlp.{k}" for i, layer in enumerate(layers)
                    for k in layer.mlp.expected_keys()}
        dup = sorted(k for k, c in seen.items() if c > 1)
        missing = sorted(expected - set(seen))
        if dup or missing:
            raise ValueError(f"checkpoint experts: missing {missing[:5]}, duplicated {dup[:5]}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)
