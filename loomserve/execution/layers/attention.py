"""Attention over the paged KV cache for a mixed batch of prefill chunks and decode tokens.

A step's tokens are flattened into one sequence, decode tokens first and prefill chunks after,
so every layer sees one contiguous slice per kind. Everything that depends on the batch and not
on the layer (write slots, padded block tables, masks) lives in `AttentionMetadata`, built once
per step; a layer only indexes and calls SDPA.

- Decode seqs (one query token each) run as ONE padded SDPA call: each seq's blocks are gathered
  into [seqs, kv_heads, padded_len, head_dim] and a mask hides the padding. The query heads of a
  kv head are laid out as that kv head's query rows, so GQA needs no repeat of K/V.
- Each prefill chunk runs its own SDPA call: a chunk starting at position 0 attends to its own
  fresh K/V with is_causal; a chunk after cached positions (a later chunk, or a prefix hit)
  gathers its blocks and uses a mask where query i sees keys 0 .. start_pos + i.

Sliding-window groups (metadata built with `sliding_window=W`): a query at p sees keys
max(0, p - W + 1) .. p. Only the blocks that hold such keys are gathered, so block-table entries
before the window (the KV manager frees those blocks; they may be the null block or already hold
another group's data) are never read. Every gathered position outside a query's range is
masked; masked positions must still hold finite numbers (-inf + NaN is NaN), which is why decode
tables are padded with the seq's own last block, not an arbitrary one, and why the runner zeroes
an attention block's page when a seq starts writing it in pools whose pages may hold non-K/V
bytes (linear-state groups).

Attention sinks (gpt-oss): a learned per-head logit that joins each softmax denominator without
contributing a value; those layers take a plain matmul + softmax path instead of SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F


@dataclass
class PrefillChunk:
    start: int  # first row of the chunk in the flattened batch
    end: int
    start_pos: int
    block_table: torch.Tensor | None = None  # [blocks] from the first in-window one, only when start_pos > 0
    # [1, 1, q_len, keys]: when start_pos > 0 (keys = the gathered context), or over the chunk's
    # own keys when a fresh chunk is longer than the sliding window; else causal.
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [tokens] block id each new K/V row is written to
    slot_offsets: torch.Tensor  # [tokens] offset inside that block
    num_decode: int = 0
    decode_tables: torch.Tensor | None = None  # [decodes, max_blocks], padded with each seq's last block
    decode_mask: torch.Tensor | None = None  # [decodes, 1, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)
    workspace: "GatherWorkspace | None" = None  # the runner's; a fresh one if None


class GatherWorkspace:
    """Reused destination of block gathers. A fresh multi-MB tensor per layer page-faults on
    every call: on CPU that cost 3x the copy itself (32 seqs x 1K context: 7 ms vs 2 ms)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
               blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks` (1-D ids) as [len(blocks), block_size, kv_heads, head_dim]."""
        n, tail = blocks.numel(), k_cache.shape[1:]
        if (self.k is None or self.k.shape[0] < n or self.k.shape[1:] != tail
                or self.k.dtype != k_cache.dtype or self.k.device != k_cache.device):
            size = max(n, 2 * self.k.shape[0] if self.k is not None else 0)
            self.k = torch.empty((size, *tail), dtype=k_cache.dtype, device=k_cache.device)
            self.v = torch.empty_like(self.k)
        k = torch.index_select(k_cache, 0, blocks, out=self.k[:n])
        v = torch.index_select(v_cache, 0, blocks, out=self.v[:n])
        return k, v


def build_metadata(decodes: list[tuple[int, list[int]]], prefills: list[tuple[int, int, list[int]]],
                   block_size: int, device: torch.device, dtype: torch.dtype = torch.float32,
                   sliding_window: int | None = None) -> tuple[AttentionMetadata, torch.Tensor]:
    """decodes: (start_pos, block_table) per decode token, in batch order, before the prefills.
    prefills: (start_pos, num_tokens, block_table) per chunk. Returns metadata and positions.
    Masks are additive (0 / -inf) in the model dtype: SDPA would otherwise convert a boolean
    mask in every layer. sliding_window=W: query at p sees keys p - W + 1 .. p only."""
    positions: list[int] = []
    for start_pos, _ in decodes:
        positions.append(start_pos)
    for start_pos, n, _ in prefills:
        positions.extend(range(start_pos, start_pos + n))
    tables = [t for _, t in decodes] + [t for _, _, t in prefills]
    counts = [1] * len(decodes) + [n for _, n, _ in prefills]
    blocks = _slot_blocks(positions, tables, counts, block_size)
    pos_t = torch.tensor(positions, dtype=torch.long)
    meta = AttentionMetadata(
        slot_blocks=torch.tensor(blocks, dtype=torch.long, device=device),
        slot_offsets=(pos_t % block_size).to(device),
        num_decode=len(decodes),
    )
    w = sliding_window
    if decodes:
        # Per seq: the blocks from the one holding its first visible key to the one holding p,
        # padded with its own last block (finite data, masked).
        p = torch.tensor([p for p, _ in decodes])[:, None]
        if w is None:
            lens = [q // block_size + 1 for q, _ in decodes]
            max_blocks = max(lens)
            padded = [t[:n] + [t[n - 1]] * (max_blocks - n) for (_, t), n in zip(decodes, lens)]
            mask = torch.arange(max_blocks * block_size)[None, :] <= p
        else:
            firsts = [max(0, q - w + 1) // block_size for q, _ in decodes]
            lasts = [q // block_size for q, _ in decodes]
            max_blocks = max(l - f for f, l in zip(firsts, lasts)) + 1
            padded = []
            for (_, t), f, l in zip(decodes, firsts, lasts):
                row = t[f:l + 1]
                padded.append(row + [row[-1]] * (max_blocks - len(row)))
            key_pos = torch.tensor(firsts)[:, None] * block_size + torch.arange(max_blocks * block_size)
            mask = (key_pos <= p) & (key_pos > p - w)
        meta.decode_tables = torch.tensor(padded, dtype=torch.long, device=device)
        meta.decode_mask = _additive(mask[:, None, None, :], dtype, device)
    row = len(decodes)
    for start_pos, n, table in prefills:
        chunk = PrefillChunk(row, row + n, start_pos)
        q_pos = torch.arange(start_pos, start_pos + n)
        if start_pos > 0:
            ctx = start_pos + n
            first = 0 if w is None else max(0, start_pos - w + 1) // block_size
            nblk = (ctx + block_size - 1) // block_size
            chunk.block_table = torch.tensor(table[first:nblk], dtype=torch.long, device=device)
            key_pos = torch.arange(first * block_size, ctx)
            chunk.mask = _additive(_visible(q_pos, key_pos, w)[None, None], dtype, device)
        elif w is not None and n > w:
            chunk.mask = _additive(_visible(q_pos, q_pos, w)[None, None], dtype, device)
        meta.prefills.append(chunk)
        row += n
    return meta, pos_t.to(device)


def _visible(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    allowed = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > q_pos[:, None] - window
    return allowed


def _additive(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, float("-inf")).to(device)


def _slot_blocks(positions: list[int], tables: list[list[int]], counts: list[int],
                 block_size: int) -> list[int]:
    out, row = [], 0
    for table, c in zip(tables, counts):
        for p in positions[row:row + c]:
            out.append(table[p // block_size])
        row += c
    return out


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim]; k, v: [tokens, kv_heads, head_dim] (already rotated).
    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] views of the packed pages.
    sinks: [heads] fp32 sink logits or None. Writes the new K/V into their slots, returns
    [tokens, heads, head_dim]."""
    k_cache[meta.slot_blocks, meta.slot_offsets] = k
    v_cache[meta.slot_blocks, meta.slot_offsets] = v
    if meta.workspace is None:
        meta.workspace = GatherWorkspace()
    num_tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    d = meta.num_decode
    if not meta.prefills:
        return _decode(q, k_cache, v_cache, meta, scale, kv_heads, group, sinks)
    out = torch.empty_like(q)
    if d:
        out[:d] = _decode(q[:d], k_cache, v_cache, meta, scale, kv_heads, group, sinks)
    for c in meta.prefills:
        qc = q[c.start:c.end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, hd]
        if c.block_table is None:
            kc = k[c.start:c.end].transpose(0, 1).unsqueeze(0)
            vc = v[c.start:c.end].transpose(0, 1).unsqueeze(0)
        else:
            ctx = c.mask.shape[-1]
            kb, vb = meta.workspace.gather(k_cache, v_cache, c.block_table)
            kc = kb.flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
            vc = vb.flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
        if sinks is not None:
            o = _attend_with_sinks(qc, kc.repeat_interleave(group, 1), vc.repeat_interleave(group, 1),
                                   c.mask, scale, sinks.view(1, heads, 1, 1))
        elif c.mask is None:
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale,
                                               enable_gqa=group > 1)
        else:
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, scale=scale,
                                               enable_gqa=group > 1)
        out[c.start:c.end] = o[0].transpose(0, 1)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, kv_heads: int, group: int,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    d, heads, head_dim = q.shape
    # [decodes, blocks, block_size, kv_heads, hd] -> [decodes, kv_heads, padded_len, hd]
    kb, vb = meta.workspace.gather(k_cache, v_cache, meta.decode_tables.view(-1))
    padded = meta.decode_tables.shape[1] * k_cache.shape[1]
    kc = kb.view(d, padded, kv_heads, head_dim).transpose(1, 2)
    vc = vb.view(d, padded, kv_heads, head_dim).transpose(1, 2)
    # A kv head's `group` query heads become its `group` query rows: GQA without repeating K/V.
    qd = q.view(d, kv_heads, group, head_dim)
    if sinks is not None:
        o = _attend_with_sinks(qd, kc, vc, meta.decode_mask, scale, sinks.view(1, kv_heads, group, 1))
    else:
        o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=meta.decode_mask, scale=scale)
    return o.reshape(d, heads, head_dim)


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] with the sink's column dropped after; mask None = causal.
    q: [b, h, rows, d], k/v: [b, h, keys, d], sinks broadcastable to [b, h, rows, 1]."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is None:
        rows, keys = scores.shape[-2:]
        mask = torch.ones(rows, keys, dtype=torch.bool, device=q.device).tril(keys - rows)
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
