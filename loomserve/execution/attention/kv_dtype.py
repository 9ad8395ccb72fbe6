"""The dtype K/V rows are stored in (--kv-cache-dtype) and how rows are rounded into it.

Invariants: every row written into a KV page was rounded by `to_cache` (directly, or through
`as_cached` before attention, after which the write's cast is exact), so a row read back is the
row rounded to the cache dtype once (nearest even), whichever path wrote it; the C decode stack's
stores (kernels/decode_stack.c, fp8.h) round and saturate the same way (tested equal). Attention
reads every key and value as the cache holds it, the step's own rows too (`as_cached`): a
prompt prefilled in one chunk, in several, or over a cached prefix gives the same outputs.
8-bit floats carry no scale (vLLM's default when a checkpoint ships no KV scales): values past
the format's largest finite one (448 for e4m3, 57344 for e5m2) saturate there instead of
becoming NaN or inf, as vLLM's fp8 KV writes do.
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of a CacheConfig.kv_cache_dtype name (auto: the model's)."""
    if name == "auto":
        return model_dtype
    return FP8_DTYPES.get(name) or getattr(torch, name)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES.values()


def as_cached(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows as a page of `dtype` would give them back, in rows' own dtype."""
    return rows if rows.dtype == dtype else to_cache(rows, dtype).to(rows.dtype)


def to_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rows rounded to the cache dtype (saturating for the 8-bit floats)."""
    if rows.dtype == dtype:
        return rows
    if is_fp8(dtype):
        big = torch.finfo(dtype).max
        rows = rows.clamp(-big, big)  # NaN stays NaN
    return rows.to(dtype)
