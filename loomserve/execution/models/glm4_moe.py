"""GLM-4.5 MoE (Glm4MoeForCausalLM: GLM-4.5, GLM-4.5-Air, GLM-4.6) over the paged KV cache.

As transformers' modeling_glm4_moe does it:
- attention: GQA with a bias on q/k/v only (attention_bias; o_proj has none), q and k RMSNormed
  per head before RoPE with use_qk_norm, and RoPE on the first partial_rotary_factor of each
  head only (0.5 by default: the rest of the head passes unrotated), half-split pairs as Llama's;
- the MLP of layer i is a dense SwiGLU of intermediate_size for i < first_k_dense_replace, then
  DeepSeek-V3's MoE (layers/moe.py): sigmoid router scores, the choice biased by
  e_score_correction_bias, group-limited (n_group / topk_group), top num_experts_per_tok
  renormalized with norm_topk_prob, times routed_scaling_factor, over SwiGLU experts of
  moe_intermediate_size, plus n_shared_experts always-on shared experts (one wide SwiGLU).

Checkpoints load by their HF names: the Hub's per-expert `mlp.experts.{e}.gate_proj.weight`
(up_proj, down_proj) or transformers 5's stacked `mlp.experts.gate_up_proj` / `down_proj`; the
MTP layers past num_hidden_layers (num_nextn_predict_layers) are skipped here; glm4_moe_mtp.py
loads them for `"method": "mtp"` drafts (each then adds one full-attention layer to the KV specs,
and forward keeps its output, the final hidden states after the norm, in `last_hidden`).

Tensor parallelism (Glm4MoeTP): heads split like Llama's, the dense MLPs, every routed expert
and the shared experts by intermediate columns; attention and MLP outputs all-reduced by hooks.
Expert parallelism (DEP): DeepseekMoE's ExpertParallel mixin.
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
from loomserve.execution.layers.mlp import SwiGLU
from loomserve.execution.layers.moe import DeepseekMoE
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.layers.rotary import RotaryEmbedding, apply_rope
from loomserve.execution.models.arch_config import ArchConfig
from loomserve.execution.models.llama import (
    Attention,
    HookedDecoderLayer,
    LlamaForCausalLM,
    load_fused,
)
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import TPPlan, attention_weight, swiglu_weight
from loomserve.kv.spec import FullAttentionSpec, KVCacheSpec


@dataclass(frozen=True)
class Glm4MoeConfig(ArchConfig):
    partial_rotary_factor: float = 0.5
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1

    model_types = ("glm4_moe",)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe(self, i: int) -> bool:
        return self.n_routed_experts > 0 and i >= self.first_k_dense_replace

    @classmethod
    def model_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        experts = int(d.get("n_routed_experts", d.get("num_local_experts", 0)) or 0)
        top_k = int(d.get("num_experts_per_tok", 0) or 0)
        inter = int(d.get("moe_intermediate_size", 0) or 0)
        n_group, topk_group = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
        if experts and not (1 <= top_k <= experts and inter > 0):
            raise ValueError(f"glm4_moe needs 1 <= num_experts_per_tok ({top_k}) <= "
                             f"n_routed_experts ({experts}) and moe_intermediate_size > 0 ({inter})")
        if experts and (experts % n_group or not 1 <= topk_group <= n_group
                        or top_k > experts // n_group * topk_group):
            raise ValueError(f"glm4_moe routing needs n_routed_experts ({experts}) divisible by "
                             f"n_group ({n_group}) and num_experts_per_tok ({top_k}) <= the "
                             f"experts of topk_group ({topk_group}) groups")
        rope = d.get("rope_parameters") or {}
        partial = float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5)))
        head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
        rotary = int(head_dim * partial)
        if not 0 < rotary <= head_dim or rotary % 2:
            raise ValueError(f"partial_rotary_factor={partial} gives {rotary} rotated dims of "
                             f"head_dim {head_dim}: must be even and positive")
        return {"qk_norm": bool(d.get("use_qk_norm", False)), "partial_rotary_factor": partial,
                "n_routed_experts": experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": inter,
                "n_shared_experts": int(d.get("n_shared_experts", 1) or 0),
                "n_group": n_group, "topk_group": topk_group,
                "norm_topk_prob": bool(d.get("norm_topk_prob", True)),
                "routed_scaling_factor": float(d.get("routed_scaling_factor", 1.0)),
                "first_k_dense_replace": int(d.get("first_k_dense_replace", 1) or 0)}


class Glm4MoeTP(TPPlan):
    """Heads split; dense MLPs, routed and shared experts by intermediate columns; block outputs
    summed by all-reduce hooks."""

    reduced_blocks = ("self_attn", "mlp")

    def divisions(self, cfg: Glm4MoeConfig) -> dict[str, int]:
        moe = [cfg.is_moe(i) for i in range(cfg.num_layers)]
        out = {"num_heads": cfg.num_heads}
        if not all(moe):
            out["intermediate_size"] = cfg.intermediate_size
        if any(moe):
            out["moe_intermediate_size"] = cfg.moe_intermediate_size
        return out

    def shard_layer(self, rest: str, t: torch.Tensor, cfg: Glm4MoeConfig, tp: TPGroup
                    ) -> torch.Tensor:
        a = attention_weight(rest, t, cfg, tp)
        if a is not None:
            return a
        return swiglu_weight(rest, t, tp, cfg.intermediate_size, cfg.moe_intermediate_size,
                             cfg.moe_intermediate_size * cfg.n_shared_experts)


class PartialRopeAttention(Attention):
    """Llama's attention with RoPE on the first `rotary_dim` of each q and k head only."""

    def __init__(self, cfg: Glm4MoeConfig, rotary_dim: int) -> None:
        super().__init__(cfg)
        self.rotary_dim = rotary_dim

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, int],
                meta: AttentionMetadata) -> torch.Tensor:
        n, h, kvh = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, h + 2 * kvh, self.head_dim)
        q, k, v = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (partial_rope(t, rope, self.rotary_dim) for t in (q, k))
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return self.o_proj(o.reshape(n, self.q_size))


