"""The CUDA backend: Triton kernels that read the paged KV in place (triton_kernels.py).

What `auto` picks on CUDA. FlashInfer and FlashAttention paged kernels would be further backends
behind this interface; vLLM's triton_attn and SGLang's triton backend are this same design for
devices without them. Per step and KV group, built on the first layer and kept in meta.derived:
- decodes: key counts, the block tables padded to the longest as one [decodes, width] int32
  tensor (one host-to-device copy a step, O(total blocks): ~2 MB for 64 decodes at 128K, as
  vLLM copies its table), and the context split (flash-decoding): enough splits that
  decodes x kv heads x splits fill the device; each decode divides its own keys in the kernel,
  none shorter than MIN_SPLIT_KEYS. Each split writes (acc, max, sum); a merge kernel combines
  them exactly, the sink joining there.
- prefill chunks: tiles of a few tokens whose rows are tokens x the GQA group's query heads
  (each K/V tile loaded once per group), the chunks' tables padded, and a context split where
  few tiles cover a long context (a warm turn's short tail over a cached prefix), merged by
  the decode merge kernel. A chunk's own K/V is read back from the pages (paged_attention
  wrote it first), so fresh and continued chunks run the same kernel, causal and windowed.
On a CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1), which the tests use.
"""

from __future__ import annotations

import numpy as np
import torch

from loomserve.execution.attention.metadata import AttentionMetadata, to_device

MIN_SPLIT_KEYS = 256
MAX_SPLITS = 64


def available(device: torch.device) -> bool:
    """Triton importable, and a CUDA device (or the interpreter, on any device)."""
    try:
        import triton  # noqa: F401
        from triton import knobs
    except ImportError:
        return False
    return device.type == "cuda" or bool(knobs.runtime.interpret)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


