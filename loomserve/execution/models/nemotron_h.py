"""Nemotron-H: a stack of single-mixer blocks, x + mixer(RMSNorm(x)), whose kinds follow
hybrid_override_pattern ("M" Mamba2, "*" attention, "-" MLP) or layers_block_type.

Checked against transformers: attention has no positional encoding at all (the Mamba2 layers
carry order), the MLP is up -> relu^2 -> down without a gate, RMSNorm multiplies by w in fp32,
and the Mamba2 gated norm applies SiLU(z) before a grouped RMSNorm. Routed-expert blocks ("E",
Nemotron 3): sigmoid router scores plus a correction bias pick top-k experts inside the best
topk_group groups; the chosen (unbiased) scores, renormalized and scaled by
routed_scaling_factor, weight relu^2 experts (optionally in a latent space), plus a shared
relu^2 expert.

Checkpoints name the trunk `backbone.`; it is `model.` here, like every other model, so the
runner finds `model.model.layers`. Forward contract as in qwen3_next.py.

Tensor parallelism (NemotronHTP): Mamba2 heads split with their B/C groups (n_groups divisible
by N; layers/mamba2.py), so conv channels, the grouped gated norm and the SSM state are per rank;
attention heads, the relu^2 MLP and routed / shared experts split like the other models' (the
router replicated). Every mixer's output is all-reduced by a hook.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers.attention import AttentionMetadata, paged_attention
from loomserve.execution.layers.expert_parallel import ExpertParallel
from loomserve.execution.layers.mamba2 import Mamba2Mixer, tp_slice
from loomserve.execution.layers.mlp import ReluSquaredMLP
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.models.arch_config import eos_token_ids
from loomserve.execution.models.loading.weight_layout import lm_head_logits
from loomserve.execution.models.qwen3_next import layer_groups, pick
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import (
    TPPlan,
    attention_weight,
    bias_once,
    part,
)
from loomserve.kv.spec import FullAttentionSpec, KVCacheSpec, LinearStateSpec

_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _dt_limit(raw: Any) -> tuple[float, float]:
    """The config's [low, high] dt clamp; absent or null means mamba_ssm's default [0, inf)."""
    if raw is None:
        return 0.0, float("inf")

    def num(v: Any, absent: float) -> float:  # transformers writes inf as {"__float__": "Infinity"}
        return absent if v is None else float(v["__float__"] if isinstance(v, dict) else v)

    return num(raw[0], 0.0), num(raw[1], float("inf"))


@dataclass(frozen=True)
class NemotronHConfig:
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool = True
    use_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # dt is clamped to this (mamba_ssm's dt_limit); time_step_min/max only seed dt_bias at init.
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    layer_norm_epsilon: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "NemotronHConfig":
        types = d.get("layers_block_type")
        if types is None:
            pattern = d.get("hybrid_override_pattern")
            if pattern is None:
                raise ValueError("nemotron_h config has neither layers_block_type nor hybrid_override_pattern")
            types = [_KINDS[ch] for ch in pattern]
        if set(types) - {"linear_attention", "full_attention", "mlp", "moe"}:
            raise ValueError(f"unknown nemotron_h block types {sorted(set(types))}")
        for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if d.get(key, want) != want:
                raise ValueError(f"unsupported {key} {d[key]!r} (only {want})")
        heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
        return cls(
            hidden_size=hidden, vocab_size=int(d["vocab_size"]), layer_types=tuple(types),
            num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d.get("attention_head_dim") or hidden // heads),
            intermediate_size=int(d["intermediate_size"]),
            mamba_num_heads=int(d["mamba_num_heads"]), mamba_head_dim=int(d["mamba_head_dim"]),
            ssm_state_size=int(d["ssm_state_size"]),
            n_groups=int(d.get("n_groups", d.get("mamba_n_groups", 1))),
            conv_kernel=int(d.get("conv_kernel", d.get("mamba_d_conv", 4))),
            use_conv_bias=bool(d.get("use_conv_bias", d.get("mamba_conv_bias", True))),
            use_bias=bool(d.get("use_bias", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            time_step_limit=_dt_limit(d.get("time_step_limit", d.get("mamba_dt_limit"))),
            n_routed_experts=int(d.get("n_routed_experts", 0)),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 1)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
            moe_shared_expert_intermediate_size=int(d.get("moe_shared_expert_intermediate_size", 0)),
            moe_latent_size=d.get("moe_latent_size"),
            n_group=int(d.get("n_group", 1)), topk_group=int(d.get("topk_group", 1)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            layer_norm_epsilon=float(d.get("layer_norm_epsilon", 1e-5)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_token_ids(d),
        )


_MLP = re.compile(r"^(?:(shared_experts)\.|experts\.\d+\.)?(up_proj|down_proj)\.(weight|bias)$")


class NemotronHTP(TPPlan):
    embedding = "embeddings"
    vocab_weights = ("backbone.embeddings.weight", "model.embeddings.weight", "lm_head.weight")
    reduced_blocks = ("mixer",)

    def divisions(self, cfg: NemotronHConfig) -> dict[str, int]:
        return {"num_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
                "mamba_num_heads": cfg.mamba_num_heads, "n_groups": cfg.n_groups,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "moe_shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size}

    def shard_layer(self, rest: str, t: torch.Tensor, cfg: NemotronHConfig, tp: TPGroup
                    ) -> torch.Tensor:
        """Blocks are `mixer.*` whatever their kind: the kind follows from the tensor's name."""
        a = attention_weight(rest, t, cfg, tp, block="mixer.")
        if a is not None:
            return a
        if not rest.startswith("mixer."):
            return t  # the block's norm
        name = rest[len("mixer."):]
        if name.startswith(("in_proj.", "conv1d.", "norm.")) or name in (
                "dt_bias", "A_log", "D", "out_proj.weight", "out_proj.bias"):
            return tp_slice(name, t, tp, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups,
                            cfg.ssm_state_size)
        m = _MLP.match(name)
        if m:
            if m.group(1):
                total = cfg.moe_shared_expert_intermediate_size
            elif name.startswith("experts."):
                total = cfg.moe_intermediate_size
            else:
                total = cfg.intermediate_size
            if m.group(2) == "up_proj":
                return part(t, 0, total, tp)
            return bias_once(t, tp) if m.group(3) == "bias" else part(t, 1, total, tp)
        if name == "fc2_latent_proj.bias":  # replicated, applied to each rank's partial expert sum
            return bias_once(t, tp)
        return t  # norms, router, latent projections


