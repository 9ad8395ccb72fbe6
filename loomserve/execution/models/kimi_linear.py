"""Kimi Linear (KimiLinearForCausalLM): Kimi Delta Attention layers interleaved with NoPE
multi-head latent attention, DeepSeek-style MoE MLPs.

Layer kinds follow config.layer_types, or the checkpoint's 1-based linear_attn_config lists
(full_attn_layers / kda_layers: 3 KDA to 1 MLA in Kimi-Linear-48B-A3B). Checked against
transformers 5.25's kimi_linear:
- KDA (layers/kimi_delta.py): Gated DeltaNet's state plumbing with a per-channel forget gate;
- MLA (layers/mla.py) without RoPE: the qk_rope_head_dim part of the keys is still one shared
  row per token, but nothing rotates it (mla_use_nope), so positions never enter the model and
  the latent cache is DeepSeek-V3's;
- MLP: a dense SwiGLU for the first first_k_dense_replace layers (mlp_layer_types), DeepSeek's
  group-limited sigmoid router with correction bias, renormalized top-k times
  routed_scaling_factor, plus shared experts (layers/moe.py; KimiLinearTopkRouter is the same);
- plain RMSNorms (Llama's), no tied embeddings.

Weights load by their HF names, either the Hub layout (q/k/v_conv1d, f_a/f_b/dt_bias/A_log on
the attention, block_sparse_moe.experts.N.w1/w2/w3) or transformers' runtime one (conv1d,
forget_gate.*, mlp.experts.gate_up_proj/down_proj). Inside loomserve a KDA layer's module is
`linear_attn` (HF names both kinds self_attn); names are normalized first (`hf_name`).

Runner contract: loomserve/execution/models/registry.py. MLA layers read their group's entry
of attn_meta (one MLAAttentionSpec group), KDA layers their group's state_batch.

Tensor parallelism (KimiLinearTP): MLA query heads, kv_b_proj rows and o_proj columns split,
the latent path replicated (deepseek_v3.py); KDA heads split with their conv channels, forget
gates and state pages (layers/kimi_delta.py tp_slice); dense and expert MLPs by intermediate
columns. DCP: MLA's latent rows split by token (layers/mla.py), KDA layers replicated per rank,
as Qwen3-Next's Gated DeltaNet. DEP: the routed experts (layers/expert_parallel.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from loomserve.execution.layers.kimi_delta import KimiDeltaAttention, tp_slice
from loomserve.execution.layers.mla import MultiHeadLatentAttention
from loomserve.execution.layers.mlp import SwiGLU
from loomserve.execution.layers.moe import DeepseekMoE
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.models.arch_config import eos_token_ids
from loomserve.execution.models.deepseek_v3 import copy_into, load_mlp_weight
from loomserve.execution.models.loading.weight_layout import lm_head_logits
from loomserve.execution.models.qwen3_next import layer_groups, pick
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import TPPlan, bias_once, part, swiglu_weight
from loomserve.kv.spec import KVCacheSpec, LinearStateSpec, MLAAttentionSpec


def _first(d: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` set in d: the Hub's config and transformers' spell fields apart."""
    for n in names:
        if d.get(n) is not None:
            return d[n]
    return default


@dataclass(frozen=True)
class KimiLinearConfig:
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def head_dim(self) -> int:
        """q.k width per MLA head (the FLOP model's head_dim)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "KimiLinearConfig":
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("mla_use_nope") is False:
            raise ValueError("Kimi Linear with RoPE in its MLA layers (mla_use_nope: false) is not "
                             "supported (transformers' kimi_linear is NoPE)")
        n = int(d["num_hidden_layers"])
        lin = d.get("linear_attn_config") or {}
        # later Kimi variants' options transformers' kimi_linear does not have: refuse, not ignore
        unknown = [k for k in ("use_full_rank_gate", "gate_lower_bound") if lin.get(k) is not None]
        unknown += [k for k in ("mla_use_output_gate",) if d.get(k)]
        if d.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            unknown.append("moe_router_activation_func")
        if unknown:
            raise ValueError(f"unsupported Kimi Linear options {unknown} (transformers' kimi_linear "
                             f"has none of them)")
        types = d.get("layer_types")
        if types is None and "full_attn_layers" in lin and "kda_layers" in lin:
            full = set(lin["full_attn_layers"])  # 1-based, as the checkpoint writes them
            types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
        if types is None:  # transformers' default
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
        if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
            raise ValueError(f"bad layer_types {types!r} for {n} layers")
        mlp = d.get("mlp_layer_types")
        if mlp is None:
            k = int(_first(d, "first_k_dense_replace", default=1))
            mlp = ["dense" if i < k else "sparse" for i in range(n)]
        experts = int(_first(d, "num_experts", "num_local_experts", "n_routed_experts", default=0))
        if len(mlp) != n or set(mlp) - {"dense", "sparse"} or ("sparse" in mlp and not experts):
            raise ValueError(f"bad mlp_layer_types {mlp!r} for {n} layers and {experts} experts")
        heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=int(d["hidden_size"]), vocab_size=int(d["vocab_size"]),
            layer_types=tuple(types), mlp_layer_types=tuple(mlp), num_heads=heads,
            q_lora_rank=int(d["q_lora_rank"]) if d.get("q_lora_rank") else None,
            kv_lora_rank=int(d["kv_lora_rank"]), qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]), v_head_dim=int(d["v_head_dim"]),
            linear_num_heads=int(_first(lin, "num_heads", default=d.get("linear_num_heads", 32))),
            linear_head_dim=int(_first(lin, "head_dim", default=d.get("linear_head_dim", 128))),
            linear_conv_kernel_dim=int(_first(lin, "short_conv_kernel_size",
                                              default=d.get("linear_conv_kernel_dim", 4))),
            intermediate_size=int(d["intermediate_size"]),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            num_experts=experts,
            num_experts_per_tok=int(_first(d, "num_experts_per_token", "num_experts_per_tok",
                                           default=1)),
            n_group=int(_first(d, "num_expert_group", "n_group", default=1)),
            topk_group=int(_first(d, "topk_group", default=1)),
            n_shared_experts=int(_first(d, "num_shared_experts", "n_shared_experts", default=0)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(_first(d, "moe_renormalize", "norm_topk_prob", default=True)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(d.get("attention_bias", False)),
            max_position_embeddings=int(_first(d, "model_max_length", "max_position_embeddings",
                                               default=4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_token_ids(d),
        )


class KimiLinearTP(TPPlan):
    reduced_blocks = ("self_attn", "linear_attn", "mlp")
    split_kv_heads = False  # MLA: one latent row per token, replicated; KDA: state pages split

    def divisions(self, cfg: KimiLinearConfig) -> dict[str, int]:
        return {"num_heads": cfg.num_heads, "linear_num_heads": cfg.linear_num_heads,
                "intermediate_size": cfg.intermediate_size,
                "moe_intermediate_size": cfg.moe_intermediate_size}

    def shard_weights(self, weights, cfg, tp):
        return super().shard_weights(((hf_name(n, cfg), t) for n, t in weights), cfg, tp)

    def shard_layer(self, rest: str, t: torch.Tensor, cfg: KimiLinearConfig, tp: TPGroup
                    ) -> torch.Tensor:
        if rest.startswith("linear_attn."):
            return tp_slice(rest[len("linear_attn."):], t, tp, cfg.linear_num_heads)
        leaf = rest.split(".")[1] if rest.startswith("self_attn.") else None
        if leaf in ("q_proj", "q_b_proj") or rest == "self_attn.kv_b_proj.weight":
            return part(t, 0, cfg.num_heads, tp)
        if leaf == "o_proj":
            return bias_once(t, tp) if rest.endswith("bias") else part(t, 1, cfg.num_heads, tp)
        if leaf is not None:
            return t  # the latent path, replicated
        return swiglu_weight(rest, t, tp, cfg.intermediate_size, cfg.moe_intermediate_size,
                             cfg.moe_intermediate_size * cfg.n_shared_experts)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: KimiLinearConfig, i: int) -> None:
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == "linear_attention":
            self.linear_attn = KimiDeltaAttention(cfg.hidden_size, cfg.linear_num_heads,
                                                  cfg.linear_head_dim, cfg.linear_conv_kernel_dim,
                                                  cfg.rms_norm_eps)
        else:
            self.self_attn = MultiHeadLatentAttention(
                cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank,
                cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.attention_bias,
                cfg.head_dim ** -0.5)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.mlp_layer_types[i] == "sparse":
            self.mlp = DeepseekMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                   cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                   cfg.norm_topk_prob, cfg.routed_scaling_factor, cfg.n_shared_experts)
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, meta, states):
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h = self.linear_attn(h, states)
        else:
            h = self.self_attn(h, None, meta)  # NoPE
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class KimiLinearModel(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_HUB_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_HUB_W = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_FORGET = ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")


def hf_name(name: str, cfg: KimiLinearConfig) -> str:
    """One checkpoint name in the form the model loads: block_sparse_moe -> mlp, Hub expert
    w1/w2/w3 -> gate/down/up_proj, a KDA layer's self_attn -> linear_attn with its forget-gate
    parameters under forget_gate (transformers' names). Idempotent."""
    m = _LAYER.match(name)
    if not m:
        return name
    i, rest = int(m.group(1)), m.group(2)
    rest = rest.replace("block_sparse_moe.", "mlp.", 1) if rest.startswith("block_sparse_moe.") else rest
    em = _HUB_EXPERT.match(rest)
    if em:
        rest = f"mlp.experts.{em.group(1)}.{_HUB_W[em.group(2)]}.weight"
    if i < cfg.num_layers and cfg.layer_types[i] == "linear_attention" and rest.startswith("self_attn."):
        leaf = rest[len("self_attn."):]
        rest = "linear_attn." + ("forget_gate." + leaf if leaf in _FORGET else leaf)
    return f"model.layers.{i}.{rest}"


class KimiLinearForCausalLM(nn.Module):
    config_class = KimiLinearConfig
    tp_plan = KimiLinearTP()
    supports_dcp = True  # MLA's latent rows split by token; KDA layers replicated per rank
    supports_tp_dcp = True  # TP x DCP: MLA as DeepSeek-V3 (layers/mla.py), KDA heads split by TP

    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = KimiLinearModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.groups: list[int | None] | None = None
        self.tp = None  # the TPGroup when this is one rank's slice (parallel/tensor_parallel.py)

    # --- runner contract --------------------------------------------------------------------------

    def init_rotary(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        """Nothing to build: no layer of Kimi Linear uses positions (NoPE MLA, KDA)."""

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """MLA layers: one latent row per token (DeepSeek-V3's spec); KDA layers: fp32 state."""
        mla = MLAAttentionSpec.for_latent(block_size, self.config.latent_dim, dtype)
        return [LinearStateSpec(block_size, state_shapes=layer.linear_attn.state_shapes(),
                                dtype=torch.float32)
                if layer.kind == "linear_attention" else mla for layer in self.model.layers]

    def kv_cache_modules(self) -> list[nn.Module]:
        return [layer.linear_attn if layer.kind == "linear_attention" else layer.self_attn
                for layer in self.model.layers]

    def set_layer_groups(self, groups: list[int | None]) -> None:
        self.groups = list(groups)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: Any,
                state_batch: Any) -> torch.Tensor:
        """Flattened tokens in, final hidden states out ([tokens, hidden]); positions unused."""
        if self.groups is None:
            self.groups = layer_groups(self.kv_cache_specs(1, torch.float32))
        x = self.model.embed_tokens(input_ids)
        for layer, g in zip(self.model.layers, self.groups):
            x = layer(x, pick(attn_meta, g), pick(state_batch, g))
        return self.model.norm(x)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head_logits(self, hidden, self.lm_head, self.model.embed_tokens)

    # --- HF weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (either layout, per-expert or stacked experts); every
        parameter must be covered exactly once, each fused or stacked slice by its own shard."""
        c = self.config
        expected: set[str] = set()
        for name, _ in self.named_parameters():
            if name.endswith("gate_up_proj.weight"):
                expected |= {name + "#0", name + "#1"}
            elif ".linear_attn." not in name and not name.endswith(("mlp.experts_gate_up",
                                                                     "mlp.experts_down")):
                expected.add(name)
        for i, layer in enumerate(self.model.layers):
            pre = f"model.layers.{i}."
            if layer.kind == "linear_attention":
                expected |= {pre + "linear_attn." + k for k in layer.linear_attn.hf_param_keys()}
            if isinstance(layer.mlp, DeepseekMoE):
                expected |= {pre + "mlp." + k for k in layer.mlp.expected_keys()}
        params = dict(self.named_parameters())
        seen: list[str] = []
        for name, t in weights:
            if name.endswith("weight_scale_inv"):
                raise ValueError(f"{name}: FP8 block-scaled weights are not supported; dequantize first")
            m = _LAYER.match(name)
            if (m and int(m.group(1)) >= c.num_layers) or (name == "lm_head.weight" and self.lm_head is None):
                continue  # layers past the model's own (MTP); a tied head's copy
            seen.extend(self._load_one(hf_name(name, c), t, params))
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
        if rest.startswith("linear_attn."):
            return self._load_kda(layer.linear_attn, pre, rest[len("linear_attn."):], t)
        keys = load_mlp_weight(layer, pre, rest, name, t)
        return keys if keys is not None else [copy_into(params, name, t)]

    @staticmethod
    def _load_kda(kda: KimiDeltaAttention, pre: str, rest: str, t: torch.Tensor) -> list[str]:
        key = kda.load_hf(rest, t)
        if key == "conv_weight":  # transformers' stacked conv covers all three
            return [f"{pre}linear_attn.conv_weight#{x}" for x in "qkv"]
        return [pre + "linear_attn." + key]