class TritonBackend:
    name = "triton"

    def __init__(self, device: torch.device) -> None:
        from loomserve.execution.attention import triton_kernels

        self.k = triton_kernels
        cuda = device.type == "cuda"
        sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 2
        self.programs = 2 * sms  # programs a decode call aims for
        from triton import knobs
        self.interpreted = bool(knobs.runtime.interpret)

    def _ieee(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 or self.interpreted

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                sinks: torch.Tensor | None) -> torch.Tensor:
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("triton attention needs the head dim innermost in the KV pages")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        group = q.shape[1] // k.shape[1]
        sinks = None if sinks is None else sinks.to(device=q.device, dtype=torch.float32)
        if meta.num_decode:
            self._decode(q, k_cache, v_cache, meta, scale, group, sinks, out)
        if meta.prefills:
            self._prefill(q, k_cache, v_cache, meta, scale, group, sinks, out)
        return out

    # --- decode ---------------------------------------------------------------------------

    def _decode_plan(self, meta: AttentionMetadata, kv_heads: int):
        """(tables, key counts, splits): the splits a decode of the longest context would use;
        each decode divides its own keys in the kernel."""
        got = meta.derived.get("triton_decode")
        if got is not None:
            return got
        lens = meta.decode_lens.astype(np.int64)
        table = _padded([t[:n] for t, n in zip(meta.decode_tables, -(-lens // meta.block_size))])
        w = meta.sliding_window
        longest = max(1, int((lens if w is None else np.minimum(lens, w)).max()))
        got = (to_device(table, meta.device),
               to_device(meta.decode_lens.astype(np.int32), meta.device),
               min(-(-longest // MIN_SPLIT_KEYS), self.splits_for(len(lens), kv_heads)))
        meta.derived["triton_decode"] = got
        return got

    def splits_for(self, decodes: int, kv_heads: int) -> int:
        """Most splits per decode: enough that decodes x kv heads x splits fill the device."""
        return max(1, min(MAX_SPLITS, -(-self.programs // (decodes * kv_heads))))

    def _decode(self, q, k_cache, v_cache, meta, scale, group, sinks, out) -> None:
        d, heads, hd = meta.num_decode, q.shape[1], q.shape[2]
        kv_heads = heads // group
        table, lens, splits = self._decode_plan(meta, kv_heads)
        cfg = decode_config(group, hd, meta.sliding_window is not None, self._ieee(q.dtype),
                            fp8_code(k_cache.dtype))
        k_cache, v_cache = _bytes(k_cache), _bytes(v_cache)
        hd_pad = cfg["HD_PAD"]
        acc = torch.empty((d, heads, splits, hd_pad), dtype=torch.float32, device=q.device)
        ml = torch.empty((d, heads, splits, 2), dtype=torch.float32, device=q.device)
        self.k.decode_split[(d, kv_heads, splits)](
            q, k_cache, v_cache, table, lens, acc, ml,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            table.stride(0), scale, meta.sliding_window or 0, meta.block_size, splits, **cfg)
        self.k.decode_merge[(d, heads)](
            acc, ml, sinks if sinks is not None else acc, out, out.stride(0), out.stride(1),
            splits, heads, **merge_config(hd, sinks is not None))

    # --- prefill --------------------------------------------------------------------------

    def _prefill_plan(self, meta: AttentionMetadata, tokens_per_tile: int, kv_heads: int):
        """(tiles, tables, splits): tiles of up to tokens_per_tile tokens (first row, tokens,
        first position, chunk); the chunks' tables padded; the context split, so that tiles x
        kv heads x splits fill the device where few tiles cover a long context (a warm turn's
        tail over a cached prefix), none under MIN_SPLIT_KEYS keys."""
        got = meta.derived.get("triton_prefill")
        if got is not None:
            return got
        bs, tiles, tabs, longest = meta.block_size, [], [], 1
        for i, c in enumerate(meta.prefills):
            n = c.end - c.start
            tiles += [(c.start + r, min(tokens_per_tile, n - r), c.start_pos + r, i)
                      for r in range(0, n, tokens_per_tile)]
            tabs.append(c.table[:-(-(c.start_pos + n) // bs)])
            w = meta.sliding_window
            longest = max(longest, c.start_pos + n if w is None else min(c.start_pos + n, w + n))
        splits = min(-(-longest // MIN_SPLIT_KEYS), self.splits_for(len(tiles), kv_heads))
        got = (to_device(np.array(tiles, dtype=np.int32).reshape(-1, 4), meta.device),
               to_device(_padded(tabs), meta.device), splits)
        meta.derived["triton_prefill"] = got
        return got

    def _prefill(self, q, k_cache, v_cache, meta, scale, group, sinks, out) -> None:
        heads, hd = q.shape[1], q.shape[2]
        kv_heads = heads // group
        ieee = self._ieee(q.dtype)
        shape = prefill_config(group, hd, False, False, False, ieee)  # the tile's rows
        tiles, table, splits = self._prefill_plan(meta, shape["BLOCK_M"] // shape["G_PAD"],
                                                  kv_heads)
        cfg = prefill_config(group, hd, meta.sliding_window is not None, sinks is not None,
                             splits > 1, ieee, fp8_code(k_cache.dtype))
        k_cache, v_cache = _bytes(k_cache), _bytes(v_cache)
        first = meta.prefills[0].start
        n = out.shape[0] - first
        part_acc = part_ml = out
        if splits > 1:
            part_acc = torch.empty((n, heads, splits, cfg["HD_PAD"]), dtype=torch.float32,
                                   device=q.device)
            part_ml = torch.empty((n, heads, splits, 2), dtype=torch.float32, device=q.device)
        sink_arg = sinks if sinks is not None else q
        self.k.prefill_split[(tiles.shape[0], kv_heads, splits)](
            q, k_cache, v_cache, out, table, tiles, sink_arg, part_acc, part_ml,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3], table.stride(0),
            scale, meta.sliding_window or 0, meta.block_size, first, splits, heads, **cfg)
        if splits > 1:
            self.k.decode_merge[(n, heads)](
                part_acc, part_ml, sink_arg, out[first:], out.stride(0), out.stride(1),
                splits, heads, **merge_config(hd, sinks is not None))


_FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def fp8_code(cache: torch.dtype) -> int:
    """The kernels' KV_FP8: 0 (a cache dtype Triton loads), 1 float8_e4m3fn, 2 float8_e5m2."""
    return _FP8_CODES.get(cache, 0)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """An 8-bit float cache as uint8 (same strides): the kernels widen its codes by bits, so
    they run alike on GPUs without native fp8 loads (sm_80) and under the interpreter."""
    return cache.view(torch.uint8) if fp8_code(cache.dtype) else cache


def decode_config(group: int, hd: int, window: bool, ieee: bool, kv_fp8: int = 0) -> dict:
    """decode_split's compile-time parameters: the group's query heads padded to a tl.dot's
    16 rows, the head dim to a power of two, 64-key tiles (32 for fp32 products, whose FMA
    lowering needs more registers). Compiled for sm_90 (tests/execution/triton_ahead.py):
    bf16 59-119 registers, no spills."""
    return {"GROUP": group, "G_PAD": _pow2(group), "HD": hd, "HD_PAD": _pow2(hd),
            "BLOCK_N": 32 if ieee else 64, "MIN_SPLIT": MIN_SPLIT_KEYS, "HAS_WINDOW": window,
            "IEEE": ieee, "KV_FP8": kv_fp8}


def prefill_config(group: int, hd: int, window: bool, sink: bool, split: bool,
                   ieee: bool, kv_fp8: int = 0) -> dict:
    """prefill_split's: 64 query rows (tokens x group heads; 32 for head dims over 128, at
    least one token's group), 64-key tiles; fp32 products 16 rows x 32 keys (their FMA
    lowering spills at 64 x 64); the sink in the initial state unless split (then the merge
    adds it). sm_90, bf16: 126-237 registers, no spills."""
    hd_pad, g_pad = _pow2(hd), _pow2(group, 1)
    rows = 16 if ieee else 64 if hd_pad <= 128 else 32
    return {"GROUP": group, "G_PAD": g_pad, "HD": hd, "HD_PAD": hd_pad,
            "BLOCK_M": max(g_pad, rows), "BLOCK_N": 32 if ieee else 64,
            "HAS_WINDOW": window, "SINK_INIT": sink and not split, "SPLIT": split, "IEEE": ieee,
            "KV_FP8": kv_fp8}


def merge_config(hd: int, sink: bool) -> dict:
    return {"HD": hd, "HD_PAD": _pow2(hd), "HAS_SINK": sink}


def _padded(rows: list[np.ndarray]) -> np.ndarray:
    """int32 [len(rows), longest] with zeros after each row (never read: keys past a row's
    count are masked before their block id is used)."""
    out = np.zeros((len(rows), max(1, max(len(r) for r in rows))), dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out
