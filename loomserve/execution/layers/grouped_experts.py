"""Grouped MoE experts: every routed expert of a MoE layer in one call, not a Python loop.

The layer's (token, slot) pairs are sorted by expert once; each expert then runs its up
product, the activation and its down product over its contiguous rows, and the weighted outputs
are summed per token (fp32, slot order). Activations (ACTS): "swiglu" (w1 [E, 2I, H], gate rows
then up rows: SiLU(gate) * up) and "relu2" (w1 [E, I, H]: relu(up)^2); w2 [E, H, I]. Where:
- CPU, fp32 or bf16 stacks: kernels/moe.c, one C call per layer (OpenMP over (expert, weight
  tile) items, dense.c's row kernels; bf16 weights widened in registers, fp32 accumulation);
  fp32 steps averaging FP32_LOOP_ROWS rows per expert or more keep the loop (MKL is faster).
- CUDA, bf16 stacks, compute capability 9.0+: torch._grouped_mm for both products (its
  contract: bf16, int32 end offsets, the second operand "column-major", i.e. [E, N, K] stacks
  transposed as views, dims multiples of 16 bytes), torch for the rest.
- anywhere else (no compiler, other dtypes or devices, USE off: LOOMSERVE_GROUPED_MOE=0):
  `usable` says False and the caller keeps its per-expert loop.

Why a C kernel and not torch._grouped_mm on the CPU (torch 2.13): the op exists there (fp32
and bf16, exact), but it runs group by group through torch's dense GEMM and timed as our loop
of F.linear did (2-vCPU AMD EPYC, AVX2, a Qwen3-30B-A3B layer's gate_up at 1-512 tokens: within
noise of the loop at every size, 0.8-19 GB/s of weights in fp32 and 0.3-2.4 GB/s in bf16, whose
GEMM has no fast path without AVX-512-BF16). The kernel streams each touched expert's weights
once per call, reusing dense.c's decode tiles; benchmarks/moe_grouped.py has its figures.

Invariants: inputs are not modified; the result is [tokens, width] fp32 (the caller casts);
pairs whose expert lies outside [first, first + E) add nothing (DEP: other ranks' experts);
fp32 results equal the loop's up to summation order, bf16 ones are closer to fp32 than the
loop's (no bf16 rounding between the products).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from loomserve.execution import kernels

# LOOMSERVE_GROUPED_MOE=0 keeps the per-expert loop; benchmarks and tests flip USE in-process.
USE = os.environ.get("LOOMSERVE_GROUPED_MOE", "1") not in ("0", "false", "no")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ACTS = {"swiglu": 0, "relu2": 1}
# fp32 experts averaging this many rows are faster through torch's GEMM (MKL) one by one:
# Qwen3-30B-A3B layer, 1 thread, 2-vCPU AMD EPYC: 32 rows/expert 2.09 s grouped vs 1.72 s
# loop; 8 rows/expert 0.60 vs 0.81 s (benchmarks/results/moe_grouped-1thread.json). bf16
# has no fast torch GEMM without AVX-512-BF16: grouped at every size there.
FP32_LOOP_ROWS = 24
calls = 0  # run() calls, so tests can assert a block took this path
_P, _I64, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _lib():
    argtypes = [_P, _P, _I64, _I64, _I64, _P, _P, _I32, _I32, _P, _P, _P, _P, _I64, _I64, _P,
                _I32]
    return kernels.bind("moe", {"grouped_experts": (argtypes, None)})


def _cuda_grouped(t: torch.Tensor) -> bool:
    return (t.device.type == "cuda" and t.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


def usable(act: str, w1: torch.Tensor, w2: torch.Tensor, pairs: int = 0) -> bool:
    """Whether run() takes these stacks (w1 [E, 2I or I, H], w2 [E, H, I]) and activation, and
    is the faster way for this many (token, expert) pairs."""
    if not USE or act not in ACTS or w1.dtype != w2.dtype or w1.device != w2.device:
        return False
    if not (w1.is_contiguous() and w2.is_contiguous()):
        return False
    if w1.device.type == "cpu":
        if w1.dtype == torch.float32 and pairs >= FP32_LOOP_ROWS * w1.shape[0]:
            return False
        return w1.dtype in _DTYPES and _lib() is not None
    return _cuda_grouped(w1) and w2.shape[1] % 8 == 0 and w2.shape[2] % 8 == 0


def _sort_pairs(ids: torch.Tensor, first: int, experts: int):
    """(sorted pair -> flat pair index, rows per expert, each flat pair's row or -1)."""
    flat = ids.reshape(-1).long() - first
    valid = (flat >= 0) & (flat < experts)
    key = torch.where(valid, flat, experts)  # other ranks' pairs sort last, then are dropped
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=experts + 1)[:experts]
    order = order[:int(counts.sum())]
    pos = torch.full_like(flat, -1)
    pos[order] = torch.arange(len(order), device=flat.device)
    return order, counts, pos


def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, act: str, w1: torch.Tensor,
        w2: torch.Tensor, first: int = 0) -> torch.Tensor:
    """sum_s weights[t, s] * w2[e] @ act(w1[e] @ x[t]), e = ids[t, s] - first: [tokens, width]
    fp32. Needs usable(act, w1, w2)."""
    global calls
    calls += 1
    experts, hidden, inter = w2.shape
    k, n = ids.shape[1], x.shape[0]
    order, counts, pos = _sort_pairs(ids, first, experts)
    if len(order) == 0:  # no token here (a DEP rank's dummy step, or all on other ranks)
        return torch.zeros(n, hidden, dtype=torch.float32, device=x.device)
    rows = x[torch.div(order, k, rounding_mode="floor")]
    if x.device.type != "cpu":
        return _grouped_mm_path(rows, counts, pos, weights, act, w1, w2, n, k)
    xs = rows.to(torch.float32).contiguous()
    offs = torch.zeros(experts + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offs[1:])
    a = torch.empty(len(order), inter, dtype=torch.float32)
    y = torch.empty(len(order), hidden, dtype=torch.float32)
    w = weights.to(torch.float32).contiguous()
    out = torch.empty(n, hidden, dtype=torch.float32)
    _lib().grouped_experts(xs.data_ptr(), offs.data_ptr(), experts, hidden, inter, w1.data_ptr(),
                           w2.data_ptr(), _DTYPES[w1.dtype], ACTS[act], a.data_ptr(),
                           y.data_ptr(), pos.data_ptr(), w.data_ptr(), n, k, out.data_ptr(),
                           torch.get_num_threads())
    return out


def _grouped_mm_path(rows, counts, pos, weights, act, w1, w2, n, k) -> torch.Tensor:
    """CUDA: two torch._grouped_mm over the sorted rows; the weighted sum per token in fp32."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(rows.to(w1.dtype), w1.transpose(1, 2), offs=offs)
    if act == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
    else:
        a = torch.relu(h).square()
    y = torch._grouped_mm(a.contiguous(), w2.transpose(1, 2), offs=offs)
    keep = pos >= 0
    tok = torch.div(torch.arange(n * k, device=pos.device), k, rounding_mode="floor")[keep]
    wy = y[pos[keep]].float() * weights.reshape(-1)[keep, None].float()
    return torch.zeros(n, y.shape[1], dtype=torch.float32, device=y.device).index_add_(0, tok, wy)
