"""Dense (fp32 / bf16) linear layers on CPU: few rows through kernels/dense.c, the rest torch.

A decode step with few running sequences multiplies a handful of rows by every weight matrix:
a streaming read of the weights. torch's CPU GEMMs read them well below the bandwidth at few
rows on hosts without AVX-512-BF16 (measured in benchmarks/dense_matmul.py), so rows up to
max_rows go through the C kernel (fp32 accumulation, the weight rows read once, sequentially
per thread); more rows (prefill chunks, big batches) go through torch's GEMM (in fp32 for bf16
weights: torch's bf16 GEMM is slow without AVX-512-BF16, and the layer is only installed there).

Invariants: the weight keeps torch's [out, in] layout and values (the kernel needs it
contiguous); outputs come back in the input's dtype; where the kernel is missing, the layout
is not contiguous or the device is not the CPU, F.linear runs unchanged.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution import kernels

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _lib():
    """The dense kernel library with argtypes set, or None (then torch runs)."""
    argtypes = [_P, _I64, _I64, _P, _I32, _P, _P, _I64, _I32]
    return kernels.bind("dense", {"dense_matmul": (argtypes, None)})


def available() -> bool:
    return _lib() is not None


def kernel_fits(weight: torch.Tensor) -> bool:
    """Whether the kernel can read this weight: CPU, fp32 or bf16, [out, in] contiguous."""
    return (weight.device.type == "cpu" and weight.dtype in _DTYPES and weight.dim() == 2
            and weight.is_contiguous())


# Serial below this many weight bytes: an OpenMP team's fork and join costs a few
# microseconds, as much as reading 64 KB.
SERIAL_BYTES = 1 << 16


def _threads(weight: torch.Tensor) -> int:
    small = weight.numel() * weight.element_size() < SERIAL_BYTES
    return 1 if small else torch.get_num_threads()


def _run(lib, x: torch.Tensor, rows: int, weight: torch.Tensor, w_ptr: int, dtype: int,
         b_ptr: int | None, threads: int) -> torch.Tensor:
    """The kernel on x's rows; pointers as ints (ctypes passes them fastest)."""
    n, k = weight.shape
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.to(torch.float32).contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    lib.dense_matmul(xf.data_ptr(), rows, k, w_ptr, dtype, b_ptr, y.data_ptr(), n, threads)
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


class DenseLinear(nn.Module):
    """F.linear with a given weight and bias (the same tensors: an nn.Linear's, or a tied
    embedding as the LM head), few rows through the kernel. The weight must stay where it is
    (pointers are taken once; .to() resets them)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias
        self.max_rows = max_rows
        self._args = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else x.numel() // self.in_features
        if not 0 < rows <= self.max_rows:
            return self._many_rows(x)
        if self._args is None:  # the step's ~200 calls: no per-call checks or conversions
            lib = _lib()
            if lib is None or not kernel_fits(self.weight):
                self.max_rows = 0
                return F.linear(x, self.weight, self.bias)
            self._bias32 = None if self.bias is None else self.bias.detach().float().contiguous()
            self._args = (lib, self.weight.data_ptr(), _DTYPES[self.weight.dtype],
                          None if self._bias32 is None else self._bias32.data_ptr(),
                          _threads(self.weight))
        lib, w, dt, b, threads = self._args
        return _run(lib, x, rows, self.weight, w, dt, b, threads)

    def _many_rows(self, x: torch.Tensor) -> torch.Tensor:
        """torch's GEMM; bf16 weights in fp32 (an upcast copy per call): without AVX-512-BF16
        torch's bf16 GEMM ran 5-7x slower than MKL's fp32 one at 64-1024 rows on the AMD VM."""
        if self.weight.dtype != torch.bfloat16 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        b = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), b).to(x.dtype)

    def _apply(self, fn, *args, **kwargs):
        self._args = None  # .to() / .share_memory_() may move the weight
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel_rows<={self.max_rows}")


def replace_linears(module: nn.Module, max_rows: int) -> int:
    """Every nn.Linear under module (fp32 / bf16, contiguous) becomes a DenseLinear; returns
    how many."""
    count = 0
    for name, child in module.named_children():
        if type(child) is nn.Linear and kernel_fits(child.weight):  # not TP subclasses
            setattr(module, name, DenseLinear(child.weight, child.bias, max_rows))
            count += 1
        else:
            count += replace_linears(child, max_rows)
    return count