class Attention(nn.Module):
    """GQA attention without RoPE; q/k/v fused into one matmul."""

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.scale = cfg.head_dim ** -0.5
        self.k_cache: torch.Tensor | None = None  # set by the runner
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        o = paged_attention(q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim),
                            v.view(n, self.num_kv_heads, self.head_dim), self.k_cache, self.v_cache, meta,
                            self.scale)
        return self.o_proj(o.reshape(n, self.q_size))


class Router(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e))
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def _apply(self, fn, recurse=True):
        # Routing stays fp32 in a bf16 model, as in the reference (near-tied scores pick experts).
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k] fp32, expert ids [tokens, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        n = x.shape[0]
        grouped = choice.view(n, self.n_group, -1)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)  # [tokens, groups]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_group, dim=-1)[1], True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(n, -1)
        ids = choice.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, ids)
        if self.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, ids


class MoE(ExpertParallel, nn.Module):
    """Routed relu^2 experts (stacked [experts, out, in]) plus a shared relu^2 expert; the
    routed experts run locally or sharded over DP ranks (layers/expert_parallel.py), summed in
    fp32 as the reference does."""

    expert_params = ("experts_up", "experts_down")
    expert_act = "relu2"  # grouped products (layers/grouped_experts.py)
    acc_fp32 = True

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        dim = cfg.moe_latent_size or cfg.hidden_size
        self.gate = Router(cfg)
        self.experts_up = nn.Parameter(torch.empty(e, inter, dim))
        self.experts_down = nn.Parameter(torch.empty(e, dim, inter))
        self.shared_experts = ReluSquaredMLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias)
        latent = cfg.moe_latent_size is not None
        self.fc1_latent_proj = nn.Linear(cfg.hidden_size, dim, bias=cfg.mlp_bias) if latent else None
        self.fc2_latent_proj = nn.Linear(dim, cfg.hidden_size, bias=cfg.mlp_bias) if latent else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        out = self.run_experts(h, weights, ids).to(x.dtype)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(x)

    @property
    def top_k(self) -> int:
        return self.gate.top_k

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(rows, self.experts_up[e])).square(), self.experts_down[e])


class Block(nn.Module):
    def __init__(self, cfg: NemotronHConfig, i: int) -> None:
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, scale_in_fp32=True)
        if self.kind == "linear_attention":
            self.mixer = Mamba2Mixer(cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size,
                                     cfg.n_groups, cfg.conv_kernel, cfg.layer_norm_epsilon,
                                     use_conv_bias=cfg.use_conv_bias, use_bias=cfg.use_bias,
                                     dt_min=cfg.time_step_limit[0], dt_max=cfg.time_step_limit[1])
        elif self.kind == "full_attention":
            self.mixer = Attention(cfg)
        elif self.kind == "moe":
            self.mixer = MoE(cfg)
        else:
            self.mixer = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, meta, states):
        h = self.norm(x)
        if self.kind == "linear_attention":
            return x + self.mixer(h, states)
        if self.kind == "full_attention":
            return x + self.mixer(h, meta)
        return x + self.mixer(h)


