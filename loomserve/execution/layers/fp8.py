"""FP8 (e4m3) weights: `--quantization fp8`, the CUDA path for Hopper/Ada-class GPUs.

Format: weight float8_e4m3fn [N, K], one fp32 scale per output row (w[n, k] = q[n, k] * s[n],
s = max_k |w[n, k]| / 448), as vLLM's FP8 W8A8 "channel" scheme and llm-compressor's
FP8_DYNAMIC store it. Two products, chosen once per device (`scaled_mm_ok`):
- w8a8: activations quantized per token at run time (a = max|x| / 448 per row, x / a in
  e4m3), then torch._scaled_mm with row-wise scales: fp8 tensor cores, fp32 accumulation,
  the output in the model dtype. No host sync: every step is a device op (CUDA-graph safe).
- weight-only: q upcast to the activation dtype, scaled, then F.linear; for GPUs without fp8
  matmuls (before sm_89) and wherever _scaled_mm refuses the shapes.
On CPU both run (torch's reference _scaled_mm), slowly: no CPU has fp8 arithmetic; there the
int8 / int4 kernels (layers/quant.py) are the fast path and fp8 exists for parity tests.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers.quant import set_module

log = logging.getLogger("loomserve.execution")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
ALIGN = 16  # _scaled_mm wants K and N multiples of 16 (cuBLASLt / CUTLASS fp8 alignment)
_probe: dict[tuple[torch.device, torch.dtype], bool] = {}


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [N, K] -> (q e4m3 [N, K], s fp32 [N]) with per-row s = max|w| / 448
    (an all-zero row gets s = 1: q is zeros either way)."""
    wf = w.detach().to(torch.float32)
    s = wf.abs().amax(-1) / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (wf / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), s.contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (e4m3 [M, K], fp32 [M, 1]): a per-token scale, computed on the
    device (no host round trip)."""
    xf = x.to(torch.float32)
    a = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / a).clamp(-FP8_MAX, FP8_MAX).to(FP8), a


def _out_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    # Row-wise scaled fp8 GEMMs on CUDA write bf16 only; CPU's reference writes any float.
    return torch.bfloat16 if device.type == "cuda" else dtype


def scaled_mm_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm runs row-wise scaled fp8 here: probed once per device (a
    16x32x16 product checked against its float value), so an unsupported GPU or torch build
    takes the weight-only path instead of failing mid-serve."""
    key = (device, dtype)  # a tuple, not a formatted string: this runs on every product
    if key not in _probe:
        _probe[key] = _probe_scaled_mm(device, dtype)
    return _probe[key]


def _probe_scaled_mm(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 32, generator=g).to(device)
        w = torch.randn(16, 32, generator=g).to(device)
        xq, a = quantize_rows(x)
        wq, s = quantize_fp8(w)
        y = torch._scaled_mm(xq, wq.t(), scale_a=a, scale_b=s.unsqueeze(0),
                             out_dtype=_out_dtype(device, dtype))
        ref = (xq.float() * a) @ (wq.float() * s.unsqueeze(-1)).t()
        return bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2))
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        log.warning("fp8: torch._scaled_mm unavailable on %s (%s); weights stay fp8, products "
                    "run weight-only", device, exc)
        return False


class Fp8Linear(nn.Module):
    """A frozen linear layer over an e4m3 weight with per-row scales (see the module docstring).
    `dtype` is the activations' dtype: outputs come back in it."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        if q.dtype != FP8 or q.dim() != 2 or tuple(scales.shape) != (q.shape[0],):
            raise ValueError(f"want e4m3 q [N, K] and fp32 scales [N], got {q.dtype} "
                             f"{tuple(q.shape)} and {tuple(scales.shape)}")
        self.out_features, self.in_features = q.shape
        self.dtype = dtype
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("weight_scale", scales.to(torch.float32).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).contiguous())
        self.aligned = self.in_features % ALIGN == 0 and self.out_features % ALIGN == 0

    @classmethod
    def from_float(cls, linear: nn.Linear) -> "Fp8Linear":
        q, s = quantize_fp8(linear.weight)
        return cls(q, s, linear.bias, linear.weight.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.weight_scale.unsqueeze(-1)).to(dtype)

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def w8a8(self) -> bool:
        """Whether forward runs the fp8 x fp8 product (else weight-only)."""
        return self.aligned and scaled_mm_ok(self.weight.device, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.w8a8():
            xq, a = quantize_rows(x2)
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=a, scale_b=self.weight_scale.unsqueeze(0),
                                 out_dtype=_out_dtype(x.device, x.dtype)).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
        else:
            w = self.weight.to(x.dtype) * self.weight_scale.to(x.dtype).unsqueeze(-1)
            y = F.linear(x2, w, self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fp8=e4m3, scales=per-row, bias={self.bias is not None}")


# Routers pick experts (a rounding flip changes which weights run) and the LM head sets every
# logit: both stay in the model dtype, as vLLM's fp8 mode keeps them.
_KEEP_FLOAT = ("router", "gate", "shared_expert_gate", "lm_head")


def quantize_fp8_linears(model: nn.Module) -> dict[str, int]:
    """Replace every nn.Linear of `model` but routers and the LM head by an Fp8Linear.
    Returns counts {"quantized", "float"}."""

    counts, new = {"quantized": 0, "float": 0}, None
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear):
            continue
        if name.rpartition(".")[2] in _KEEP_FLOAT:
            counts["float"] += 1
            continue
        new = Fp8Linear.from_float(mod)
        set_module(model, name, new)
        counts["quantized"] += 1
    if new is None:
        return counts
    # Probe here, at load: never inside a CUDA graph capture (the probe syncs once).
    w8a8 = scaled_mm_ok(new.weight.device, new.dtype)
    log.info("fp8: %d linears in e4m3, %s products", counts["quantized"],
             "fp8 x fp8 (torch._scaled_mm)" if w8a8 else "weight-only")
    if new.weight.device.type == "cpu":
        log.warning("--quantization fp8 on CPU runs torch's reference fp8 products (slow); "
                    "int8 / int4 are the CPU's fast quantized paths")
    return counts
