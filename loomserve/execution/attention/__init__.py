"""Attention over the paged KV cache: one interface, a backend chosen per device.

`paged_attention` (called by every attention layer) writes the step's new K/V rows into their
slots, then hands the rest to the backend the metadata names. Backends:
- `cpu_paged` (cpu_backend.py): reads the pages in place with a C kernel for decodes and tiled
  flash attention for prefill chunks; the default on CPU.
- `triton` (triton_backend.py): Triton kernels that read the pages in place, split over the
  context for decodes; the default on CUDA (FlashInfer or FlashAttention paged kernels would be
  further backends behind the same interface).
- `torch` (torch_backend.py): gather + SDPA with masks; any device, the reference and fallback.
Metadata (metadata.py) is built once per step per KV group from incrementally grown block
tables (block_tables.py).
"""

from __future__ import annotations

import torch

from loomserve.execution.attention.block_tables import BlockTables, tables_from_lists
from loomserve.execution.attention.kv_dtype import as_cached
from loomserve.execution.attention.metadata import AttentionMetadata, PrefillChunk, build_metadata
from loomserve.execution.attention.torch_backend import GatherWorkspace, TorchBackend


def select_backend(name: str, device: torch.device, dtype: torch.dtype):
    """The backend for `name` (auto | cpu_paged | triton | torch) on this device; auto takes
    the in-place CPU kernel when the device is a CPU, the dtype one it has, and it builds, and
    the Triton kernels on CUDA where Triton imports."""
    if name == "torch":
        return TorchBackend()
    if name == "triton" or (name == "auto" and device.type != "cpu"):
        from loomserve.execution.attention import triton_backend
        if triton_backend.available(device):
            return triton_backend.TritonBackend(device)
        if name == "triton":
            raise ValueError("attention backend triton is unavailable: it needs the triton package "
                             "and a CUDA device (or TRITON_INTERPRET=1, for tests)")
        return TorchBackend()
    if name not in ("auto", "cpu_paged"):
        raise ValueError(f"unknown attention backend {name!r}")
    ok_device = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if ok_device:
        from loomserve.execution.attention.cpu_backend import CpuPagedBackend, load_library
        lib = load_library()
        if lib is not None:
            return CpuPagedBackend(lib)
    if name == "cpu_paged":
        why = ("its C kernel could not be built (see the log; needs a C compiler)" if ok_device
               else f"it runs on CPU in float32/bfloat16, not {device.type}/{dtype}")
        raise ValueError(f"attention backend cpu_paged is unavailable: {why}")
    return TorchBackend()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] (already rotated).
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] views of the packed pages.
    sinks: [heads] fp32 sink logits or None. Writes the new K/V into their slots, returns
    [tokens, heads, head_dim]."""
    rows, dt = meta.write_rows, k_cache.dtype
    # A narrower --kv-cache-dtype rounds the rows here, once; the writes' casts are then exact.
    k, v = as_cached(k, dt), as_cached(v, dt)
    k_cache[meta.slot_blocks, meta.slot_offsets] = (k if rows is None else k[rows]).to(dt)
    v_cache[meta.slot_blocks, meta.slot_offsets] = (v if rows is None else v[rows]).to(dt)
    return meta.backend.forward(q, k, v, k_cache, v_cache, meta, scale, sinks)


__all__ = ["AttentionMetadata", "BlockTables", "GatherWorkspace", "PrefillChunk", "TorchBackend",
           "build_metadata", "paged_attention", "select_backend", "tables_from_lists"]
