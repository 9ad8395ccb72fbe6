"""Tensor-parallel rules for the families beyond the Llama class's own: gpt-oss, Qwen3-Next,
Nemotron-H and DeepSeek-V3 (Gemma 3 is the Llama split as it is: tensor_parallel.py).

The scheme is Megatron's, as for Llama: every head-shaped or intermediate-shaped dimension is
split in N contiguous slices (rank r builds the single-rank module from a per-rank config and
loads its slices), and each block whose output is a sum over the split dimension (attention,
Gated DeltaNet, MLP / MoE) gets one all-reduce on its output, added as a forward hook on that
block so the model classes and their parameter names stay unchanged. Routers, norms, sinks'
neighbours and other replicated tensors load whole; a bias on a row-split output is kept on
rank 0 only (zeros elsewhere), so the all-reduce adds it once.

- gpt-oss: attention heads (and their sinks) split like Llama's; every expert's intermediate
  columns split (experts replicated, each expert's MLP split: the router sees the same x on
  every rank, so every rank routes alike and no token moves between ranks).
- Qwen3-Next: gated attention heads split (per head [query | gate] rows stay together); Gated
  DeltaNet key heads split with their `rep` value heads, so a rank's conv channels, decay and
  recurrent state are its heads' only (LinearStateSpec pages 1/N per rank, planned alike on
  every rank); routed and shared experts and the dense MLPs split by intermediate columns.
- Nemotron-H: Mamba2 heads split with their B/C groups (n_groups divisible by N), so conv
  channels, the grouped gated norm and the SSM state are per rank; attention heads, relu^2 MLP
  and routed / shared experts split like the others (the router replicated).
- DeepSeek-V3 (MLA): query heads, kv_b_proj's per-head rows and o_proj's columns split; the
  latent path and its cache replicated (every rank stores the same latent rows: page and block
  count as one rank's; splitting the cache itself is DCP's job, not TP's); MoE as above.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Iterator

import torch

from loomserve.execution.layers.parallel_linear import VocabParallelEmbedding, vocab_per_rank
from loomserve.execution.parallel.state import TPGroup

FAMILIES = {"loomserve.execution.models.gpt_oss": "gpt_oss",
            "loomserve.execution.models.qwen3_next": "qwen3_next",
            "loomserve.execution.models.nemotron_h": "nemotron_h",
            "loomserve.execution.models.deepseek_v3": "deepseek_v3"}


def family(model_cls: type) -> str | None:
    return FAMILIES.get(model_cls.__module__)


def family_of_cfg(cfg) -> str | None:
    if type(cfg).__name__ == "Qwen3NextConfig":
        return "qwen3_next"
    if type(cfg).__name__ == "NemotronHConfig":
        return "nemotron_h"
    if type(cfg).__name__ == "DeepseekV3Config":
        return "deepseek_v3"
    if getattr(cfg, "architecture", None) == "GptOssForCausalLM":
        return "gpt_oss"
    return None


def kv_heads_of(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """(first KV head, count) rank `rank` holds (replicated when fewer heads than ranks)."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, per
    return rank // (size // num_kv_heads), 1


