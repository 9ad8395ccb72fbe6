"""What a layer group keeps per block, and how the pool's uniform pages are laid out.

A KV cache *spec* describes one layer type's needs per block of `block_size` tokens. Layers with
the same spec form a *group*; every group draws blocks from one pool whose page size is the
largest group's bytes per block, so memory moves to whichever group needs it. A block's page is
one contiguous range of the backing buffer (the packed layout): for a full-attention group it
holds K and V of every layer of the group, [layers, 2, block_size, kv_heads, head_dim].
Hybrid models pick the block size and how many state layers share a group so that both kinds
of page hold about the same bytes (kv/planning.py size_pages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int

    @property
    def kind(self) -> str:
        raise NotImplementedError

    def bytes_per_block_per_layer(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def kind(self) -> str:
        return "full_attention"

    def bytes_per_block_per_layer(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Attention over the last `sliding_window` positions only (query at p sees p-window+1..p).

    Blocks wholly before the window can go back to the pool; a prefix hit at p needs the blocks
    covering [p - window, p) to be cached."""

    sliding_window: int = 0

    @property
    def kind(self) -> str:
        return "sliding_window"


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek V2/V3): per token and layer ONE compressed row shared
    by every head, c_kv (kv_lora_rank) then k_pe (qk_rope_head_dim); no V. Build it with
    `for_latent`.

    Full attention to every manager (kind "full_attention": same hashing, eviction, prefix hits
    and tiers; pages are opaque bytes to them). The layout stays the full-attention one with one
    head of half the row width, [2, block_size, 1, ceil(latent_dim / 2)] per layer, so a page
    region sized for K and V holds exactly one latent row per token, and the model reads each
    layer's region whole as [block_size, latent_dim] (rounded up to even)."""

    latent_dim: int = 0

    @classmethod
    def for_latent(cls, block_size: int, latent_dim: int, dtype: torch.dtype) -> "MLAAttentionSpec":
        return cls(block_size, 1, (latent_dim + 1) // 2, dtype, latent_dim)

    def bytes_per_block_per_layer(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * 2 * self.head_dim * elem  # one latent row per token, K only


@dataclass(frozen=True)
class IndexerKeySpec(MLAAttentionSpec):
    """DeepSeek Sparse Attention's lightning-indexer keys: per token one row holding the keys
    (index_head_dim each) of a few layers side by side, laid out as an MLA latent row
    (`for_latent`; models/deepseek_v32.py says how many). A class of its own so that it never
    shares a group with the latent rows even at equal widths: the indexer keys are their own
    full-attention group (hashed, prefix-hit, tiered and transferred like any other)."""


@dataclass(frozen=True)
class LinearStateSpec(KVCacheSpec):
    """A fixed-size recurrent state per request (Gated DeltaNet, Mamba2): conv + recurrent tensors.

    One page holds one whole state of every layer of the group, whatever block_size is: the state
    does not grow with tokens. block_size here is only the hit granularity (checkpoints are taken
    at block boundaries, so prefix hits stay as fine-grained as attention's)."""

    state_shapes: tuple[tuple[int, ...], ...] = ()  # one layer's state tensors, e.g. (conv, ssm)
    dtype: torch.dtype = torch.float32

    @property
    def kind(self) -> str:
        return "linear_state"

    def bytes_per_block_per_layer(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(s) for s in self.state_shapes) * elem


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layer_ids: tuple[int, ...]

    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block_per_layer() * len(self.layer_ids)


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole cache: groups sharing one pool of `num_blocks` pages of `page_bytes` each."""

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]

    @property
    def block_size(self) -> int:
        return self.groups[0].spec.block_size

    @property
    def page_bytes(self) -> int:
        return max(g.bytes_per_block() for g in self.groups)

    @property
    def capacity_tokens(self) -> int:
        # Each token needs a block in every attention group, so the pool holds
        # num_blocks / groups tokens' worth. A state group needs a few pages per request, not
        # per token (running, end-of-sequence and one save): set 3 aside for each.
        attn = [g for g in self.groups if not isinstance(g.spec, LinearStateSpec)]
        spare = self.num_blocks - 3 * (len(self.groups) - len(attn)) - any(
            isinstance(g.spec, SlidingWindowSpec) for g in self.groups)
        if not attn:
            return 0
        return max(0, spare) // len(attn) * self.block_size

    @staticmethod
    def num_blocks_for(memory_bytes: int, groups: tuple[KVCacheGroup, ...]) -> int:
        page = max(g.bytes_per_block() for g in groups)
        return max(0, memory_bytes // page)
