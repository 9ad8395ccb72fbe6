"""Eviction policy over the pool's one free queue: which hashed free block is reused next.

LRU needs nothing here: it is the free queue's own order (BlockPool with evictor=None). The
FLOP-aware policy (after Marconi, arXiv 2411.19379) evicts first the hashed free block of
lowest utility, normalized recency + alpha * normalized FLOPs saved per byte held. Utility is
fixed when the block enters the queue, so a binary heap with lazy updates serves it in
O(log n) without rescans. The formula and the heap's bookkeeping: docs/design/kv-cache.md.

Invariant: every hashed block in the free queue has exactly one live heap entry (the one whose
version equals its evict_ver), whose key is <= the block's current utility. Live entries of
blocks in use are dropped when they reach the top; superseded entries are skipped.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import count

from loomserve.kv.pool import Block

_heappush = heapq.heappush
_heappop = heapq.heappop
_heapreplace = heapq.heapreplace
_INF = float("inf")


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
    """Min-heap of (utility, block_id, version, block) with lazy increase-key.

    A block's utility only grows while it stays cached (a later free gives it a later tick,
    its FLOPs are fixed), so a re-freed block whose heap entry is still in place keeps that
    entry: the entry's key is a lower bound of the block's utility, and is corrected
    (re-sifted to the current utility) only if it reaches the top of the heap. A free that
    finds the entry in place costs one tick and two dict stores instead of a heap push, and
    the heap holds at most one entry per block. If a block's utility ever went down while
    its entry is in place (its FLOPs were changed), it gets a fresh entry and the old one
    goes stale. Eviction order is exactly that of a heap with eager updates, ties included
    (lowest (utility, block_id) first), since every entry is <= its block's current key.
    """

    __slots__ = ("flop_model", "alpha", "_inv_turnover", "_flop_scale", "_limit", "_heap",
                 "_tick", "_key", "_entry")

    def __init__(self, num_usable_blocks: int, flop_model: FlopModel, alpha: float = 1.0,
                 ref_tokens: int = 131072) -> None:
        self.flop_model = flop_model
        self.alpha = alpha
        self._inv_turnover = 1.0 / max(1, num_usable_blocks)
        ref = flop_model.checkpoint_flops(ref_tokens)
        self._flop_scale = alpha / ref if ref > 0 else 0.0
        self._limit = 4 * num_usable_blocks + 64
        self._heap: list[tuple[float, int, int, Block]] = []
        self._tick = count(1)
        # Indexed by block_id (ids run up to num_usable_blocks, one more with a null block).
        self._key: list[float] = [_INF] * (num_usable_blocks + 1)    # utility at latest push
        self._entry: list[float] = [_INF] * (num_usable_blocks + 1)  # live entry's key, inf: none

    def utility(self, b: Block, tick: int) -> float:
        return tick * self._inv_turnover + b.saved_flops * self._flop_scale

    def push(self, b: Block) -> None:
        k = next(self._tick) * self._inv_turnover + b.saved_flops * self._flop_scale
        bid = b.block_id
        try:
            self._key[bid] = k
        except IndexError:
            self._grow(bid)
            self._key[bid] = k
        if self._entry[bid] <= k:
            return  # the entry in place is a lower bound: moved up lazily in pop()
        self._entry[bid] = k
        v = b.evict_ver + 1
        b.evict_ver = v
        heap = self._heap
        _heappush(heap, (k, bid, v, b))
        if len(heap) > self._limit:
            self._compact()

    def pop(self) -> Block | None:
        heap = self._heap
        entry = self._entry
        key = self._key
        while heap:
            k, bid, v, b = heap[0]
            if v != b.evict_ver:  # superseded by a newer entry of the same block
                _heappop(heap)
            elif b.ref_cnt or b.block_hash is None:  # in use: no entry until freed again
                _heappop(heap)
                entry[bid] = _INF
            else:
                cur = key[bid]
                if cur != k:  # freed again since this entry was made: move it to its key
                    _heapreplace(heap, (cur, bid, v, b))
                    entry[bid] = cur
                else:
                    _heappop(heap)
                    entry[bid] = _INF
                    b.evict_ver = v + 1
                    return b
        return None

    def _grow(self, bid: int) -> None:
        extra = [_INF] * (bid + 1 - len(self._key))
        self._key.extend(extra)
        self._entry.extend(extra)

    def _compact(self) -> None:
        keep = []
        entry = self._entry
        for e in self._heap:
            b = e[3]
            if e[2] != b.evict_ver:
                continue
            if b.ref_cnt or b.block_hash is None:
                entry[e[1]] = _INF
            else:
                keep.append(e)
        heapq.heapify(keep)
        self._heap = keep

    def clear(self) -> None:
        self._heap.clear()
        n = len(self._key)
        self._key[:] = [_INF] * n
        self._entry[:] = [_INF] * n

    def __len__(self) -> int:
        return len(self._heap)
