"""Rotary position embedding: per-pair frequencies (with llama3, linear, YaRN and dynamic NTK
scaling), the cos/sin tables, and the rotation itself.

Every table is static: a position's rotation is fixed once the model is loaded, whatever the
length of the sequence it is in. The prefix cache and the KV tiers keep K rotated at write time,
so a rotation that changed with the sequence length would leave cached K stale."""

from __future__ import annotations

import math

import torch

from loomserve.execution.models.arch_config import ArchConfig


def rope_inv_freq(cfg: ArchConfig, theta: float | None = None,
                  scaling: dict | None = None) -> torch.Tensor:
    """Per-pair rotation frequencies, with the config's scaling applied (or the given base and
    scaling: Gemma 3's sliding layers rotate with their own)."""
    dim = cfg.head_dim
    if theta is None:
        theta, scaling = cfg.rope_theta, cfg.rope_scaling
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / float(s["factor"])
    if s["rope_type"] == "yarn":
        return _yarn_inv_freq(inv, dim, theta, s)
    if s["rope_type"] == "dynamic":
        return 1.0 / (dynamic_ntk_base(theta, dim, float(s["factor"]))
                      ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def dynamic_ntk_base(theta: float, dim: int, factor: float) -> float:
    """Dynamic NTK, in vLLM's static form (DynamicNTKScalingRotaryEmbedding): the base raised
    once, for the longest context the scaling allows (max_position_embeddings * factor).

    transformers' form recomputes the base per forward pass from the current length L,
    theta * (factor * L / max_pos - (factor - 1)) ** (dim / (dim - 2)) once L > max_pos, so
    every position's rotation changes as the sequence grows. A serving engine cannot do that:
    K is cached rotated (prefix cache, tiers, other requests sharing the blocks) and would go
    stale, and sequences of different lengths share a batch. The static form is transformers'
    formula at L = max_pos * factor, its largest base: identical to transformers for a
    sequence of that full length, and a fixed, slightly stronger stretch for shorter ones
    (under max_pos too, where transformers leaves RoPE plain)."""
    return theta * (factor * factor - (factor - 1)) ** (dim / (dim - 2))


def _yarn_inv_freq(inv: torch.Tensor, dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN: high-frequency pairs (many turns over the original context) keep their frequency,
    low-frequency pairs are divided by `factor`, with a linear ramp between the pair indices
    where the original context holds beta_fast and beta_slow turns."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def pair_at(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = pair_at(beta_fast), pair_at(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_attention_scaling(scaling: dict | None) -> float:
    """YaRN scales cos and sin (so q.k) by a factor growing with log(factor)."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)


class RotaryEmbedding:
    """cos/sin tables for every position, built once; a step gathers its rows once for all layers.

    Plain object, not a module: the table is derived from the config, not a weight, and must
    survive the meta-device construction the loader uses.
    """

    def __init__(self, cfg: ArchConfig, max_positions: int, device: torch.device,
                 dtype: torch.dtype, theta: float | None = None, scaling: dict | None = None) -> None:
        inv = rope_inv_freq(cfg, theta, scaling).to(device)
        attn = rope_attention_scaling(cfg.rope_scaling if theta is None else scaling)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        half = freqs.shape[-1]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * attn).to(dtype)
        # sin with the sign of rotate_half folded in, so the rotation is x*cos + roll(x)*sin.
        sin = emb.sin() * attn
        sin[:, :half] = -sin[:, :half]
        self.sin = sin.to(dtype)
        self.half = half

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [tokens, 1, head_dim]: broadcasts over heads.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; rotate_half(x) == roll(x, half) with the sign in sin.
    Two products and a sum, each rounded in the model dtype, as the reference does (a fused
    addcmul rounds once and moves bf16 logits by ~0.04)."""
    return x * cos + torch.roll(x, half, dims=-1) * sin
