"""Building blocks of the Llama family: RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 whatever the model dtype, as the reference does; bf16 variance
        # alone shifts logits visibly.
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, with the config's scaling applied."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / float(s["factor"])
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


class RotaryEmbedding:
    """cos/sin tables for every position, built once; a step gathers its rows once for all layers.

    Plain object, not a module: the table is derived from the config, not a weight, and must
    survive the meta-device construction the loader uses.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        inv = rope_inv_freq(cfg).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        half = freqs.shape[-1]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype)
        # sin with the sign of rotate_half folded in, so the rotation is x*cos + roll(x)*sin.
        sin = emb.sin()
        sin[:, :half] = -sin[:, :half]
        self.sin = sin.to(dtype)
        self.half = half

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [tokens, 1, head_dim]: broadcasts over heads.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: int) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; rotate_half(x) == roll(x, half) with the sign in sin."""
    return x * cos + torch.roll(x, half, dims=-1) * sin


class SwiGLU(nn.Module):
    """gate and up projections fused into one matmul: one kernel launch instead of two."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
