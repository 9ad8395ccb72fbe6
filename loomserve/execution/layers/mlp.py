"""Feed-forward blocks: gated MLPs (SwiGLU, Gemma's GELU-tanh GLU) and the ungated relu^2 MLP."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers.fused import silu_and_mul


class SwiGLU(nn.Module):
    """gate and up projections fused into one matmul: one kernel launch instead of two; SiLU and
    the product in one C call where it applies (layers/fused.py)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # .forward: Module.__call__'s hook checks cost ~1-2 us a call on a decode step.
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x), self.intermediate))


class GeluTanhGLU(SwiGLU):
    """Gemma's MLP: the gate goes through tanh-approximated GELU instead of SiLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class ReluSquaredMLP(nn.Module):
    """Nemotron-H's MLP: up -> relu^2 -> down, no gate."""

    def __init__(self, hidden: int, inter: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())
