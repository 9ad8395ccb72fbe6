"""Qwen3-Next: Gated DeltaNet layers interleaved with gated full attention, sparse MoE MLPs.

Layer kinds follow config.layer_types (or full_attention_interval: every Nth layer is full
attention). Details that differ from the Llama family, all checked against transformers:
- every RMSNorm outside the Gated DeltaNet scales by (1 + w) (weights stored zero-centred);
- full attention: q_proj emits per head [query | output gate]; q and k are RMSNormed per head;
  RoPE turns only the first partial_rotary_factor of each head; the output is o * sigmoid(gate);
- MLP: sparse MoE (softmax router, top-k, optional renormalization) plus a shared SwiGLU expert
  scaled by sigmoid(shared_expert_gate(x)); layers in mlp_only_layers (or off the
  decoder_sparse_step grid, or num_experts == 0) use a dense SwiGLU.

Runner contract: loomserve/execution/models/registry.py. Full-attention layers read their group's entry of
`attn_meta`, linear layers their group's `state_batch`; until the runner calls
`set_layer_groups`, group ids are derived from `kv_cache_specs` in the runner's order. The
checkpoint's MTP layers (`mtp.*`) are skipped here; qwen3_next_mtp.py loads them for
`"method": "mtp"` drafts (each then adds one full-attention layer to the KV specs, and forward
keeps its output, after the final norm, in `last_hidden`).

Tensor parallelism (Qwen3NextTP): gated attention heads split (per head [query | gate] rows stay
together); Gated DeltaNet key heads split with their value heads (layers/gated_deltanet.py), so
LinearStateSpec pages are 1/N per rank, planned alike on every rank; routed and shared experts
and the dense MLPs split by intermediate columns. Each block's output is all-reduced by a hook.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers.attention import AttentionMetadata, paged_attention
from loomserve.execution.layers.expert_parallel import ExpertParallel
from loomserve.execution.layers.gated_deltanet import GatedDeltaNet, tp_slice
from loomserve.execution.layers.mlp import SwiGLU
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.layers.rotary import RotaryEmbedding, apply_rope
from loomserve.execution.models.arch_config import eos_token_ids
from loomserve.execution.models.loading.weight_layout import lm_head_logits
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import TPPlan, attention_weight, swiglu_weight
from loomserve.kv.spec import FullAttentionSpec, KVCacheSpec, LinearStateSpec

# Weights stored around 0: the scale is 1 + w, applied in fp32.
ZeroCenteredRMSNorm = partial(RMSNorm, zero_centered=True, scale_in_fp32=True)


@dataclass(frozen=True)
class Qwen3NextConfig:
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    linear_split_projections: bool = False  # HF Gated DeltaNet: Qwen3.5's in_proj_qkv/z/b/a

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "Qwen3NextConfig":
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        n = int(d["num_hidden_layers"])
        types = d.get("layer_types")
        if types is None:
            every = int(d.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
        if len(types) != n or set(types) - {"full_attention", "linear_attention"}:
            raise ValueError(f"bad layer_types {types!r} for {n} layers")
        rope = dict(d.get("rope_parameters") or {})
        rope.update(d.get("rope_scaling") or {})
        rtype = rope.get("rope_type") or rope.get("type") or "default"
        if rtype != "default":
            raise ValueError(f"unsupported rope scaling type {rtype!r} for qwen3_next (only default)")
        heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=int(d["hidden_size"]), vocab_size=int(d["vocab_size"]), layer_types=tuple(types),
            num_heads=heads, num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            intermediate_size=int(d.get("intermediate_size") or 0),
            linear_num_key_heads=int(d["linear_num_key_heads"]),
            linear_num_value_heads=int(d["linear_num_value_heads"]),
            linear_key_head_dim=int(d["linear_key_head_dim"]),
            linear_value_head_dim=int(d["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
            num_experts=int(d.get("num_experts", 0)), num_experts_per_tok=int(d.get("num_experts_per_tok", 1)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 0)),
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
            attention_bias=bool(d.get("attention_bias", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_token_ids(d),
        )


class Qwen3NextTP(TPPlan):
    reduced_blocks = ("self_attn", "linear_attn", "mlp")

    def divisions(self, cfg: Qwen3NextConfig) -> dict[str, int]:
        return {"num_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size,
                "linear_num_key_heads": cfg.linear_num_key_heads,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size}

    def per_rank(self, cfg: Qwen3NextConfig, tp: TPGroup) -> dict[str, int]:
        return {"linear_num_value_heads": cfg.linear_num_value_heads // tp.size}

    def shard_layer(self, rest: str, t: torch.Tensor, cfg: Qwen3NextConfig, tp: TPGroup
                    ) -> torch.Tensor:
        a = attention_weight(rest, t, cfg, tp)
        if a is not None:
            return a
        if rest.startswith("linear_attn."):
            return tp_slice(rest[len("linear_attn."):], t, tp, cfg.linear_num_key_heads,
                            cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                            cfg.linear_value_head_dim)
        return swiglu_weight(rest, t, tp, cfg.intermediate_size, cfg.moe_intermediate_size,
                             cfg.shared_expert_intermediate_size)


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate. qkv_proj fuses HF's q_proj (split at load into
    queries and gates), k_proj and v_proj: rows [q | gate | k | v]."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary_dim = cfg.rotary_dim
        self.scale = cfg.head_dim ** -0.5
        self.k_cache: torch.Tensor | None = None  # set by the runner, like llama.Attention
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, int],
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, gate, k, v = self.qkv_proj(x).split([self.q_size, self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))
        cos, sin, half = rope
        r = self.rotary_dim
        q = torch.cat([apply_rope(q[..., :r], cos, sin, half), q[..., r:]], dim=-1)
        k = torch.cat([apply_rope(k[..., :r], cos, sin, half), k[..., r:]], dim=-1)
        o = paged_attention(q, k, v.view(n, self.num_kv_heads, self.head_dim), self.k_cache, self.v_cache,
                            meta, self.scale)
        return self.o_proj(o.reshape(n, self.q_size) * torch.sigmoid(gate))


class SparseMoE(ExpertParallel, nn.Module):
    """Top-k routed SwiGLU experts plus a sigmoid-gated shared expert. Expert weights are stacked
    [experts, 2 * inter, hidden] (gate; up) and [experts, hidden, inter]; the routed experts run
    locally or sharded over DP ranks (layers/expert_parallel.py)."""

    expert_params = ("experts_gate_up", "experts_down")
    expert_act = "swiglu"  # grouped products (layers/grouped_experts.py)

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k, self.norm_topk, self.inter = cfg.num_experts_per_tok, cfg.norm_topk_prob, i
        self.gate = nn.Linear(h, e, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.experts_down = nn.Parameter(torch.empty(e, h, i))
        self.shared_expert = SwiGLU(h, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
        return shared + self.run_experts(x, weights, experts)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.experts_gate_up[e]).split(self.inter, dim=-1)
        return F.linear(F.silu(gate) * up, self.experts_down[e])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, i: int) -> None:
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear_num_key_heads,
                                             cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                             cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                                             cfg.rms_norm_eps, cfg.linear_split_projections)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if cfg.is_moe(i) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, meta, states):
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h = self.linear_attn(h, states)
        else:
            h = self.self_attn(h, rope, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def layer_groups(specs: list[KVCacheSpec | None]) -> list[int | None]:
    """Group id per layer in the runner's order (registry.py): full attention groups first, then
    sliding window, then linear state; within a kind by first layer; equal specs share a group.
    None for a layer that keeps no cache (an MLP-only block)."""
    rank = {"full_attention": 0, "sliding_window": 1, "linear_state": 2}
    distinct = list(dict.fromkeys(s for s in specs if s is not None))
    ids = {s: i for i, s in enumerate(sorted(distinct, key=lambda s: (rank[s.kind], specs.index(s))))}
    return [None if s is None else ids[s] for s in specs]


def pick(by_group: Any, group: int) -> Any:
    """The object of `group` from a per-group mapping (None if the group has none), or the object."""
    if group is None:
        return None
    if isinstance(by_group, dict):
        return by_group.get(group)
    if isinstance(by_group, (list, tuple)):
        return by_group[group] if group < len(by_group) else None
    return by_group


_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SWIGLU = re.compile(r"^(.*)\.(gate_proj|up_proj)\.weight$")


class Qwen3NextForCausalLM(nn.Module):
    config_class = Qwen3NextConfig
    tp_plan = Qwen3NextTP()
    supports_dcp = True  # linear-state layers replicated per rank (parallel/context_parallel.py)

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3NextModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.groups: list[int] | None = None
        self.tp = None  # the TPGroup when this is one rank's slice (parallel/tensor_parallel.py)
        # the checkpoint's MTP layers when drafting with them (qwen3_next_mtp.py), else None
        self.mtp = None
        self.last_hidden: torch.Tensor | None = None

    # --- runner contract --------------------------------------------------------------------------

    def init_rotary(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        c = self.config
        partial = SimpleNamespace(head_dim=c.rotary_dim, rope_theta=c.rope_theta, rope_scaling=None)
        self.rotary = RotaryEmbedding(partial, max_positions, device, dtype)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """One spec per layer. Linear states are kept in fp32 whatever the model dtype."""
        c, out = self.config, []
        for layer in self.model.layers:
            if layer.kind == "linear_attention":
                out.append(LinearStateSpec(block_size, state_shapes=layer.linear_attn.state_shapes(),
                                           dtype=torch.float32))
            else:
                out.append(FullAttentionSpec(block_size, c.num_kv_heads, c.head_dim, dtype))
        if self.mtp is not None:  # MTP: one more full-attention layer each
            out += [FullAttentionSpec(block_size, c.num_kv_heads, c.head_dim, dtype)] * len(
                self.mtp.layers)
        return out

    def kv_cache_modules(self) -> list[nn.Module | None]:
        """Each layer's cache holder in kv_cache_specs' order (what the runner would find on
        model.model.layers by itself), then the MTP layers' attention."""
        own = []
        for layer in self.model.layers:
            found = None
            for name in ("self_attn", "linear_attn"):
                m = getattr(layer, name, None)
                if m is not None and (hasattr(m, "k_cache") or hasattr(m, "state_cache")):
                    found = m
                    break
            own.append(found)
        return own + ([m.self_attn for m in self.mtp.layers] if self.mtp is not None else [])

    def set_layer_groups(self, groups: list[int]) -> None:
        self.groups = list(groups)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: Any,
                state_batch: Any) -> torch.Tensor:
        """Flattened tokens in, final hidden states out ([tokens, hidden])."""
        if self.groups is None:
            self.groups = layer_groups(self.kv_cache_specs(1, torch.float32))
        cos, sin = self.rotary.lookup(positions)
        rope = (cos, sin, self.rotary.half)
        x = self.model.embed_tokens(input_ids)
        for layer, g in zip(self.model.layers, self.groups):
            x = layer(x, rope, pick(attn_meta, g), pick(state_batch, g))
        x = self.model.norm(x)
        if self.mtp is not None:
            self.last_hidden = x
        return x

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head_logits(self, hidden, self.lm_head, self.model.embed_tokens)

    # --- HF weights -------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (per-expert or stacked expert layouts); every parameter must be
        covered exactly once, each fused slice by its own shard."""
        c = self.config
        params = dict(self.named_parameters())
        expected: set[str] = set()
        for i, layer in enumerate(self.model.layers):
            pre = f"model.layers.{i}."
            for n, _ in layer.named_parameters():
                if n.startswith("linear_attn."):
                    continue
                if n.endswith("gate_up_proj.weight"):
                    expected |= {pre + n + "#0", pre + n + "#1"}
                elif n == "self_attn.qkv_proj.weight" or n == "self_attn.qkv_proj.bias":
                    expected |= {pre + n + "#q", pre + n + "#k", pre + n + "#v"}
                elif n == "mlp.experts_down":
                    expected |= {f"{pre}{n}#{e}" for e in range(c.num_experts)}
                elif n == "mlp.experts_gate_up":
                    expected |= {f"{pre}{n}#{e}.{j}" for e in range(c.num_experts) for j in (0, 1)}
                else:
                    expected.add(pre + n)
            if layer.kind == "linear_attention":
                expected |= {pre + "linear_attn." + k for k in layer.linear_attn.hf_param_keys()}
        expected |= {n for n in params if not n.startswith("model.layers.")}
        seen: list[str] = []
        for name, t in weights:
            if name.startswith("mtp.") or "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            seen.extend(self._load_one(name, t, params))
        dup = {n for n in seen if seen.count(n) > 1}
        missing = expected - set(seen)
        if dup or missing:
            raise ValueError(f"checkpoint mismatch: missing {sorted(missing)[:5]}, duplicated {sorted(dup)[:5]}")

    def _load_one(self, name: str, t: torch.Tensor, params: dict[str, torch.Tensor]) -> list[str]:
        c = self.config
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
        if not m:
            return [_copy_into(params, name, t)]
        i, rest = int(m.group(1)), m.group(2)
        layer, pre = self.model.layers[i], f"model.layers.{i}."
        if rest.startswith("linear_attn."):
            return [pre + "linear_attn." + layer.linear_attn.load_hf(rest[len("linear_attn."):], t)]
        if rest.startswith("self_attn.") and rest.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
            proj, kind = rest.split(".")[1], rest.split(".")[2]
            dst = params[f"{pre}self_attn.qkv_proj.{kind}"].data
            a = layer.self_attn
            if proj == "q_proj":  # per head [query | gate] -> all queries, then all gates
                hd = a.head_dim
                t = t.view(a.num_heads, 2, hd, *t.shape[1:]).transpose(0, 1).reshape(2 * a.q_size, *t.shape[1:])
                _copy_to(dst.narrow(0, 0, 2 * a.q_size), t, name)
            else:
                off = 2 * a.q_size + (0 if proj == "k_proj" else a.kv_size)
                _copy_to(dst.narrow(0, off, a.kv_size), t, name)
            return [f"{pre}self_attn.qkv_proj.{kind}#{proj[0]}"]
        em = _EXPERT.match(rest)
        if em:
            e, proj = int(em.group(1)), em.group(2)
            moe = layer.mlp
            if proj == "down_proj":
                _copy_to(moe.experts_down.data[e], t, name)
                return [f"{pre}mlp.experts_down#{e}"]
            j = 0 if proj == "gate_proj" else 1
            _copy_to(moe.experts_gate_up.data[e].narrow(0, j * moe.inter, moe.inter), t, name)
            return [f"{pre}mlp.experts_gate_up#{e}.{j}"]
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # stacked (transformers 5)
            if rest.endswith("down_proj"):
                _copy_to(layer.mlp.experts_down.data, t, name)
                return [f"{pre}mlp.experts_down#{e}" for e in range(c.num_experts)]
            _copy_to(layer.mlp.experts_gate_up.data, t, name)
            return [f"{pre}mlp.experts_gate_up#{e}.{j}" for e in range(c.num_experts) for j in (0, 1)]
        sm = _SWIGLU.match(rest)
        if sm:
            mod = layer.get_submodule(sm.group(1))
            idx = 0 if sm.group(2) == "gate_proj" else 1
            _copy_to(mod.gate_up_proj.weight.data.narrow(0, idx * mod.intermediate, mod.intermediate), t, name)
            return [f"{pre}{sm.group(1)}.gate_up_proj.weight#{idx}"]
        return [_copy_into(params, name, t)]


def _copy_to(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name!r}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)


def _copy_into(params: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> str:
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    _copy_to(params[name].data, t, name)
    return name