def divisions(fam: str, cfg) -> dict[str, int]:
    """The sizes N must divide."""
    d = {"num_heads": cfg.num_heads}
    if fam == "gpt_oss":
        d["intermediate_size"] = cfg.intermediate_size
    elif fam == "deepseek_v3":
        d.update(intermediate_size=cfg.intermediate_size,
                 moe_intermediate_size=cfg.moe_intermediate_size)
    elif fam == "nemotron_h":
        d.update(intermediate_size=cfg.intermediate_size, mamba_num_heads=cfg.mamba_num_heads,
                 n_groups=cfg.n_groups, moe_intermediate_size=cfg.moe_intermediate_size,
                 moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size)
    else:
        d.update(intermediate_size=cfg.intermediate_size,
                 linear_num_key_heads=cfg.linear_num_key_heads,
                 moe_intermediate_size=cfg.moe_intermediate_size,
                 shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    return d


def check(fam: str, cfg, size: int) -> None:
    bad = {k: v for k, v in divisions(fam, cfg).items() if v % size}
    kv = getattr(cfg, "num_kv_heads", size)  # MLA: one latent row per token, replicated
    if bad or (kv % size and size % kv):
        raise ValueError(f"tensor_parallel_size={size} must divide {bad or divisions(fam, cfg)} "
                         f"and divide or be a multiple of num_kv_heads={kv}")


def shard_config(fam: str, cfg, tp: TPGroup):
    n = tp.size
    kw = {k: v // n for k, v in divisions(fam, cfg).items()}
    if fam != "deepseek_v3":
        kw["num_kv_heads"] = kv_heads_of(tp.rank, n, cfg.num_kv_heads)[1]
    kw["vocab_size"] = vocab_per_rank(cfg.vocab_size, n)
    if fam == "qwen3_next":
        kw["linear_num_value_heads"] = cfg.linear_num_value_heads // n
    return dataclasses.replace(cfg, **kw)


def _reduce_output(module: torch.nn.Module, tp: TPGroup) -> None:
    """The module's output, a partial sum on each rank, summed over the ranks."""
    module.register_forward_hook(lambda _m, _args, out: tp.all_reduce(out))


def parallelize(fam: str, model: torch.nn.Module, cfg, tp: TPGroup) -> None:
    inner = model.model
    for layer in inner.layers:
        for name in ("self_attn", "linear_attn", "mlp", "mixer"):
            if hasattr(layer, name):
                _reduce_output(getattr(layer, name), tp)
    table = VocabParallelEmbedding(vocab_per_rank(cfg.vocab_size, tp.size), cfg.hidden_size,
                                   cfg.vocab_size, tp)
    setattr(inner, "embeddings" if fam == "nemotron_h" else "embed_tokens", table)
    model.tp = tp


def shard_weights(fam: str, weights: Iterable[tuple[str, torch.Tensor]], cfg, tp: TPGroup
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    from loomserve.execution.parallel.tensor_parallel import _vocab_rows
    vocab = vocab_per_rank(cfg.vocab_size, tp.size)
    rule = {"gpt_oss": _gpt_oss_rule, "qwen3_next": _qwen3_next_rule,
            "nemotron_h": _nemotron_h_rule, "deepseek_v3": _deepseek_v3_rule}[fam]
    for name, t in weights:
        if name in ("model.embed_tokens.weight", "lm_head.weight", "backbone.embeddings.weight",
                    "model.embeddings.weight"):
            t = _vocab_rows(t, tp.rank * vocab, vocab)
        else:
            m = re.match(r"^(?:model|backbone)\.layers\.\d+\.(.*)$", name)
            if m:
                t = rule(m.group(1), t, cfg, tp)
        yield name, t.contiguous()


def _part(t: torch.Tensor, dim: int, total: int, tp: TPGroup) -> torch.Tensor:
    """Rank r's slice r of N equal slices of `total` along dim (t.shape[dim] == total * unit)."""
    per = t.shape[dim] // tp.size
    assert per * tp.size == t.shape[dim] and total % tp.size == 0, (t.shape, dim, total)
    return t.narrow(dim, tp.rank * per, per)


def _bias_once(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return t if tp.is_driver else torch.zeros_like(t)


def _attention(rest: str, t: torch.Tensor, cfg, tp: TPGroup, block: str = "self_attn."
               ) -> torch.Tensor | None:
    """q/k/v/o and sinks of an attention block (q rows per head, whatever a head's rows are);
    None when `rest` is not one of them."""
    leaf = rest.split(".")[1] if rest.startswith(block) else None
    if leaf == "q_proj" or leaf == "sinks":
        return _part(t, 0, cfg.num_heads, tp)
    if leaf in ("k_proj", "v_proj"):
        first, count = kv_heads_of(tp.rank, tp.size, cfg.num_kv_heads)
        d = t.shape[0] // cfg.num_kv_heads
        return t.narrow(0, first * d, count * d)
    if leaf == "o_proj":
        return _bias_once(t, tp) if rest.endswith("bias") else _part(t, 1, cfg.num_heads, tp)
    return None


def _gpt_oss_rule(rest: str, t: torch.Tensor, cfg, tp: TPGroup) -> torch.Tensor:
    a = _attention(rest, t, cfg, tp)
    if a is not None:
        return a
    i = cfg.intermediate_size
    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
        # columns interleave gate and up (g0 u0 g1 u1 ...): a contiguous slice keeps the pairs
        return _part(t, t.dim() - 1, i, tp)
    if rest == "mlp.experts.down_proj":  # [experts, inter, hidden]
        return _part(t, 1, i, tp)
    if rest == "mlp.experts.down_proj_bias":
        return _bias_once(t, tp)
    return t  # norms, router


_QN_MLP = re.compile(r"^mlp\.(?:(shared_experts?)\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj)\.weight$")


def _qwen3_next_rule(rest: str, t: torch.Tensor, cfg, tp: TPGroup) -> torch.Tensor:
    a = _attention(rest, t, cfg, tp)
    if a is not None:
        return a
    if rest.startswith("linear_attn."):
        return _deltanet(rest[len("linear_attn."):], t, cfg, tp)
    return _moe_rule(rest, t, cfg.intermediate_size, cfg.moe_intermediate_size,
                     cfg.shared_expert_intermediate_size, tp)


def _moe_rule(rest: str, t: torch.Tensor, inter: int, moe_inter: int, shared: int,
              tp: TPGroup) -> torch.Tensor:
    """SwiGLU MLPs by intermediate columns: the dense one, every routed expert (per-expert or
    stacked), the shared expert(s); routers and gates replicated."""
    m = _QN_MLP.match(rest)
    if m:
        total = shared if m.group(1) else moe_inter if rest.startswith("mlp.experts.") else inter
        return _part(t, 1 if m.group(2) == "down_proj" else 0, total, tp)
    i = moe_inter
    if rest == "mlp.experts.gate_up_proj":  # stacked [experts, 2 * inter, hidden]: gate; up
        gate, up = t.split(i, dim=1)
        return torch.cat([_part(gate, 1, i, tp), _part(up, 1, i, tp)], dim=1)
    if rest == "mlp.experts.down_proj":  # stacked [experts, hidden, inter]
        return _part(t, 2, i, tp)
    return t  # norms, router, shared expert gate


def _deltanet(name: str, t: torch.Tensor, cfg, tp: TPGroup) -> torch.Tensor:
    """Gated DeltaNet: HF's fused projections are grouped per key head, so a rank's key heads
    (and the value heads they serve) are one contiguous slice of the per-key-head view."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if name in ("in_proj_qkvz.weight", "in_proj_ba.weight"):
        return _part(t.view(hk, -1, t.shape[-1]), 0, hk, tp).reshape(-1, t.shape[-1])
    if name == "conv1d.weight":  # channels [q (hk*dk) | k (hk*dk) | v (hv*dv)]
        ks, vs = hk * cfg.linear_key_head_dim, hv * cfg.linear_value_head_dim
        q, k, v = t.split([ks, ks, vs], dim=0)
        return torch.cat([_part(q, 0, hk, tp), _part(k, 0, hk, tp), _part(v, 0, hv, tp)])
    if name in ("dt_bias", "A_log"):
        return _part(t, 0, hv, tp)
    if name == "out_proj.weight":
        return _part(t, 1, hv, tp)
    return t  # the per-head norm


def _nemotron_h_rule(rest: str, t: torch.Tensor, cfg, tp: TPGroup) -> torch.Tensor:
    """Blocks are `mixer.*` whatever their kind: the kind follows from the tensor's name."""
    a = _attention(rest, t, cfg, tp, block="mixer.")
    if a is not None:
        return a
    if not rest.startswith("mixer."):
        return t  # the block's norm
    name = rest[len("mixer."):]
    if name.startswith(("in_proj.", "conv1d.", "norm.")) or name in ("dt_bias", "A_log", "D",
                                                                       "out_proj.weight",
                                                                       "out_proj.bias"):
        return _mamba2(name, t, cfg, tp)
    m = re.match(r"^(?:(shared_experts)\.|experts\.\d+\.)?(up_proj|down_proj)\.(weight|bias)$", name)
    if m:
        if m.group(1):
            total = cfg.moe_shared_expert_intermediate_size
        elif name.startswith("experts."):
            total = cfg.moe_intermediate_size
        else:
            total = cfg.intermediate_size
        if m.group(2) == "up_proj":
            return _part(t, 0, total, tp)
        return _bias_once(t, tp) if m.group(3) == "bias" else _part(t, 1, total, tp)
    if name == "fc2_latent_proj.bias":  # replicated, applied to each rank's partial expert sum
        return _bias_once(t, tp)
    return t  # norms, router, latent projections


def _mamba2(name: str, t: torch.Tensor, cfg, tp: TPGroup) -> torch.Tensor:
    """Mamba2: heads split, and with them their groups (B and C rows), so a rank's conv channels,
    grouped norm and SSM state are its heads' only. in_proj rows [z | x | B | C | dt]."""
    h, g = cfg.mamba_num_heads, cfg.n_groups
    inner, bc = h * cfg.mamba_head_dim, g * cfg.ssm_state_size
    if name in ("in_proj.weight", "in_proj.bias"):
        z, x, b, c, dt = t.split([inner, inner, bc, bc, h], dim=0)
        return torch.cat([_part(z, 0, h, tp), _part(x, 0, h, tp), _part(b, 0, g, tp),
                          _part(c, 0, g, tp), _part(dt, 0, h, tp)])
    if name in ("conv1d.weight", "conv1d.bias"):  # channels [x | B | C]
        x, b, c = t.split([inner, bc, bc], dim=0)
        return torch.cat([_part(x, 0, h, tp), _part(b, 0, g, tp), _part(c, 0, g, tp)])
    if name == "out_proj.weight":
        return _part(t, 1, h, tp)
    if name == "out_proj.bias":
        return _bias_once(t, tp)
    return _part(t, 0, h, tp)  # dt_bias, A_log, D, the grouped norm's weight [inner]


def _deepseek_v3_rule(rest: str, t: torch.Tensor, cfg, tp: TPGroup) -> torch.Tensor:
    """MLA: query heads, kv_b_proj's per-head [k_nope | v] rows and o_proj's columns split; the
    latent path (q_a / kv_a projections and norms, one latent row per token) replicated, so the
    latent cache is whole on every rank (same page, same blocks as one rank). MoE as Qwen3-Next's
    (shared experts one MLP n_shared times as wide: its columns split the same way)."""
    leaf = rest.split(".")[1] if rest.startswith("self_attn.") else None
    if leaf in ("q_proj", "q_b_proj") or rest == "self_attn.kv_b_proj.weight":
        return _part(t, 0, cfg.num_heads, tp)
    if leaf == "o_proj":
        return _bias_once(t, tp) if rest.endswith("bias") else _part(t, 1, cfg.num_heads, tp)
    if leaf is not None:
        return t
    return _moe_rule(rest, t, cfg.intermediate_size, cfg.moe_intermediate_size,
                     cfg.moe_intermediate_size * cfg.n_shared_experts, tp)
