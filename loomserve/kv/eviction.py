"""Eviction policy over the pool's one free queue: which hashed free block is reused next.

LRU needs nothing here: it is the free queue's own order (BlockPool with evictor=None).

FLOP-aware (after Marconi, arXiv 2411.19379): a hashed free block's utility is
    normalized recency + alpha * normalized FLOPs saved per byte held
and the block with the lowest utility is evicted first. Recency is the pool-wide count of blocks
freed before it, divided by the number of usable blocks (one full turnover of the pool = 1.0).
FLOPs saved is what a hit on the block spares (`Block.saved_flops`, set by the managers from a
`FlopModel` when they cache the block): a KV block spares its own block of tokens at its
position, a state checkpoint at position p spares recomputing p tokens through every layer,
attention's quadratic term included. Every block occupies one page of the one pool, so bytes
held = page_bytes for all groups, and FLOPs per byte is normalized by a reference checkpoint
(ref_tokens long) per page. Both terms are fixed when the block enters the queue, so utility is
a static key: a binary heap with lazy invalidation gives O(log n) push/pop and no rescan.

Invariant: every hashed block in the free queue has exactly one live heap entry (the one whose
version equals its evict_ver); entries of blocks that were touched, reused or unhashed since are
stale and skipped when popped. The heap is rebuilt when stale entries dominate.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from loomserve.kv.pool import Block

_heappush = heapq.heappush


@dataclass(frozen=True)
class FlopModel:
    """FLOPs of a forward pass over tokens [a, b) given the prefix before a.

    linear_flops_per_token: 2 * active parameters per token (projections, MLP/MoE, linear
    attention). attn_flops_per_pair: FLOPs per (query, key) pair summed over full-attention
    layers (QK^T and AV: 4 * layers * q_heads * head_dim)."""

    linear_flops_per_token: float
    attn_flops_per_pair: float = 0.0

    def flops(self, a: int, b: int) -> float:
        if b <= a:
            return 0.0
        return (b - a) * self.linear_flops_per_token + self.attn_flops_per_pair * (
            (b * b - a * a) / 2.0)

    def kv_block_flops(self, index: int, block_size: int) -> float:
        return self.flops(index * block_size, (index + 1) * block_size)

    def checkpoint_flops(self, num_tokens: int) -> float:
        return self.flops(0, num_tokens)


class FlopAwareEvictor:
    def __init__(self, num_usable_blocks: int, flop_model: FlopModel, alpha: float = 1.0,
                 ref_tokens: int = 131072) -> None:
        self.flop_model = flop_model
        self.alpha = alpha
        self._inv_turnover = 1.0 / max(1, num_usable_blocks)
        ref = flop_model.checkpoint_flops(ref_tokens)
        self._flop_scale = alpha / ref if ref > 0 else 0.0
        self._limit = 4 * num_usable_blocks + 64
        self._heap: list[tuple[float, int, int, Block]] = []
        self._tick = 0

    def utility(self, b: Block, tick: int) -> float:
        return tick * self._inv_turnover + b.saved_flops * self._flop_scale

    def push(self, b: Block) -> None:
        t = self._tick = self._tick + 1
        v = b.evict_ver + 1
        b.evict_ver = v
        heap = self._heap
        _heappush(heap, (t * self._inv_turnover + b.saved_flops * self._flop_scale,
                         b.block_id, v, b))
        if len(heap) > self._limit:
            self._compact()

    def pop(self) -> Block | None:
        heap = self._heap
        while heap:
            _, _, v, b = heapq.heappop(heap)
            if v == b.evict_ver and b.ref_cnt == 0 and b.block_hash is not None:
                b.evict_ver = v + 1
                return b
        return None

    def _compact(self) -> None:
        self._heap = [e for e in self._heap
                      if e[2] == e[3].evict_ver and e[3].ref_cnt == 0 and e[3].block_hash is not None]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)
