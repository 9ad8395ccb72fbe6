"""The CPU backend: attention that reads the paged KV in place, without dense masks.

- Decodes: one C kernel call per layer (kernels/paged_attention.c) walks each sequence's block
  table where the pages lie, split over the context with a flash-style online softmax; it takes
  pointers to the runner's int32 tables and the key counts, nothing padded, nothing masked.
- Prefill chunks: the chunk's own keys run through torch's flash-attention CPU kernel with the
  causal mask (top-left aligned, which is exact for a chunk's own keys); the cached context
  before the chunk is visible to every query of the chunk, so it runs maskless in tiles of
  TILE_TOKENS keys, each tile gathered into a bounded workspace (the flash kernel needs dense
  tiles; a tile is reused by every query of the chunk, so the copy is small beside the FLOPs).
  Partial results merge by their log-sum-exp, the attention sink (gpt-oss) joining the
  denominator at the end.
- Sliding-window prefill chunks take the torch backend (its cost is bounded by the window).
Anything the kernel cannot take (a cache dtype or layout it lacks) falls back to the torch
backend for that call, so results never depend on the path.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from loomserve.execution import kernels
from loomserve.execution.attention import torch_backend
from loomserve.execution.attention.metadata import AttentionMetadata, PrefillChunk

TILE_TOKENS = 8192
SERIAL_WORK = 4096  # keys x query heads below which a decode call runs on one thread
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def load_library() -> ctypes.CDLL | None:
    lib = kernels.load("paged_attention")
    if lib is not None and not getattr(lib, "_typed", False):
        p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        lib.paged_decode.argtypes = [p, p, p, i64, i, i, i, i, i, p, p, i, p, f, p, p, i, i, i, i]
        lib.paged_decode.restype = ctypes.c_int
        lib._typed = True
    return lib


class CpuPagedBackend:
    name = "cpu_paged"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.scratch = torch.empty(0)
        self.calls = {"decode_kernel": 0, "decode_fallback": 0, "prefill_tiled": 0,
                      "prefill_fallback": 0}  # what ran (tests check the kernel really did)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                sinks: torch.Tensor | None) -> torch.Tensor:
        d = meta.num_decode
        group = q.shape[1] // k.shape[1]
        if not meta.prefills:
            return self.decode(q, k_cache, v_cache, meta, scale, group, sinks)
        out = torch.empty_like(q)
        if d:
            out[:d] = self.decode(q[:d], k_cache, v_cache, meta, scale, group, sinks)
        for c in meta.prefills:
            out[c.start:c.end] = self.prefill(q, k, v, k_cache, v_cache, meta, c, scale, group, sinks)
        return out

    # --- decode ---------------------------------------------------------------------------

    def _decode_plan(self, meta: AttentionMetadata, kv_heads: int, heads: int):
        """Per step and group: table pointers, key counts and the split of the context."""
        key = ("cpu_decode", kv_heads, heads)
        got = meta.derived.get(key)
        if got is not None:
            return got
        lens = meta.decode_lens
        ptrs = np.fromiter((t.ctypes.data for t in meta.decode_tables), dtype=np.uint64,
                           count=len(lens))
        w = meta.sliding_window
        span = int(lens.max()) if w is None else min(int(lens.max()), w)
        # One thread below SERIAL_WORK (~50 us of work): a team's fork and join would cost
        # as much. Else enough tasks to keep every thread busy to the end, splits of at least
        # 256 keys.
        work = (int(lens.sum()) if w is None else len(lens) * span) * heads
        threads = 1 if work < SERIAL_WORK else torch.get_num_threads()
        per_seq = math.ceil(8 * threads / (len(lens) * kv_heads))
        split = max(256, math.ceil(span / per_seq))
        got = (ptrs, lens, split, math.ceil(span / split), threads)
        meta.derived[key] = got
        return got

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, group: int,
               sinks: torch.Tensor | None) -> torch.Tensor:
        out = self._kernel_decode(q, k_cache, v_cache, meta, scale, group, sinks)
        if out is None:
            self.calls["decode_fallback"] += 1
            return torch_backend.decode(q, k_cache, v_cache, meta, scale, group, sinks)
        self.calls["decode_kernel"] += 1
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def decode_lse(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                   group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp32 (out, lse) of the decode rows (decode context parallelism's partials), or None
        where the kernel cannot run. A row with no keys gets out 0 and lse -inf. The LSE comes
        from the kernel's per-split partials left in scratch: lse = logsumexp(max + log sum)."""
        out = self._kernel_decode(q, k_cache, v_cache, meta, scale, group, None)
        if out is None:
            return None
        d, heads, hd = q.shape
        kv_heads = heads // group
        _, lens, split, max_splits, _ = self._decode_plan(meta, kv_heads, heads)
        part = self.scratch[:d * kv_heads * max_splits * group * (hd + 2)].view(
            d, kv_heads, max_splits, group, hd + 2)
        nsplit = torch.from_numpy((lens.astype(np.int64) + split - 1) // split)
        stale = torch.arange(max_splits)[None, :] >= nsplit[:, None]  # splits not written
        logl = (part[..., hd] + torch.log(part[..., hd + 1])).masked_fill(
            stale[:, None, :, None], float("-inf"))
        lse = torch.logsumexp(logl, dim=2).reshape(d, heads)
        return out.masked_fill_(torch.isinf(lse).unsqueeze(-1), 0.0), lse

    def _kernel_decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                       group: int, sinks: torch.Tensor | None) -> torch.Tensor | None:
        """The C kernel's fp32 output, or None where it cannot run (then the torch path)."""
        d, heads, head_dim = q.shape
        kv_heads = heads // group
        code = _DTYPES.get(k_cache.dtype)
        inner = (kv_heads * head_dim, head_dim, 1)
        if (code is None or q.device.type != "cpu" or k_cache.stride()[1:] != inner
                or v_cache.stride() != k_cache.stride()):
            return None
        ptrs, lens, split, max_splits, threads = self._decode_plan(meta, kv_heads, heads)
        qf = q.float().contiguous()
        out = torch.empty((d, heads, head_dim), dtype=torch.float32)
        need = d * kv_heads * max_splits * group * (head_dim + 2)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(max(need, 2 * self.scratch.numel()), dtype=torch.float32)
        sk = None if sinks is None else sinks.float().contiguous()
        rc = self.lib.paged_decode(
            kernels.ptr(qf), kernels.ptr(k_cache), kernels.ptr(v_cache), k_cache.stride(0),
            k_cache.shape[1], kv_heads, head_dim, heads, d, ptrs.ctypes.data, lens.ctypes.data,
            meta.sliding_window or 0, None if sk is None else kernels.ptr(sk), scale,
            kernels.ptr(out), kernels.ptr(self.scratch), max_splits, split, code, threads)
        return out if rc == 0 else None

    # --- prefill --------------------------------------------------------------------------

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, c: PrefillChunk,
                scale: float, group: int, sinks: torch.Tensor | None) -> torch.Tensor:
        if meta.sliding_window is not None or q.device.type != "cpu":
            self.calls["prefill_fallback"] += 1
            return torch_backend.prefill(q, k, v, k_cache, v_cache, meta, c, scale, group, sinks)
        self.calls["prefill_tiled"] += 1
        qc = q[c.start:c.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
        kc = k[c.start:c.end].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, hd]
        vc = v[c.start:c.end].transpose(0, 1).unsqueeze(0)
        o, lse = _flash(qc, kc, vc, 0.0, True, scale=scale)
        if c.start_pos > 0 or sinks is not None:
            o = o.float()
        for a in range(0, c.start_pos, TILE_TOKENS):
            kt, vt = _tile(meta, c, k_cache, v_cache, a, min(a + TILE_TOKENS, c.start_pos))
            ot, lt = _flash(qc, kt, vt, 0.0, False, scale=scale)
            o, lse = _merge(o, lse, ot.float(), lt)
        if sinks is not None:
            # softmax over [scores, sink]: scale by e^lse / (e^lse + e^sink).
            o = o * torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1)
        return o[0].transpose(0, 1).to(q.dtype)


def _tile(meta: AttentionMetadata, c: PrefillChunk, k_cache, v_cache, a: int, b: int):
    """Keys [a, b) of the chunk's context as [1, kv_heads, b - a, head_dim] views."""
    bs = meta.block_size
    blocks = torch.from_numpy(c.table[a // bs:(b + bs - 1) // bs].astype(np.int64))
    kb, vb = torch_backend.workspace(meta).gather(k_cache, v_cache, blocks)
    lo = a - (a // bs) * bs
    kt = kb.flatten(0, 1)[lo:lo + b - a].transpose(0, 1).unsqueeze(0)
    vt = vb.flatten(0, 1)[lo:lo + b - a].transpose(0, 1).unsqueeze(0)
    return kt, vt


def _merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Two softmax-normalized partials over disjoint keys -> their joint result."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse
