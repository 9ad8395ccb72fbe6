"""DeepSeek-V3 (DeepseekV3ForCausalLM; Kimi K2 and DeepSeek-R1 share it) over a paged latent cache.

Each layer: multi-head latent attention (layers/mla.py), then a dense SwiGLU for the first
`first_k_dense_replace` layers and DeepSeek's MoE after (layers/moe.py). The KV cache is one
MLAAttentionSpec group: a row of kv_lora_rank + qk_rope_head_dim per token per layer, about
(kv_lora_rank + rope) / (2 * heads * head_dim) of the equivalent MHA cache.

Checkpoints load by their HF names; the rope rows of q_b_proj / q_proj and kv_a_proj_with_mqa
are de-interleaved at load when rope_interleave (DeepSeek's layout), the MTP layers past
num_hidden_layers are skipped (deepseek_mtp.py loads them for `"method": "mtp"`), and FP8 block-scaled checkpoints are refused (dequantize first).

Runner contract: loomserve/execution/models/registry.py.

Tensor parallelism (DeepseekV3TP): query heads, kv_b_proj's per-head rows and o_proj's columns
split; the latent path and its cache replicated (every rank stores the same latent rows: page and
block count as one rank's; splitting the cache itself is DCP's job, not TP's: TP x DCP runs in
layers/mla.py); MoE by intermediate columns. Attention and MLP outputs all-reduced by hooks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterable

import torch
from torch import nn

from loomserve.execution.layers.attention import AttentionMetadata
from loomserve.execution.layers.mla import (
    MultiHeadLatentAttention,
    deinterleave_rope_rows,
    yarn_softmax_scale,
)
from loomserve.execution.layers.mlp import SwiGLU
from loomserve.execution.layers.moe import DeepseekMoE
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.layers.rotary import RotaryEmbedding
from loomserve.execution.models.arch_config import eos_token_ids, parse_rope
from loomserve.execution.models.loading.weight_layout import lm_head_logits
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import TPPlan, bias_once, part, swiglu_weight
from loomserve.kv.spec import KVCacheSpec, MLAAttentionSpec


@dataclass(frozen=True)
class DeepseekV3Config:
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def head_dim(self) -> int:
        """q.k width per head (the FLOP model's head_dim; the cache holds no per-head rows)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe(self, i: int) -> bool:
        return (self.n_routed_experts > 0 and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "DeepseekV3Config":
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("topk_method", "noaux_tc") not in ("noaux_tc",) or d.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError("only DeepSeek-V3 routing (sigmoid scores, noaux_tc group-limited top-k) is supported")
        theta, scaling = parse_rope(d.get("rope_parameters"), d.get("rope_scaling"),
                                    d.get("rope_theta"))
        if scaling is not None and scaling["rope_type"] not in ("yarn", "linear"):
            raise ValueError(f"unsupported rope scaling {scaling['rope_type']!r} for deepseek_v3 (yarn, linear)")
        heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=int(d["hidden_size"]), vocab_size=int(d["vocab_size"]),
            num_layers=int(d["num_hidden_layers"]), num_heads=heads,
            q_lora_rank=int(d["q_lora_rank"]) if d.get("q_lora_rank") else None,
            kv_lora_rank=int(d["kv_lora_rank"]), qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]), v_head_dim=int(d["v_head_dim"]),
            intermediate_size=int(d["intermediate_size"]),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
            n_routed_experts=int(d.get("n_routed_experts") or 0),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 1),
            n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(d.get("moe_layer_freq") or 1),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            rope_interleave=bool(d.get("rope_interleave", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_token_ids(d),
        )


class DeepseekV3TP(TPPlan):
    reduced_blocks = ("self_attn", "mlp")
    split_kv_heads = False  # one latent row per token, replicated

    def divisions(self, cfg: DeepseekV3Config) -> dict[str, int]:
        return {"num_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
                "moe_intermediate_size": cfg.moe_intermediate_size}

    def shard_layer(self, rest: str, t: torch.Tensor, cfg: DeepseekV3Config, tp: TPGroup
                    ) -> torch.Tensor:
        """MLA: query heads, kv_b_proj's per-head [k_nope | v] rows and o_proj's columns split;
        the latent path (q_a / kv_a projections and norms) whole. MoE by intermediate columns
        (the shared experts are one MLP n_shared times as wide: its columns split alike)."""
        leaf = rest.split(".")[1] if rest.startswith("self_attn.") else None
        if leaf in ("q_proj", "q_b_proj") or rest == "self_attn.kv_b_proj.weight":
            return part(t, 0, cfg.num_heads, tp)
        if leaf == "o_proj":
            return bias_once(t, tp) if rest.endswith("bias") else part(t, 1, cfg.num_heads, tp)
        if leaf is not None:
            return t
        return swiglu_weight(rest, t, tp, cfg.intermediate_size, cfg.moe_intermediate_size,
                             cfg.moe_intermediate_size * cfg.n_shared_experts)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, i: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(
            cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.attention_bias,
            yarn_softmax_scale(cfg.head_dim, cfg.rope_scaling))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe(i):
            self.mlp = DeepseekMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts,
                                   cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                   cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.n_shared_experts)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SWIGLU = re.compile(r"^(mlp|mlp\.shared_experts)\.(gate_proj|up_proj)\.weight$")


