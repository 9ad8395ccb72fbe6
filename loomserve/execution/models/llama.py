"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Sliding-window layers (Mistral, Qwen2/3 with use_sliding_window) are the same layers bound to a
sliding-window KV group: the window lives in that group's attention metadata, not in the layer.

Checkpoints load by their HF names (`model.layers.N.self_attn.q_proj.weight`, ...). Inside, q/k/v
and gate/up are fused into one matmul each, so `load_weights` maps the HF shards into slices of
the fused parameters: fewer kernel launches per layer, which is most of a small model's decode.

Tensor parallelism (LlamaTP): heads and MLP columns split, o_proj and down_proj swapped for
row-parallel linears (Megatron's form). A decode-only step runs in one C call where it applies
(llama_decode.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn

from loomserve.execution.layers.attention import AttentionMetadata, paged_attention
from loomserve.execution.layers.fused import rope_qk_
from loomserve.execution.layers.mlp import SwiGLU
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.layers.rotary import RotaryEmbedding, apply_rope
from loomserve.execution.models.arch_config import FULL, SLIDING, ArchConfig
from loomserve.execution.models.llama_decode import DecodeStack
from loomserve.execution.models.loading.weight_layout import lm_head_logits
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import TPPlan, attention_weight, swiglu_weight
from loomserve.kv.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


@dataclass(frozen=True)
class LlamaConfig(ArchConfig):
    """Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3: one architecture, told apart by switches."""

    model_types = ("llama", "mistral", "qwen2", "qwen3")

    @classmethod
    def model_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        mtype = d.get("model_type", "llama")
        # Qwen2 configs predate the attention_bias key: their q/k/v always carry a bias.
        return {"attention_bias": bool(d.get("attention_bias", mtype == "qwen2")),
                "qk_norm": mtype == "qwen3"}

    @classmethod
    def default_layer_types(cls, d: dict[str, Any], num_layers: int,
                            window: int | None) -> list[str]:
        if d.get("model_type") in ("qwen2", "qwen3") and window is not None:
            first = int(d.get("max_window_layers", num_layers))  # layers below it see everything
            return [SLIDING if i >= first else FULL for i in range(num_layers)]
        return super().default_layer_types(d, num_layers, window)


class LlamaTP(TPPlan):
    """Heads and MLP columns split; o_proj and down_proj row-parallel (Megatron's swap)."""

    row_parallel = ("self_attn.o_proj", "mlp.down_proj")

    def divisions(self, cfg: ArchConfig) -> dict[str, int]:
        return {"num_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size}

    def shard_layer(self, rest: str, t: torch.Tensor, cfg: ArchConfig, tp: TPGroup) -> torch.Tensor:
        a = attention_weight(rest, t, cfg, tp)
        return a if a is not None else swiglu_weight(rest, t, tp, cfg.intermediate_size)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, norm: Callable[..., nn.Module] = RMSNorm, scale: float | None = None,
                 o_bias: bool = False, sinks: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = scale if scale is not None else cfg.head_dim ** -0.5
        # gpt-oss: a learned logit per head that joins every softmax denominator.
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if sinks else None
        # Set by the runner: views of this layer's K and V in the packed pages.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, int],
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        # .forward, not __call__: Module.__call__'s hook checks cost ~1-2 us, six times a layer.
        qkv = self.qkv_proj.forward(x).view(n, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        h, kvh = self.num_heads, self.num_kv_heads
        cos, sin, half = rope
        if self.q_norm is None:
            if rope_qk_(qkv, h + kvh, cos, sin, half):  # one C call, in place on the fresh qkv
                q, k = qkv[:, :h], qkv[:, h:h + kvh]
            else:  # q and k rotate together: one set of elementwise ops for both.
                qk = apply_rope(qkv[:, :h + kvh], cos, sin, half)
                q, k = qk[:, :h], qk[:, h:]
        elif rope_qk_(qkv, h + kvh, cos, sin, half, self.q_norm, self.k_norm, h):  # norms + rotation, one call
            q, k = qkv[:, :h], qkv[:, h:h + kvh]
        else:
            q = apply_rope(self.q_norm(qkv[:, :h]), cos, sin, half)
            k = apply_rope(self.k_norm(qkv[:, h:h + kvh]), cos, sin, half)
        v = qkv[:, h + kvh:]
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.sinks)
        return self.o_proj.forward(o.reshape(n, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, meta):
        h, residual = self.forward_residual(x, None, rope, meta)
        return residual + h

    def forward_residual(self, x, residual, rope, meta):
        """vLLM's layout: the layer's input is x + residual (x alone when residual is None); returns
        (mlp output, residual stream), whose sum is the layer's output. Handing the sum on
        unmade lets the next norm add it in the same C call (RMSNorm.fused). Never writes x
        when residual is None, so a caller's input survives."""
        if residual is None:
            h, residual = self.input_layernorm.fused(x)[0], x
        else:
            h, residual = self.input_layernorm.fused(x, residual)
        h, residual = self.post_attention_layernorm.fused(self.self_attn.forward(h, rope, meta), residual)
        return self.mlp.forward(h), residual


class HookedDecoderLayer(nn.Module):
    """DecoderLayer's residual layout with the attention and MLP run through __call__, so the
    forward hooks of tensor parallelism sum their outputs. Subclasses build input_layernorm,
    self_attn, post_attention_layernorm and mlp."""

    forward = DecoderLayer.forward

    def forward_residual(self, x, residual, rope, meta):
        if residual is None:
            h, residual = self.input_layernorm.fused(x)[0], x
        else:
            h, residual = self.input_layernorm.fused(x, residual)
        h, residual = self.post_attention_layernorm.fused(self.self_attn(h, rope, meta), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: type[nn.Module] = DecoderLayer,
                 norm: Callable[..., nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(cfg) for _ in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps)


def attention_specs(cfg: ArchConfig, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
    """One spec per layer: sliding layers get the window, the rest full attention."""
    full = FullAttentionSpec(block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
    sliding = SlidingWindowSpec(block_size, cfg.num_kv_heads, cfg.head_dim, dtype,
                                sliding_window=cfg.sliding_window or 0)
    return [sliding if cfg.is_sliding(i) else full for i in range(cfg.num_layers)]


def pick(by_group, group: int):
    """A group's entry from a list/dict by group id; a bare object serves every group."""
    if isinstance(by_group, (list, tuple)):
        return by_group[group]
    if isinstance(by_group, dict):
        return by_group.get(group)
    return by_group


# HF shard name -> (our fused parameter, which slice). Slices are resolved per config.
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_SHARD = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


class LlamaForCausalLM(nn.Module):
    """Implements the runner's model contract (see loomserve.execution.models.registry)."""

    config_class = LlamaConfig
    tp_plan = LlamaTP()
    supports_dcp = True  # decode context parallelism (parallel/context_parallel.py)

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = self._build_model(cfg)
        # Tied models read the embedding matrix as the LM head; no second parameter to keep in sync.
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.groups: list[int] | None = None  # KV group per layer, from the runner
        # Llama's own layers hand the residual stream on (DecoderLayer.forward_residual); other
        # families built on this class (gpt-oss) keep x = layer(x).
        self.carries_residual = all(hasattr(layer, "forward_residual") for layer in self.model.layers)
        self.tp = None  # the TPGroup when this is one rank's slice (parallel/tensor_parallel.py)
        self.decode_stack = None  # llama_decode.DecodeStack, built on the first forward; False: n/a

    def _build_model(self, cfg: ArchConfig) -> nn.Module:
        return LlamaModel(cfg)

    # --- runner contract ----------------------------------------------------------------------

    def init_rotary(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        self.rotary = RotaryEmbedding(self.config, max_positions, device, dtype)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        return attention_specs(self.config, block_size, dtype)

    def kv_cache_modules(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.model.layers]

    def set_layer_groups(self, groups: list[int]) -> None:
        self.groups = list(groups)

    def layer_metadata(self, attn_meta) -> list[AttentionMetadata]:
        """Each layer's metadata, resolved once per step (not per layer)."""
        if isinstance(attn_meta, AttentionMetadata):
            return [attn_meta] * len(self.model.layers)
        groups = self.groups or [0] * len(self.model.layers)
        return [pick(attn_meta, g) for g in groups]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta,
                state_batch=None) -> torch.Tensor:
        """Flattened tokens in, final hidden states out ([tokens, hidden]). attn_meta: one
        AttentionMetadata per KV group (list indexed by group id) or one for every layer."""
        cos, sin = self.rotary.lookup(positions)
        rope = (cos, sin, self.rotary.half)
        x = self.model.embed_tokens(input_ids)
        metas = self.layer_metadata(attn_meta)
        if self.decode_stack is None:
            self.decode_stack = DecodeStack.build(self, DecoderLayer, Attention, SwiGLU) or False
        if self.decode_stack:
            got = self.decode_stack.run(x, rope, metas)
            if got is not None:
                return self.model.norm.fused(*got)[0]
        if not self.carries_residual:
            for layer, meta in zip(self.model.layers, metas):
                x = layer(x, rope, meta)
            return self.model.norm(x)
        residual = None
        for layer, meta in zip(self.model.layers, metas):
            x, residual = layer.forward_residual(x, residual, rope, meta)
        return self.model.norm.fused(x, residual)[0]

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head_logits(self, hidden, self.lm_head, self.model.embed_tokens)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; every parameter must be covered exactly once."""
        cfg = self.config
        load_fused(self, weights, cfg)


def load_fused(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], cfg: ArchConfig,
               skip: tuple[str, ...] = ()) -> None:
    """HF-named tensors into `model`'s parameters, q/k/v and gate/up into their fused slices;
    every parameter must be covered exactly once, but those whose names end with one of `skip`
    (the caller fills them: MoE expert stacks)."""
    params = {n: p for n, p in model.named_parameters() if not n.endswith(skip)}
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    offsets = {"qkv_proj": [(0, q), (q, kv), (q + kv, kv)], "gate_up_proj": [(0, inter), (inter, inter)]}
    expected = {n: (len(offsets[n.split(".")[-2]]) if n.split(".")[-2] in offsets else 1) for n in params}
    seen: dict[str, int] = {}
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and getattr(model, "lm_head", None) is None:
            continue  # tied: some checkpoints still store the copy
        m = _SHARD.match(name)
        if m:
            fused, idx = _FUSED[m.group(2)]
            target = f"{m.group(1)}.{fused}.{m.group(3)}"
            start, size = offsets[fused][idx]
            dst = params[target].data.narrow(0, start, size)
        else:
            target = name
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            dst = params[target].data
        if dst.shape != tensor.shape:
            raise ValueError(f"weight {name!r}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
        dst.copy_(tensor)
        seen[target] = seen.get(target, 0) + 1
    missing = [n for n, k in expected.items() if seen.get(n, 0) != k]
    if missing:
        raise ValueError(f"checkpoint lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