def partial_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, int], r: int
                 ) -> torch.Tensor:
    """x [tokens, heads, head_dim] with its first r dims rotated, the rest as they are."""
    cos, sin, half = rope
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin, half)
    return torch.cat([apply_rope(x[..., :r], cos, sin, half), x[..., r:]], dim=-1)


class Glm4MoeDecoderLayer(HookedDecoderLayer):
    def __init__(self, cfg: Glm4MoeConfig, i: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = PartialRopeAttention(cfg, cfg.rotary_dim)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe(i):
            self.mlp = DeepseekMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts,
                                   cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                   cfg.norm_topk_prob, cfg.routed_scaling_factor,
                                   cfg.n_shared_experts)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)


class Glm4MoeModel(nn.Module):
    def __init__(self, cfg: Glm4MoeConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Glm4MoeDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARED = re.compile(r"^mlp\.shared_experts\.(gate_proj|up_proj)\.weight$")
_STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


class Glm4MoeForCausalLM(LlamaForCausalLM):
    config_class = Glm4MoeConfig
    tp_plan = Glm4MoeTP()

    def __init__(self, cfg: Glm4MoeConfig) -> None:
        super().__init__(cfg)
        # the checkpoint's MTP layers when drafting with them (glm4_moe_mtp.py), else None
        self.mtp = None
        self.last_hidden: torch.Tensor | None = None

    def _build_model(self, cfg: Glm4MoeConfig) -> nn.Module:
        return Glm4MoeModel(cfg)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        specs = super().kv_cache_specs(block_size, dtype)
        if self.mtp is None:
            return specs
        c = self.config  # MTP: one more full-attention layer each, in the model's KV group
        full = FullAttentionSpec(block_size, c.num_kv_heads, c.head_dim, dtype)
        return specs + [full] * len(self.mtp.layers)

    def kv_cache_modules(self) -> list[nn.Module]:
        mtp = [m.self_attn for m in self.mtp.layers] if self.mtp is not None else []
        return super().kv_cache_modules() + mtp

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta,
                state_batch=None) -> torch.Tensor:
        """LlamaForCausalLM's; with MTP layers loaded it also keeps its output (after the
        final norm: the first MTP layer's input, glm4_moe_mtp.py) in `last_hidden`."""
        out = super().forward(input_ids, positions, attn_meta, state_batch)
        if self.mtp is not None:
            self.last_hidden = out
        return out

    def init_rotary(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        c = self.config
        partial = SimpleNamespace(head_dim=c.rotary_dim, rope_theta=c.rope_theta,
                                  rope_scaling=c.rope_scaling)
        self.rotary = RotaryEmbedding(partial, max_positions, device, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors in (load_checkpoint); the MTP layers are skipped."""
        load_checkpoint(self, weights)


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """HF-named tensors into `model` (a module with .config and .model.layers: the model, or
    glm4_moe_mtp's view naming an MTP layer model.layers.0), experts per expert or stacked;
    layers past model.model.layers skipped; every parameter covered once."""
    layers = model.model.layers
    moe = {i: layer.mlp for i, layer in enumerate(layers) if isinstance(layer.mlp, DeepseekMoE)}
    seen: list[str] = []

    def rest() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            m = _LAYER.match(name)
            if m is None:
                yield name, t
                continue
            i, sub = int(m.group(1)), m.group(2)
            if i >= len(layers):
                continue  # the MTP layers (num_nextn_predict_layers) past the model's own
            pre = f"model.layers.{i}.mlp."
            em = _EXPERT.match(sub)
            if em and i in moe:
                seen.append(pre + moe[i].load_expert(int(em.group(1)), em.group(2), t))
            elif sub in _STACKED and i in moe:
                mlp = moe[i]
                up = sub.endswith("gate_up_proj")
                _copy(mlp.experts_gate_up.data if up else mlp.experts_down.data, t, name)
                seen.extend(pre + k for k in mlp.expected_keys()
                            if k.startswith("experts_gate_up" if up else "experts_down"))
            elif _SHARED.match(sub) and i in moe and moe[i].shared_experts is not None:
                shared = moe[i].shared_experts
                j = 0 if _SHARED.match(sub).group(1) == "gate_proj" else 1
                w = shared.gate_up_proj.weight.data
                _copy(w.narrow(0, j * shared.intermediate, shared.intermediate), t, name)
                seen.append(f"{pre}shared_experts.gate_up_proj#{j}")
            else:
                yield name, t

    # the shared experts' gate/up are not intermediate_size wide: rest() fills them
    load_fused(model, rest(), model.config,
               skip=(".experts_gate_up", ".experts_down", ".shared_experts.gate_up_proj.weight"))
    expected = {f"model.layers.{i}.mlp.{k}" for i, mlp in moe.items() for k in mlp.expected_keys()}
    expected |= {f"model.layers.{i}.mlp.shared_experts.gate_up_proj#{j}"
                 for i, mlp in moe.items() if mlp.shared_experts is not None for j in (0, 1)}
    dup = sorted(k for k, c in Counter(seen).items() if c > 1)
    missing = sorted(expected - set(seen))
    if dup or missing:
        raise ValueError(f"checkpoint experts: missing {missing[:5]}, duplicated {dup[:5]}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)