class DeepseekV3ForCausalLM(nn.Module):
    config_class = DeepseekV3Config
    tp_plan = DeepseekV3TP()
    supports_dcp = True  # MLA's partials merge in latent space (layers/mla.py)
    supports_tp_dcp = True  # TP x DCP on the same ranks (layers/mla.py, tp_dcp_attention)

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = DeepseekV3Model(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.groups: list[int | None] | None = None
        self.tp = None  # the TPGroup when this is one rank's slice (parallel/tensor_parallel.py)
        # the checkpoint's MTP modules when drafting with them (deepseek_mtp.py), else None;
        # with them, forward keeps its output (after the final norm) in `last_hidden`
        self.mtp = None
        self.last_hidden: torch.Tensor | None = None

    # --- runner contract --------------------------------------------------------------------------

    def init_rotary(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        c = self.config
        rope = SimpleNamespace(head_dim=c.qk_rope_head_dim, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling)
        self.rotary = RotaryEmbedding(rope, max_positions, device, dtype)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        spec = MLAAttentionSpec.for_latent(block_size, self.config.latent_dim, dtype)
        return [spec] * (self.config.num_layers + self._num_mtp())  # MTP: one more MLA layer each

    def kv_cache_modules(self) -> list[nn.Module]:
        mtp = [m.block.self_attn for m in self.mtp.layers] if self.mtp is not None else []
        return [layer.self_attn for layer in self.model.layers] + mtp

    def _num_mtp(self) -> int:
        return 0 if self.mtp is None else len(self.mtp.layers)

    @staticmethod
    def decoder_layer(cfg: DeepseekV3Config, i: int) -> nn.Module:
        """Layer i as this family builds it (deepseek_mtp.py builds the MTP layers so)."""
        return DecoderLayer(cfg, i)

    def set_layer_groups(self, groups: list[int | None]) -> None:
        self.groups = list(groups)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: Any,
                state_batch: Any = None) -> torch.Tensor:
        """Flattened tokens in, final hidden states out ([tokens, hidden])."""
        cos, sin = self.rotary.lookup(positions)
        rope = (cos, sin, self.rotary.half)
        x = self.model.embed_tokens(input_ids)
        groups = self.groups or [0] * len(self.model.layers)
        for layer, g in zip(self.model.layers, groups):
            meta = attn_meta if isinstance(attn_meta, AttentionMetadata) else attn_meta[g]
            x = layer(x, rope, meta)
        x = self.model.norm(x)
        if self.mtp is not None:  # the first MTP module's h_p, as vLLM and SGLang feed it
            self.last_hidden = x
        return x

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head_logits(self, hidden, self.lm_head, self.model.embed_tokens)

    # --- HF weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (per-expert or stacked expert layouts); every parameter must be
        covered exactly once, each fused or stacked slice by its own shard."""
        params = dict(self.named_parameters())
        expected: set[str] = set()
        for name in params:
            if name.endswith("gate_up_proj.weight"):
                expected |= {name + "#0", name + "#1"}
            elif not name.endswith(("mlp.experts_gate_up", "mlp.experts_down")):
                expected.add(name)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, DeepseekMoE):
                expected |= {f"model.layers.{i}.mlp.{k}" for k in layer.mlp.expected_keys()}
        seen: list[str] = []
        for name, t in weights:
            if name.endswith("weight_scale_inv"):
                raise ValueError(f"{name}: FP8 block-scaled weights are not supported; dequantize first")
            m = _LAYER.match(name)
            if ("rotary_emb.inv_freq" in name or (m and int(m.group(1)) >= self.config.num_layers)
                    or (name == "lm_head.weight" and self.lm_head is None)):
                continue  # derived tables; MTP layers past the model's own; a tied head's copy
            seen.extend(self._load_one(name, t, params))
        dup = {n for n in seen if seen.count(n) > 1}
        missing = expected - set(seen)
        if dup or missing:
            raise ValueError(f"checkpoint mismatch: missing {sorted(missing)[:5]}, duplicated {sorted(dup)[:5]}")

    def _load_one(self, name: str, t: torch.Tensor, params: dict[str, torch.Tensor]) -> list[str]:
        m = _LAYER.match(name)
        if not m:
            return [copy_into(params, name, t)]
        i, rest = int(m.group(1)), m.group(2)
        layer, pre = self.model.layers[i], f"model.layers.{i}."
        t = self.deinterleaved(rest, t)
        keys = load_mlp_weight(layer, pre, rest, name, t)
        return keys if keys is not None else [copy_into(params, name, t)]

    def deinterleaved(self, rest: str, t: torch.Tensor) -> torch.Tensor:
        """Rope rows of the q and kv_a projections from pair-interleaved to [evens | odds] (rest:
        the name inside a layer; the GGUF in-place path applies it to quantized rows too)."""
        c = self.config
        if not c.rope_interleave:
            return t
        if rest in ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight"):
            return deinterleave_rope_rows(t, c.head_dim, c.qk_nope_head_dim, c.qk_rope_head_dim)
        if rest in ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias"):
            return deinterleave_rope_rows(t, c.latent_dim, c.kv_lora_rank, c.qk_rope_head_dim)
        return t


def load_mlp_weight(layer: nn.Module, pre: str, rest: str, name: str,
                    t: torch.Tensor) -> list[str] | None:
    """One HF weight of a DeepSeek-style MLP (the DeepseekMoE's experts per expert or stacked,
    a dense or shared SwiGLU's gate / up) into `layer` (model.layers.i, `pre` its prefix,
    `rest` the name inside it); the keys the loader counts it under, or None when `rest` is
    not such a weight. Shared with the models built on DeepSeek's MLP (Kimi Linear)."""
    em = _EXPERT.match(rest)
    if em:
        return [pre + "mlp." + layer.mlp.load_expert(int(em.group(1)), em.group(2), t)]
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # stacked (transformers 5)
        moe, up = layer.mlp, rest.endswith("gate_up_proj")
        _copy_to((moe.experts_gate_up if up else moe.experts_down).data, t, name)
        return [pre + "mlp." + k for k in sorted(moe.expected_keys())
                if k.startswith("experts_gate_up" if up else "experts_down")]
    sm = _SWIGLU.match(rest)
    if sm:
        mod = layer.get_submodule(sm.group(1))
        j = 0 if sm.group(2) == "gate_proj" else 1
        _copy_to(mod.gate_up_proj.weight.data.narrow(0, j * mod.intermediate, mod.intermediate),
                 t, name)
        return [f"{pre}{sm.group(1)}.gate_up_proj.weight#{j}"]
    return None


def _copy_to(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)


def copy_into(params: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> str:
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    _copy_to(params[name].data, t, name)
    return name
