"""The portable backend: gather the blocks a batch needs, then SDPA with an additive mask.

Runs on any device torch runs on; the CPU backend uses it for what its kernels do not cover,
and tests use it as a second reference. Costs grow with the context: each layer copies every
needed block into a workspace, and masks are dense ([queries, keys]).

- Decode seqs (one query token each) run as ONE padded SDPA call: each seq's blocks are gathered
  into [seqs, kv_heads, padded_len, head_dim] and a mask hides the padding. A kv head's query
  heads are laid out as that kv head's query rows, so GQA needs no repeat of K/V.
- Each prefill chunk runs its own SDPA call: a chunk starting at position 0 attends to its own
  fresh K/V with is_causal; a later chunk gathers its blocks and masks key > query position.

Sliding windows: only blocks holding visible keys are gathered, and decode tables are padded
with the seq's own last block, so every gathered position holds finite numbers (-inf + NaN is
NaN). Sinks (gpt-oss) take a matmul + softmax path with the sink column in the denominator.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from loomserve.execution.attention.metadata import AttentionMetadata, PrefillChunk, first_visible


class GatherWorkspace:
    """Reused destination of block gathers. A fresh multi-MB tensor per layer page-faults on
    every call: on CPU that cost 3x the copy itself (32 seqs x 1K context: 7 ms vs 2 ms)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks` (1-D ids) as [len(blocks), block_size, kv_heads, head_dim], in
        `dtype` (None: the cache's; a --kv-cache-dtype narrower than the model's is widened
        here, so the products after run in the model's dtype)."""
        n, tail = blocks.numel(), k_cache.shape[1:]
        dtype = dtype or k_cache.dtype
        if (self.k is None or self.k.shape[0] < n or self.k.shape[1:] != tail
                or self.k.dtype != dtype or self.k.device != k_cache.device):
            size = max(n, 2 * self.k.shape[0] if self.k is not None else 0)
            self.k = torch.empty((size, *tail), dtype=dtype, device=k_cache.device)
            self.v = torch.empty_like(self.k)
        if dtype != k_cache.dtype:
            return (self.k[:n].copy_(k_cache.index_select(0, blocks)),
                    self.v[:n].copy_(v_cache.index_select(0, blocks)))
        k = torch.index_select(k_cache, 0, blocks, out=self.k[:n])
        v = torch.index_select(v_cache, 0, blocks, out=self.v[:n])
        return k, v


def workspace(meta: AttentionMetadata) -> GatherWorkspace:
    if meta.workspace is None:
        meta.workspace = GatherWorkspace()
    return meta.workspace


class TorchBackend:
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                sinks: torch.Tensor | None) -> torch.Tensor:
        d = meta.num_decode
        group = q.shape[1] // k.shape[1]
        if not meta.prefills:
            return decode(q, k_cache, v_cache, meta, scale, group, sinks)
        out = torch.empty_like(q)
        if d:
            out[:d] = decode(q[:d], k_cache, v_cache, meta, scale, group, sinks)
        for c in meta.prefills:
            out[c.start:c.end] = prefill(q, k, v, k_cache, v_cache, meta, c, scale, group, sinks)
        return out


def _decode_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded [decodes, max_blocks] tables and the additive mask over their positions."""
    got = meta.derived.get("torch_decode")
    if got is not None:
        return got
    bs, w = meta.block_size, meta.sliding_window
    pos = meta.decode_lens.astype(np.int64) - 1
    firsts = np.array([first_visible(int(p), w) // bs for p in pos], dtype=np.int64)
    lasts = pos // bs
    width = int((lasts - firsts).max()) + 1
    # Column j of row i: block firsts[i] + j, clipped to the seq's last block (finite padding).
    cols = np.minimum(firsts[:, None] + np.arange(width)[None, :], lasts[:, None])
    padded = np.stack([t[c] for t, c in zip(meta.decode_tables, cols)]).astype(np.int64)
    key_pos = torch.from_numpy(firsts)[:, None] * bs + torch.arange(width * bs)
    p = torch.from_numpy(pos)[:, None]
    allowed = (key_pos <= p) if w is None else (key_pos <= p) & (key_pos > p - w)
    got = (torch.from_numpy(padded).to(meta.device), additive(allowed[:, None, None, :], meta))
    meta.derived["torch_decode"] = got
    return got


def decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, group: int,
           sinks: torch.Tensor | None) -> torch.Tensor:
    d, heads, head_dim = q.shape
    kv_heads = heads // group
    tables, mask = _decode_inputs(meta)
    # [decodes, blocks, block_size, kv_heads, hd] -> [decodes, kv_heads, padded_len, hd]
    kb, vb = workspace(meta).gather(k_cache, v_cache, tables.view(-1), q.dtype)
    padded = tables.shape[1] * k_cache.shape[1]
    kc = kb.view(d, padded, kv_heads, head_dim).transpose(1, 2)
    vc = vb.view(d, padded, kv_heads, head_dim).transpose(1, 2)
    qd = q.view(d, kv_heads, group, head_dim)
    if sinks is not None:
        o = attend_with_sinks(qd, kc, vc, mask, scale, sinks.view(1, kv_heads, group, 1))
    else:
        o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=mask, scale=scale)
    return o.reshape(d, heads, head_dim)


def _chunk_inputs(meta: AttentionMetadata, c: PrefillChunk):
    """(block table tensor, mask) of a chunk; (None, None) for a plain causal fresh chunk."""
    key = ("torch_chunk", c.start)
    got = meta.derived.get(key)
    if got is not None:
        return got
    bs, w, n = meta.block_size, meta.sliding_window, c.end - c.start
    q_pos = torch.arange(c.start_pos, c.start_pos + n)
    table = mask = None
    if c.start_pos > 0:
        ctx = c.start_pos + n
        first = first_visible(c.start_pos, w) // bs
        nblk = (ctx + bs - 1) // bs
        table = torch.from_numpy(c.table[first:nblk].astype(np.int64)).to(meta.device)
        mask = additive(visible(q_pos, torch.arange(first * bs, ctx), w)[None, None], meta)
    elif w is not None and n > w:
        mask = additive(visible(q_pos, q_pos, w)[None, None], meta)
    meta.derived[key] = (table, mask)
    return table, mask


def prefill(q, k, v, k_cache, v_cache, meta: AttentionMetadata, c: PrefillChunk, scale: float,
            group: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """The chunk's output rows [n, heads, head_dim]."""
    heads = q.shape[1]
    table, mask = _chunk_inputs(meta, c)
    qc = q[c.start:c.end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, hd]
    if table is None:
        kc = k[c.start:c.end].transpose(0, 1).unsqueeze(0)
        vc = v[c.start:c.end].transpose(0, 1).unsqueeze(0)
    else:
        ctx = mask.shape[-1]
        kb, vb = workspace(meta).gather(k_cache, v_cache, table, q.dtype)
        kc = kb.flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
        vc = vb.flatten(0, 1)[:ctx].transpose(0, 1).unsqueeze(0)
    if sinks is not None:
        o = attend_with_sinks(qc, kc.repeat_interleave(group, 1), vc.repeat_interleave(group, 1),
                              mask, scale, sinks.view(1, heads, 1, 1))
    elif mask is None:
        o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=group > 1)
    else:
        o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=group > 1)
    return o[0].transpose(0, 1)


def visible(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    allowed = key_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > q_pos[:, None] - window
    return allowed


def additive(allowed: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """0 / -inf in the model dtype: SDPA would otherwise convert a boolean mask in every layer."""
    mask = torch.zeros(allowed.shape, dtype=meta.dtype)
    return mask.masked_fill_(~allowed, float("-inf")).to(meta.device)


def attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] with the sink's column dropped after; mask None = causal.
    q: [b, h, rows, d], k/v: [b, h, keys, d], sinks broadcastable to [b, h, rows, 1]."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is None:
        rows, keys = scores.shape[-2:]
        causal = torch.ones(rows, keys, dtype=torch.bool, device=q.device).tril(keys - rows)
        scores = scores.masked_fill(~causal, float("-inf"))
    else:
        scores = scores + mask
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)
