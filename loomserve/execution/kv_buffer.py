"""The paged KV pool's memory: one buffer of `num_blocks` pages and every layer's views into it.

A block id names one logical page of `page_bytes` (what the KV tiers and transfers move:
`pages[b]`). Two physical layouts hold it:

- layer-major (where it fits): storage [slots, num_blocks, slot_bytes]; slot s holds one layer of
  each group ([2, block_size, kv_heads, head_dim] per block), so one layer's K/V of consecutive
  blocks lie one after another and decode attention reads each layer as one sequential stream.
  `pages` is the [num_blocks, slots, slot_bytes] view (a page is strided: its slots lie
  num_blocks x slot_bytes apart). Fits when every group is attention with the same number of
  layers and the same bytes per layer (a page is then exactly slots x slot_bytes, nothing
  wasted). Why: with the pages packed block-major, a layer reads its part of every page and
  skips the rest; the hardware prefetchers then fetch the skipped bytes too, and each page
  restarts their streams. Measured on a 2-core Zen 4 (tiny 2-layer model, 128K context, 2
  threads): decode attention 3.9-4.7 ms block-major -> 1.8-2.8 ms layer-major.
- block-major: [num_blocks, page_bytes], group g's layers packed from byte 0 of each page. Used
  for linear-state groups (whole-page state copies), groups of unequal shape, and the shared
  tensor-parallel pool (parallel/shared_pool.py: every rank's page side by side).

Invariant: either way `pages[b]` is block b's whole page, the bytes of layer slot s at
[s * slot_bytes, (s + 1) * slot_bytes) of the flattened page, so a page stored from one layout
loads into the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig
from loomserve.kv.tiers.base import page_bytes_of


def layer_major_fits(kc: KVCacheConfig) -> bool:
    """Every group attention, with the same layer count and bytes per layer."""
    groups = kc.groups
    return (all(isinstance(g.spec, FullAttentionSpec) for g in groups)
            and len({len(g.layer_ids) for g in groups}) == 1
            and len({g.spec.bytes_per_block_per_layer() for g in groups}) == 1)


_ALIGN = 4096


def _zeros(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        # calloc'd memory is zero-filled by the OS on first touch, so resident memory grows
        # with the pages actually used; numpy also asks for transparent huge pages on large
        # buffers (fewer TLB misses on a sequential read, costly under virtualization). Started
        # on a 4 KB boundary (numpy gives 16 bytes): no vector load of a row splits a cache line,
        # and a 4 KB block is one page (the kernel prefetches per page; paged_attention.c).
        n = math.prod(shape)
        raw = np.zeros(n + _ALIGN, dtype=np.uint8)
        off = -raw.ctypes.data % _ALIGN
        return torch.from_numpy(raw[off:off + n].reshape(shape))
    return torch.zeros(shape, dtype=torch.uint8, device=device)


@dataclass
class KVPool:
    pages: torch.Tensor  # [num_blocks, ...]: pages[b] is block b's logical page
    storage: torch.Tensor  # layer-major: [slots, num_blocks, slot_bytes]; else == pages
    layer_major: bool

    @classmethod
    def allocate(cls, kc: KVCacheConfig, device: torch.device, layer_major: bool = True
                 ) -> "KVPool":
        """A zeroed pool; layer-major where it fits and is asked for."""
        n = kc.num_blocks
        if layer_major and layer_major_fits(kc):
            g = kc.groups[0]
            storage = _zeros((len(g.layer_ids), n, g.spec.bytes_per_block_per_layer()), device)
            return cls(storage.permute(1, 0, 2), storage, True)
        pages = _zeros((n, kc.page_bytes), device)
        return cls(pages, pages, False)

    @classmethod
    def of_pages(cls, pages: torch.Tensor) -> "KVPool":
        """A block-major pool over given pages [num_blocks, page_bytes] (the shared pool)."""
        return cls(pages, pages, False)

    @property
    def page_bytes(self) -> int:
        return page_bytes_of(self.pages)

    def layer_view(self, slot: int, slot_bytes: int, offset: int, dtype: torch.dtype,
                   shape: tuple[int, ...]) -> torch.Tensor:
        """[num_blocks, *shape] of `dtype`: `offset` bytes into layer slot `slot` of every page."""
        if self.layer_major:
            return _view(self.storage[slot], offset, dtype, shape)
        return _view(self.pages, slot * slot_bytes + offset, dtype, shape)

    def zero(self, blocks: torch.Tensor, nbytes: int) -> None:
        """Zero the first `nbytes` of the given pages (a group's region)."""
        if nbytes == self.page_bytes:  # always so layer-major: every group fills the page
            self.pages[blocks] = 0
        else:
            self.pages[blocks, :nbytes] = 0


def _view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """[num_blocks, *shape] of `dtype` starting `offset` bytes into every row of buf."""
    nbytes = math.prod(shape) * dtype.itemsize
    return buf[:, offset:offset + nbytes].view(dtype).view(buf.shape[0], *shape)
