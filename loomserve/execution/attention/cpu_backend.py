"""The CPU backend: attention that reads the paged KV in place, without dense masks.

- Decodes: one C kernel call per layer (kernels/paged_attention.c) walks each sequence's block
  table where the pages lie, split over the context with a flash-style online softmax; it takes
  pointers to the runner's int32 tables and the key counts, nothing padded, nothing masked.
- Prefill chunks: the chunk's own keys run through torch's flash-attention CPU kernel with the
  causal mask (top-left aligned, which is exact for a chunk's own keys); the cached context
  before the chunk is visible to every query of the chunk, so it runs maskless: for a short
  chunk (a few tokens, as a warm turn's tail or a decode leg's last token) in the decode kernel,
  the chunk's queries riding as one row's query group (each key read once, in place); else in
  tiles of TILE_TOKENS keys, each gathered into a bounded workspace (the flash kernel needs
  dense tiles; a tile is reused by every query of the chunk, so the copy is small beside the
  FLOPs). Partial results merge by their log-sum-exp, the attention sink (gpt-oss) joining the
  denominator at the end.
- Sliding-window prefill chunks (where the window binds): under a short window, one decode
  kernel call with a row per token (its key count, the window applied in the kernel), each row
  reading its window's keys in place; otherwise query tiles of T <= window - 1 tokens, each
  over three maskless key ranges: the tile's own keys (causal), the keys every query of the
  tile sees, and the window's trailing edge, seen by query r from key r on, which is causal
  with queries and keys both reversed (`_windowed`). No mask, no key outside the window.
Anything the kernel cannot take (a cache dtype or layout it lacks) falls back to the torch
backend for that call, so results never depend on the path.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from loomserve.execution import kernels
from loomserve.execution.attention import torch_backend
from loomserve.execution.attention.metadata import AttentionMetadata, PrefillChunk, first_visible

TILE_TOKENS = 8192
# A prefill chunk's cached context runs in the decode kernel (each key read once, in place) when
# its queries per kv head (chunk tokens x GQA group) are at most this; more, and the flash
# kernel's GEMMs on gathered tiles win. Measured on the 2-core AMD EPYC (SmolLM2, fp32, 6K
# context, one thread): a 2-token chunk's step 350 -> 214 ms, 8 tokens even, 16 tokens 1.1x
# slower. At most the kernel's MAX_GROUP (64).
CONTEXT_KERNEL_QUERIES = 16
# Query tile of a sliding-window prefill chunk, at most window - 1 (see _windowed).
WINDOW_TILE = 512
# The longest window whose prefill chunks run as one decode-kernel row per token, by the kernel's
# vector path (paged_decode_path: 2 AVX-512, 1 AVX2). Measured against the tiles (Intel Xeon VM,
# 2 threads, a 2,048-token chunk over 8K, fp32): AVX-512 (groups > 4) 2.0-2.4x faster at window
# 128, 1.35-1.8x at 256-512, 1.06x at 1024, 0.73x at 4096; AVX2 1.07-1.75x at 128, 0.78-1.08x
# at 256, 0.9x at 512.
ROWS_WINDOW = {2: 512, 1: 128}
SERIAL_WORK = 4096  # keys x query heads below which a decode call runs on one thread
# The most last-level cache a step's keys are assumed to keep between steps. sysfs gives the
# socket's whole L3 (480 MiB on the Intel benchmark VM, shared with other tenants), yet there a
# 67 MB KV and the 25 MB LM head read each step came back from DRAM.
RESIDENT_CAP = 64 << 20
# cache dtypes the kernel reads
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def load_library() -> ctypes.CDLL | None:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    argtypes = [p, p, p, i64, i, i, i, i, i, p, p, i, p, f, p, p, i, i, i, i]
    lib = kernels.bind("paged_attention", {"paged_decode": (argtypes, ctypes.c_int),
                                           "paged_decode_set_isa": ([i], None),
                                           "paged_decode_set_prefetch": ([i], None),
                                           "paged_decode_set_runs": ([i], None),
                                           "paged_decode_path": ([i, i], i)})
    if lib is not None and os.environ.get("LOOMSERVE_DECODE_ISA"):
        # caps the kernel's vector path (2 AVX-512, 1 AVX2, 0 portable): for A/B runs and tests
        lib.paged_decode_set_isa(int(os.environ["LOOMSERVE_DECODE_ISA"]))
    if lib is not None and os.environ.get("LOOMSERVE_DECODE_RUNS") == "0":
        # a draft's rows one task each instead of one pass over their keys: for A/B runs
        lib.paged_decode_set_runs(0)
    return lib


class CpuPagedBackend:
    name = "cpu_paged"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.scratch = torch.empty(0)
        # KV bytes of one token over every layer (the runner sets it with the pool): with the
        # last-level cache's size it picks the kernel's prefetch per step (paged_attention.c)
        self.kv_bytes_per_token = 0
        self.resident_bytes = min(kernels.llc_bytes(), RESIDENT_CAP) // 2
        self._from_dram = -1
        # what ran (tests check the kernel really did)
        self.calls = {"decode_kernel": 0, "decode_fallback": 0, "prefill_tiled": 0,
                      "prefill_fallback": 0, "prefill_context_kernel": 0, "prefill_windowed": 0,
                      "prefill_windowed_rows": 0}

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
        if got is None:
            got = _plan(meta.decode_tables, meta.decode_lens, meta.sliding_window, kv_heads, heads)
            meta.derived[key] = got
            self._set_prefetch(int(meta.decode_lens.sum()) * self.kv_bytes_per_token)
        return got

    def _set_prefetch(self, step_bytes: int) -> None:
        """Tell the kernel whether the step's keys stream from DRAM (more than resident_bytes)
        or stay in the last-level cache; it places its prefetches by that (paged_attention.c).
        The setting is process-wide, so it is set every step (another backend in the process
        may have changed it)."""
        self._from_dram = int(step_bytes > self.resident_bytes)
        self.lib.paged_decode_set_prefetch(self._from_dram)

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
        lse = self._lse(self._decode_plan(meta, heads // group, heads), d, heads, group, hd,
                        meta.sliding_window)
        return out.masked_fill_(torch.isinf(lse).unsqueeze(-1), 0.0), lse

    def _kernel_decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                       group: int, sinks: torch.Tensor | None) -> torch.Tensor | None:
        """The C kernel's fp32 output, or None where it cannot run (then the torch path)."""
        kv_heads = q.shape[1] // group
        if not _kernel_fits(q, k_cache, v_cache, kv_heads):
            return None
        plan = self._decode_plan(meta, kv_heads, q.shape[1])
        return self._run(q, k_cache, v_cache, plan, meta.sliding_window, scale, sinks)

    def _run(self, q, k_cache, v_cache, plan, window: int | None, scale: float,
             sinks: torch.Tensor | None) -> torch.Tensor | None:
        """One kernel call on a plan from _plan; q [rows, heads, head_dim]; per-split partials
        stay in scratch (see _lse)."""
        ptrs, lens, split, max_splits, threads, kv_heads = plan
        d, heads, head_dim = q.shape
        group = heads // kv_heads
        qf = q.float().contiguous()
        out = torch.empty((d, heads, head_dim), dtype=torch.float32)
        need = d * kv_heads * max_splits * group * (head_dim + 2)
        if self.scratch.numel() < need:
            self.scratch = torch.empty(max(need, 2 * self.scratch.numel()), dtype=torch.float32)
        sk = None if sinks is None else sinks.float().contiguous()
        rc = self.lib.paged_decode(
            kernels.ptr(qf), kernels.ptr(k_cache), kernels.ptr(v_cache), k_cache.stride(0),
            k_cache.shape[1], kv_heads, head_dim, heads, d, ptrs.ctypes.data, lens.ctypes.data,
            window or 0, None if sk is None else kernels.ptr(sk), scale,
            kernels.ptr(out), kernels.ptr(self.scratch), max_splits, split,
            kv_code(k_cache.dtype, q.dtype), threads)
        return out if rc == 0 else None

    def _lse(self, plan, d: int, heads: int, group: int, hd: int,
             window: int | None = None) -> torch.Tensor:
        """[d, heads] log-sum-exp of the last _run, from its per-split partials in scratch:
        lse = logsumexp(max + log sum); -inf for a row with no keys."""
        _, lens, _, max_splits, _, kv_heads = plan
        part = self.scratch[:d * kv_heads * max_splits * group * (hd + 2)].view(
            d, kv_heads, max_splits, group, hd + 2)
        nsplit = torch.from_numpy(row_splits(lens, window)[1])
        stale = torch.arange(max_splits)[None, :] >= nsplit[:, None]  # splits not written
        logl = (part[..., hd] + torch.log(part[..., hd + 1])).masked_fill(
            stale[:, None, :, None], float("-inf"))
        return torch.logsumexp(logl, dim=2).reshape(d, heads)

    def _context(self, q, k_cache, v_cache, c: PrefillChunk, scale: float, group: int):
        """A short chunk's attention over its cached context (keys < start_pos), read in place
        by the decode kernel: the chunk's queries of one kv head ride as one row's query
        group, so each key is read once for all of them (no gathered tile). Returns ([1, heads,
        n, hd], [1, heads, n]) fp32 as the flash kernel's, or None (too many queries for the
        kernel's group, or a layout it lacks: the tiled path)."""
        n, heads, hd = q.shape
        kv_heads = heads // group
        if n * group > CONTEXT_KERNEL_QUERIES or not _kernel_fits(q, k_cache, v_cache, kv_heads):
            return None
        lens = np.array([c.start_pos], dtype=np.int32)
        plan = _plan([c.table], lens, None, kv_heads, heads * n)
        # [n, kv, g, hd] -> [kv, n, g, hd]: query head j of the row reads kv head j // (n g)
        rows = q.reshape(n, kv_heads, group, hd).transpose(0, 1).reshape(1, kv_heads * n * group, hd)
        out = self._run(rows, k_cache, v_cache, plan, None, scale, None)
        if out is None:
            return None
        lse = self._lse(plan, 1, kv_heads * n * group, n * group, hd)
        out = out.view(kv_heads, n, group, hd).transpose(1, 2).reshape(1, heads, n, hd)
        lse = lse.view(kv_heads, n, group).transpose(1, 2).reshape(1, heads, n)
        return out, lse

    # --- prefill --------------------------------------------------------------------------

    def prefill(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, c: PrefillChunk,
                scale: float, group: int, sinks: torch.Tensor | None) -> torch.Tensor:
        w = meta.sliding_window
        if q.device.type != "cpu" or (w is not None and w < 2):
            self.calls["prefill_fallback"] += 1
            return torch_backend.prefill(q, k, v, k_cache, v_cache, meta, c, scale, group, sinks)
        if w is not None and c.start_pos + c.end - c.start > w:  # the window binds
            out = self._windowed_rows(q, k_cache, v_cache, meta, c, scale, group, sinks)
            if out is not None:
                self.calls["prefill_windowed_rows"] += 1
                return out
            self.calls["prefill_windowed"] += 1
            return _windowed(q, k_cache, v_cache, meta, c, scale, sinks)
        self.calls["prefill_tiled"] += 1
        qc = q[c.start:c.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, hd]
        kc = k[c.start:c.end].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, hd]
        vc = v[c.start:c.end].transpose(0, 1).unsqueeze(0)
        o, lse = _flash(qc, kc, vc, 0.0, True, scale=scale)
        if c.start_pos > 0 or sinks is not None:
            o = o.float()
        ctx = self._context(q[c.start:c.end], k_cache, v_cache, c, scale, group) \
            if c.start_pos > 0 else None
        if ctx is not None:
            self.calls["prefill_context_kernel"] += 1
            o, lse = _merge(o, lse, *ctx)
        for a in range(0, c.start_pos if ctx is None else 0, TILE_TOKENS):
            kt, vt = _tile(meta, c, k_cache, v_cache, a, min(a + TILE_TOKENS, c.start_pos), q.dtype)
            ot, lt = _flash(qc, kt, vt, 0.0, False, scale=scale)
            o, lse = _merge(o, lse, ot.float(), lt)
        return _finish(o, lse, sinks, q.dtype)

    def _windowed_rows(self, q, k_cache, v_cache, meta: AttentionMetadata, c: PrefillChunk,
                       scale: float, group: int, sinks: torch.Tensor | None) -> torch.Tensor | None:
        """A windowed chunk as one decode-kernel call, a row per token with its own key count:
        each row reads its window's keys in place. None where the kernel's path is slower than
        the tiles at this window (ROWS_WINDOW) or cannot take the call."""
        heads, hd, w = q.shape[1], q.shape[2], meta.sliding_window
        kv_heads = heads // group
        if (w > ROWS_WINDOW.get(self.lib.paged_decode_path(hd, group), 0)
                or not _kernel_fits(q, k_cache, v_cache, kv_heads)):
            return None
        key = ("cpu_window_rows", c.start, kv_heads, heads)
        plan = meta.derived.get(key)
        if plan is None:  # once per step and chunk, shared by its layers
            n = c.end - c.start
            lens = np.arange(c.start_pos + 1, c.start_pos + n + 1, dtype=np.int32)
            plan = meta.derived[key] = _plan([c.table] * n, lens, w, kv_heads, heads)
        # fp32 queries: fp32 math on any rows (as the tiles' flash kernel and merges do), not the
        # bf16 decode's weighting of V in bf16
        out = self._run(q[c.start:c.end].float(), k_cache, v_cache, plan, w, scale, sinks)
        return None if out is None else out.to(q.dtype)