class NemotronHModel(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, scale_in_fp32=True)


class NemotronHForCausalLM(nn.Module):
    config_class = NemotronHConfig
    tp_plan = NemotronHTP()
    supports_dcp = True  # Mamba layers replicated per rank (parallel/context_parallel.py)

    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = NemotronHModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.groups: list[int] | None = None
        self.tp = None  # the TPGroup when this is one rank's slice (parallel/tensor_parallel.py)

    def init_rotary(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        pass  # no positional encoding

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec | None]:
        """One spec per layer; None for MLP and MoE blocks, which keep nothing per token."""
        c, out = self.config, []
        for layer in self.model.layers:
            if layer.kind == "linear_attention":
                out.append(LinearStateSpec(block_size, state_shapes=layer.mixer.state_shapes(), dtype=torch.float32))
            elif layer.kind == "full_attention":
                out.append(FullAttentionSpec(block_size, c.num_kv_heads, c.head_dim, dtype))
            else:
                out.append(None)
        return out

    def set_layer_groups(self, groups: list[int | None]) -> None:
        self.groups = list(groups)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: Any,
                state_batch: Any) -> torch.Tensor:
        if self.groups is None:
            self.groups = layer_groups(self.kv_cache_specs(1, torch.float32))
        x = self.model.embeddings(input_ids)
        for layer, g in zip(self.model.layers, self.groups):
            x = layer(x, pick(attn_meta, g), pick(state_batch, g))
        return self.model.norm_f(x)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head_logits(self, hidden, self.lm_head, self.model.embeddings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (`backbone.` or `model.` trunk) in; every parameter exactly once."""
        params = dict(self.named_parameters())
        expected = {n for n in params if ".mixer.qkv_proj." not in n and ".mixer.experts_" not in n}
        for i, layer in enumerate(self.model.layers):
            if layer.kind == "moe":
                expected |= {f"model.layers.{i}.mixer.{p}#{e}" for p in ("experts_up", "experts_down")
                             for e in range(self.config.n_routed_experts)}
            if layer.kind == "full_attention":
                for kind in ("weight", "bias") if layer.mixer.qkv_proj.bias is not None else ("weight",):
                    expected |= {f"model.layers.{i}.mixer.qkv_proj.{kind}#{p}" for p in "qkv"}
        seen: list[str] = []
        for name, t in weights:
            name = re.sub(r"^backbone\.", "model.", name)
            if name.startswith("mtp.") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            seen.append(self._load_one(name, t, params))
        dup = {n for n in seen if seen.count(n) > 1}
        missing = expected - set(seen)
        if dup or missing:
            raise ValueError(f"checkpoint mismatch: missing {sorted(missing)[:5]}, duplicated {sorted(dup)[:5]}")

    def _load_one(self, name: str, t: torch.Tensor, params: dict[str, torch.Tensor]) -> str:
        m = re.match(r"^model\.layers\.(\d+)\.mixer\.(.*)$", name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            layer, pre = self.model.layers[i], f"model.layers.{i}.mixer."
            if layer.kind == "linear_attention":
                return pre + layer.mixer.load_hf(rest, t)
            em = re.match(r"^experts\.(\d+)\.(up_proj|down_proj)\.weight$", rest)
            if layer.kind == "moe" and em:
                e, target = int(em.group(1)), "experts_up" if em.group(2) == "up_proj" else "experts_down"
                dst = getattr(layer.mixer, target).data[e]
                if dst.shape != t.shape:
                    raise ValueError(f"weight {name!r}: checkpoint shape {tuple(t.shape)} != model {tuple(dst.shape)}")
                dst.copy_(t)
                return f"{pre}{target}#{e}"
            pm = re.match(r"^(q_proj|k_proj|v_proj)\.(weight|bias)$", rest)
            if layer.kind == "full_attention" and pm:
                a, proj, kind = layer.mixer, pm.group(1), pm.group(2)
                off, size = {"q_proj": (0, a.q_size), "k_proj": (a.q_size, a.kv_size),
                             "v_proj": (a.q_size + a.kv_size, a.kv_size)}[proj]
                dst = params[f"{pre}qkv_proj.{kind}"].data.narrow(0, off, size)
                if dst.shape != t.shape:
                    raise ValueError(f"weight {name!r}: checkpoint shape {tuple(t.shape)} != model {tuple(dst.shape)}")
                dst.copy_(t)
                return f"{pre}qkv_proj.{kind}#{proj[0]}"
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        if params[name].shape != t.shape:
            raise ValueError(f"weight {name!r}: checkpoint shape {tuple(t.shape)} != model {tuple(params[name].shape)}")
        params[name].data.copy_(t)
        return name
