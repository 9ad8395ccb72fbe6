"""RMSNorm, with the variants the supported models use as options of one module.

y = x / rms(x) * w, the statistics always in fp32 (bf16 variance alone shifts logits visibly).
The variants differ in four ways, each an option; which model uses which:

    model / layer                     zero_centered  scale_in_fp32  gate      groups
    Llama family, gpt-oss             -              -              -         1
    Gemma 3, Qwen3-Next (q/k, layer)  yes            yes            -         1
    Nemotron-H (block, final)         -              yes            -         1
    Qwen3-Next Gated DeltaNet         -              -              "after"   1
    Kimi Delta Attention              -              yes            "after"   1   (sigmoid)
    Mamba2 (Nemotron-H)               -              -              "before"  n_groups

zero_centered: the checkpoint stores w - 1 and the scale is 1 + w (kept in fp32: 1 + w in bf16
    would round w's low bits away). scale_in_fp32: scale the fp32 normalized values, then cast
    back to the model dtype; otherwise cast back first, then scale in the model dtype (Llama).
gate: silu(z) (sigmoid(z) with gate_act="sigmoid") multiplies the input before the
    normalization ("before") or the result after it ("after"); a gated norm is called as
    norm(x, z, dtype), x being a recurrent core's fp32 output and `dtype` the model dtype.
    groups: normalize each of `groups` equal slices of the last dimension on its own.

The parameter is `weight`, as in every checkpoint. The options are resolved once, in __init__:
forward is bound to one straight-line function, so no option costs a kernel or a branch per call.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers import fused as _fused

GATES = (None, "before", "after")
_GATE_ACTS = {"silu": F.silu, "sigmoid": torch.sigmoid}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, zero_centered: bool = False, scale_in_fp32: bool = False,
                 gate: str | None = None, groups: int = 1, gate_act: str = "silu") -> None:
        super().__init__()
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, not {gate!r}")
        if gate_act not in _GATE_ACTS:
            raise ValueError(f"gate_act must be one of {tuple(_GATE_ACTS)}, not {gate_act!r}")
        self._act = _GATE_ACTS[gate_act]
        if groups < 1 or dim % groups:
            raise ValueError(f"{dim} features do not split into {groups} groups")
        if zero_centered and not scale_in_fp32:
            raise ValueError("a zero-centred weight scales in fp32 (1 + w in bf16 drops w's low bits)")
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps, self.groups, self.gate = eps, groups, gate
        self.zero_centered, self.scale_in_fp32 = zero_centered, scale_in_fp32
        self._shape = (dim,)
        self._kernel_flags = None if gate or groups > 1 else _fused.norm_flags(scale_in_fp32, zero_centered)
        self._normalized = self._grouped if groups > 1 else self._whole
        self._finish = self._scale_then_cast if scale_in_fp32 else self._cast_then_scale
        self._scale = self._one_plus_weight if zero_centered else self._weight_fp32
        if gate is not None:
            self.forward = self._gate_before if gate == "before" else self._gate_after
        elif groups > 1:
            self.forward = self._ungated
        else:
            self.forward = self._fp32_scaled if scale_in_fp32 else self._reference

    def extra_repr(self) -> str:
        opts = [f"{self.weight.shape[0]}", f"eps={self.eps}"]
        opts += [name for name in ("zero_centered", "scale_in_fp32") if getattr(self, name)]
        opts += [f"gate={self.gate}"] if self.gate else []
        opts += [f"groups={self.groups}"] if self.groups > 1 else []
        return ", ".join(opts)

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(self(x + residual), x + residual) in one C call where the kernel applies, else
        forward's torch ops (layers/fused.py); (self(x), None) without residual. x is consumed:
        its buffer may receive the sum. forward stays the bit-exact torch reference.
        Ungated, ungrouped variants only."""
        if self._kernel_flags is None:
            raise ValueError("fused() covers the ungated, ungrouped RMSNorm")
        return _fused.rms_norm(x, self.weight, self.eps, self._kernel_flags, residual, self.forward)

    # --- the forward functions __init__ chooses from --------------------------------------------

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        # Llama's: cast back, then scale. In fp32 exactly the reference's six kernels, bit for bit,
        # and no dtype conversions: on a CPU every small kernel after a weight-streaming matmul
        # starts cold (~15 us each).
        if x.dtype == torch.float32:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def _fp32_scaled(self, x: torch.Tensor) -> torch.Tensor:
        # Gemma's, Qwen3-Next's, Nemotron-H's: scale in fp32, then cast back. On the CPU
        # F.rms_norm runs the formula's own kernels (pow, mean, add, rsqrt, mul, mul: the same
        # bits) from one Python call; in bf16 the formula measured as fast or faster, as it does
        # in the gated variants. On CUDA F.rms_norm is one fused kernel.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self._shape, self._scale(), self.eps)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self._scale()).to(x.dtype)

    def _ungated(self, x: torch.Tensor) -> torch.Tensor:
        return self._finish(self._normalized(x.float()), x.dtype)

    def _gate_before(self, x: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._finish(self._normalized(x.float() * self._act(z.float())), dtype)

    def _gate_after(self, x: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self._finish(self._normalized(x.float()), dtype) * self._act(z.float())).to(dtype)

    # --- their parts ----------------------------------------------------------------------------

    def _whole(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def _grouped(self, h: torch.Tensor) -> torch.Tensor:
        g = h.view(*h.shape[:-1], self.groups, -1)
        return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).view(h.shape)

    def _cast_then_scale(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight * h.to(dtype)

    def _scale_then_cast(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (h * self._scale()).to(dtype)

    def _weight_fp32(self) -> torch.Tensor:
        w = self.weight
        return w if w.dtype == torch.float32 else w.float()

    def _one_plus_weight(self) -> torch.Tensor:
        return 1.0 + self.weight.float()