def _finish(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None, dtype: torch.dtype):
    """[1, heads, n, hd] partial over every visible key -> [n, heads, hd] in dtype, the sink
    (if any) joining the softmax: scaled by e^lse / (e^lse + e^sink)."""
    if sinks is not None:
        o = o * torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1)
    return o[0].transpose(0, 1).to(dtype)


def _windowed(q, k_cache, v_cache, meta: AttentionMetadata, c: PrefillChunk, scale: float,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """A prefill chunk under a sliding window w (query at p sees keys p - w + 1 .. p), without a
    mask. Query tile [a, a + t), t <= w - 1, sees exactly: its own keys [a, a + t) causally; keys
    [a - w + 1 + t, a) all; and the edge [a - w + 1, a - w + 1 + t), where query r sees key j iff
    j >= r: reversing both makes that plain top-left causal (clipped at position 0, the reversed
    keys lose their tail, which keeps it exact). The keys [first visible, chunk end) are gathered
    once from the pages (paged_attention wrote the chunk's own rows there first)."""
    w, n, p0 = meta.sliding_window, c.end - c.start, c.start_pos
    lo = first_visible(p0, w)
    kg, vg = _tile(meta, c, k_cache, v_cache, lo, p0 + n, q.dtype)  # [1, kv_heads, keys, hd]
    qc = q[c.start:c.end].transpose(0, 1).unsqueeze(0)
    tile, outs, lses = min(w - 1, WINDOW_TILE), [], []
    for i in range(0, n, tile):
        t, a = min(tile, n - i), p0 + i
        qt = qc[:, :, i:i + t]
        o, lse = _flash(qt, kg[:, :, a - lo:a - lo + t], vg[:, :, a - lo:a - lo + t], 0.0, True,
                        scale=scale)
        o = o.float()
        x = max(a - w + 1 + t, lo)
        if x < a:  # every query of the tile sees these
            o2, l2 = _flash(qt, kg[:, :, x - lo:a - lo], vg[:, :, x - lo:a - lo], 0.0, False,
                            scale=scale)
            o, lse = _merge(o, lse, o2.float(), l2)
        x, y = max(a - w + 1, lo), a - w + 1 + t
        if x < y:  # the window's trailing edge
            o3, l3 = _flash(qt.flip(2), kg[:, :, x - lo:y - lo].flip(2),
                            vg[:, :, x - lo:y - lo].flip(2), 0.0, True, scale=scale)
            o, lse = _merge(o, lse, o3.float().flip(2), l3.flip(-1))
        outs.append(o)
        lses.append(lse)
    return _finish(torch.cat(outs, 2), torch.cat(lses, -1), sinks, q.dtype)


def _kernel_fits(q, k_cache, v_cache, kv_heads: int) -> bool:
    """The kernel takes this call: a CPU tensor, a cache dtype it reads, [.., kv_heads,
    head_dim] rows contiguous, K and V laid out alike."""
    inner = (kv_heads * q.shape[2], q.shape[2], 1)
    return (k_cache.dtype in KV_DTYPES and q.device.type == "cpu"
            and k_cache.stride()[1:] == inner and v_cache.stride() == k_cache.stride())


def kv_code(cache: torch.dtype, model: torch.dtype) -> int:
    """paged_attention.c's dtype code: 0 fp32 rows; bf16 rows 1 under a bf16 model (weighting V
    as torch's bf16 kernels do), 2 under an fp32 one (--kv-cache-dtype bfloat16: fp32 math);
    3 fp16, 4 float8_e4m3fn, 5 float8_e5m2 rows (fp32 math)."""
    if cache in _KV_CODES:
        return _KV_CODES[cache]
    return 1 if model == torch.bfloat16 else 2


_KV_CODES = {torch.float32: 0, torch.float16: 3, torch.float8_e4m3fn: 4, torch.float8_e5m2: 5}


# A row's context is cut into splits of at least MIN_SPLIT keys and at most ROW_SPLITS of them,
# by the row's own key count only (paged_attention.c row_split): never by the batch or the
# threads, so a row rounds alike in any batch (a verified draft row equals its plain decode).
MIN_SPLIT, ROW_SPLITS = 256, 16


def row_splits(lens: np.ndarray, window: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(keys per split, splits) per row, as the kernel's row_split."""
    span = lens.astype(np.int64) if window is None else np.minimum(lens, window).astype(np.int64)
    split = np.maximum(MIN_SPLIT, -(-span // ROW_SPLITS))
    return split, -(-span // split)


def _plan(tables, lens: np.ndarray, window: int | None, kv_heads: int, heads: int):
    """Table pointers, key counts and the split of the context for one kernel call:
    (ptrs, lens, split, max_splits, threads, kv_heads); split is MIN_SPLIT (each row's own
    split follows from its key count, row_splits)."""
    ptrs = np.fromiter((t.ctypes.data for t in tables), dtype=np.uint64, count=len(lens))
    span = int(lens.max()) if window is None else min(int(lens.max()), window)
    # One thread below SERIAL_WORK (~50 us of work): a team's fork and join would cost as
    # much (the thread count never changes the arithmetic: tasks are (row, split)).
    work = (int(lens.sum()) if window is None else len(lens) * span) * heads
    threads = 1 if work < SERIAL_WORK else torch.get_num_threads()
    max_splits = max(1, int(row_splits(lens, window)[1].max()))
    return ptrs, lens, MIN_SPLIT, max_splits, threads, kv_heads


def _tile(meta: AttentionMetadata, c: PrefillChunk, k_cache, v_cache, a: int, b: int,
          dtype: torch.dtype):
    """Keys [a, b) of the chunk's context as [1, kv_heads, b - a, head_dim] views in `dtype`."""
    bs = meta.block_size
    blocks = torch.from_numpy(c.table[a // bs:(b + bs - 1) // bs].astype(np.int64))
    kb, vb = torch_backend.workspace(meta).gather(k_cache, v_cache, blocks, dtype)
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
