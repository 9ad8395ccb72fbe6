"""Fused elementwise ops of a decoder layer, each one C call (kernels/fused.c) instead of 4-8
small torch kernels: residual add + RMSNorm, RoPE on q and k in place, SiLU(gate) * up.

Every op has its torch reference beside it and falls back to it whenever the C kernel does not
apply: kernels off (LOOMSERVE_KERNELS=0) or not built, `USE` False (LOOMSERVE_FUSED=0), a device other than the
CPU, a dtype other than fp32/bf16, a layout the kernel lacks. The reference is the exact
composition the model code ran before this module (same ops, same rounding points).

Invariants: the C path gives the reference's values up to fp32 summation order and FMA
contraction (fp32), or bit for bit but for an occasional expf ulp (bf16). `calls` counts the
C calls per op, so tests can assert the fused path ran.
"""

from __future__ import annotations

import ctypes
import os
from collections import Counter

import torch
from torch.nn import functional as F

from loomserve.execution import kernels

# LOOMSERVE_FUSED=0 keeps the torch ops (and LOOMSERVE_KERNELS=0 every C kernel); benchmarks
# flip USE to time the torch path in the same process.
USE = os.environ.get("LOOMSERVE_FUSED", "1") not in ("0", "false", "no")
calls: Counter = Counter()
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_NORM_SCALE_FP32, _NORM_ZERO_CENTERED = 1, 2
_lib: ctypes.CDLL | None = None
_loaded = False

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


def library() -> ctypes.CDLL | None:
    """The bound kernel library, or None when the torch path must run."""
    global _lib, _loaded
    if not _loaded:
        lib = kernels.load("fused")
        if lib is not None:
            lib.rms_norm.argtypes = [_P, _L, _P, _P, _P, _P, _L, _L, _F, _I, _I, _I]
            lib.rope_inplace.argtypes = [_P, _L, _L, _L, _L, _P, _P, _P, _P, _L, _F, _I, _I, _I]
            lib.silu_and_mul.argtypes = [_P, _L, _P, _L, _L, _I, _I]
            for fn in (lib.rms_norm, lib.rope_inplace, lib.silu_and_mul):
                fn.restype = None
        _lib, _loaded = lib, True
    return _lib if USE else None


def _code(*ts: torch.Tensor) -> int | None:
    """The kernel's dtype code when every tensor is a CPU tensor of one supported dtype.
    (is_cpu, not device.type: the latter costs ~1 us a tensor, more than the kernel.)"""
    dtype = ts[0].dtype
    for t in ts:
        if not t.is_cpu or t.dtype != dtype:
            return None
    return _DTYPES.get(dtype)


# --- RMSNorm (+ residual) ---------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, flags: int = 0,
             residual: torch.Tensor | None = None, reference=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(x + residual) * w, x + residual) over the last dim, vLLM's fused_add_rms_norm;
    without residual: (norm(x) * w, None). flags: norm_flags(...) of the variant. x is consumed:
    on the C path its buffer receives the sum (so no tensor is written but the one it hands
    over). `reference(h)` is the torch norm to fall back to (the module's own forward).
    The checks are inlined: on a decode row they cost as much as the kernel."""
    lib = library()
    dtype = x.dtype
    if (lib is not None and x.is_cpu and x.dim() == 2 and x.stride(1) == 1 and weight.dtype == dtype
            and weight.is_cpu and weight.is_contiguous() and weight.shape == x.shape[1:]
            and (residual is None or (residual.dtype == dtype and residual.is_cpu and residual.is_contiguous()
                                      and x.is_contiguous() and residual.shape == x.shape))):
        code = _DTYPES.get(dtype)
        if code is not None:
            n, d = x.shape
            out = torch.empty_like(x) if residual is not None else torch.empty((n, d), dtype=dtype)
            ptr = x.data_ptr()
            lib.rms_norm(ptr, x.stride(0), None if residual is None else residual.data_ptr(), ptr, weight.data_ptr(),
                         out.data_ptr(), n, d, eps, code, flags, torch.get_num_threads())
            calls["rms_norm"] += 1
            return out, None if residual is None else x
    if residual is not None:
        x = residual = residual + x
    return reference(x), residual


# --- RoPE ---------------------------------------------------------------------------------------

def rope_qk_(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, half: int,
             q_norm=None, k_norm=None, q_heads: int = 0) -> bool:
    """Rotate the first `heads` heads of qkv ([tokens, all heads, head_dim], rows contiguous)
    in place; cos/sin: [tokens, 1, head_dim] (RotaryEmbedding.lookup). With q_norm/k_norm
    (ungated RMSNorm modules over head_dim), heads 0..q_heads-1 are first normalized by q_norm,
    the rest by k_norm, in the same call. False (nothing done) when the kernel does not apply:
    the caller then runs the torch ops (norms, rotary.apply_rope)."""
    lib = library()
    if lib is None:
        return False
    n, _, d = qkv.shape
    code = _code(qkv, cos, sin)
    if (code is None or d != 2 * half or d > 1024 or qkv.stride(2) != 1 or qkv.stride(1) != d
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.shape != (n, 1, d) or sin.shape != (n, 1, d)):
        return False
    wq = wk = None
    eps, flags = 0.0, 0
    if q_norm is not None:
        if not _head_norms_fit(q_norm, k_norm, qkv.dtype, d):
            return False
        wq, wk, eps = q_norm.weight.data_ptr(), k_norm.weight.data_ptr(), q_norm.eps
        flags = norm_flags(q_norm.scale_in_fp32, q_norm.zero_centered)
    lib.rope_inplace(qkv.data_ptr(), qkv.stride(0), n, heads, d, cos.data_ptr(), sin.data_ptr(), wq, wk, q_heads,
                     eps, flags, code, torch.get_num_threads())
    calls["rope"] += 1
    return True


def _head_norms_fit(q_norm, k_norm, dtype: torch.dtype, d: int) -> bool:
    """Both norms plain (ungated, ungrouped), alike, over d, with weights of the model dtype."""
    return all(m.gate is None and m.groups == 1 and m.weight.dtype == dtype and m.weight.shape == (d,)
               and m.weight.is_contiguous() and m.weight.is_cpu for m in (q_norm, k_norm)) and (
        q_norm.eps == k_norm.eps and q_norm.scale_in_fp32 == k_norm.scale_in_fp32
        and q_norm.zero_centered == k_norm.zero_centered)


def norm_flags(scale_in_fp32: bool, zero_centered: bool) -> int:
    """The kernel's flags for an RMSNorm variant (layers/norm.py's options)."""
    return (_NORM_SCALE_FP32 if scale_in_fp32 else 0) | (_NORM_ZERO_CENTERED if zero_centered else 0)


# --- SiLU(gate) * up ------------------------------------------------------------------------------

def silu_and_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate_up[..., :inter]) * gate_up[..., inter:], rounded as torch's two kernels."""
    lib = library()
    code = None if lib is None else _code(gate_up)
    if code is None or gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[-1] != 2 * inter:
        gate, up = gate_up.split(inter, dim=-1)
        return F.silu(gate) * up
    n = gate_up.shape[0]
    out = torch.empty((n, inter), dtype=gate_up.dtype)
    lib.silu_and_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), n, inter, code, torch.get_num_threads())
    calls["silu_and_mul"] += 1
    return out
