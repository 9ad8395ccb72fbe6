"""MLA under TP x DCP (tensor_parallel_size = decode_context_parallel_size = N): the N ranks
split the query heads (TP: rank r owns heads r*h .. r*h + h - 1, h = heads / N, with their
kv_b_proj rows and o_proj columns) AND every sequence's latent rows by token (DCP layout), so a
100K context's latent cache is stored once across the ranks instead of once per rank, as
vLLM's `-tp 8 -dcp 8` does for DeepSeek.

- decode (absorbed): each rank moves its heads' queries into latent space (its W_UK rows), the
  ranks all-gather them, each rank scores every head over its own latent rows (the latent rows
  are shared by all heads, so no per-head weight is needed), and the partials [decodes, heads,
  kv_lora_rank + 1] are all-gathered and merged by log-sum-exp; each rank keeps its heads and
  maps them back with its W_UV rows. Two all-gathers per layer.
- prefill (decompressed): each rank all-gathers the chunk's context latent rows (every rank's
  share, placed at their global positions) and runs the usual decompressed attention for its
  heads. Prefill is compute-bound; its context rows cross once per chunk and layer.
Every rank runs the same collectives in the same order (decodes first, then chunks in order).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from loomserve.execution.layers.mla import decode_inputs
from loomserve.execution.parallel.context_parallel import DcpLayout, softmax_partial


def tp_dcp_attention(layer, q_nope, q_pe, meta, out: torch.Tensor) -> None:
    """Fills out [tokens, heads of this rank, v_dim]."""
    dcp, d = meta.backend, meta.num_decode
    if d:
        out[:d] = _decode(layer, q_nope[:d], q_pe[:d], meta, dcp)
    for c in meta.prefills:
        out[c.start:c.end] = _prefill(layer, q_nope[c.start:c.end], q_pe[c.start:c.end], c,
                                      meta, dcp)


def _decode(layer, q_nope, q_pe, meta, dcp) -> torch.Tensor:
    group, d, h = dcp.group, q_nope.shape[0], layer.heads
    w_uk, w_uv_t = layer.kv_b_proj.absorbed()
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [d, h, rank]
    q_all = group.all_gather(torch.cat([q_lat, q_pe], dim=-1))  # [N, d, h, rank + rope]
    q_all = q_all.permute(1, 0, 2, 3).reshape(d, group.size * h, -1)  # heads in rank order
    tables, valid = decode_inputs(meta)  # local key counts (0 allowed)
    rows = layer.latent_cache.index_select(0, tables.view(-1)).view(d, valid.shape[1], -1)
    rows = rows[..., :layer.latent_dim]
    o_lat, lse = softmax_partial(q_all, rows, rows[..., :layer.rank], valid[:, None, :],
                                 layer.scale)  # [d, N h, rank], [d, N h]
    merged, _ = dcp.merge_across(torch.cat([o_lat, lse.unsqueeze(-1)], dim=-1))
    mine = merged[:, group.rank * h:(group.rank + 1) * h].to(w_uv_t.dtype)
    return torch.bmm(mine.transpose(0, 1), w_uv_t).transpose(0, 1)  # [d, h, v]


def context_rows(layer, c, meta, dcp, n: int) -> torch.Tensor:
    """The latent rows of positions 0 .. c.start_pos + n - 1, gathered from every rank."""
    counts, places, blocks = _context_plan(c, meta, dcp, n)
    width, nk = max(counts), counts[dcp.layout.rank]
    mine = torch.zeros(width, layer.latent_dim, dtype=layer.latent_cache.dtype,
                       device=layer.latent_cache.device)
    if nk:
        mine[:nk] = layer.latent_cache.index_select(0, blocks).flatten(0, 1)[:nk, :layer.latent_dim]
    every = dcp.group.all_gather(mine)  # [N, width, latent]
    full = torch.empty(c.start_pos + n, layer.latent_dim, dtype=mine.dtype, device=mine.device)
    for r, (k, pos) in enumerate(zip(counts, places)):
        full[pos] = every[r, :k]
    return full


def _context_plan(c, meta, dcp, n: int):
    """Per chunk, once per step for every MLA layer: each rank's key count over the chunk's
    context, where its keys sit (global positions), and this rank's pages holding them."""
    key = ("tp_dcp_context", c.start)
    got = meta.derived.get(key)
    if got is None:
        lay, ctx = dcp.layout, c.start_pos + n
        bs = meta.block_size  # the local page's here
        ranks = [DcpLayout(r, lay.size, lay.block_size, lay.interleave) for r in range(lay.size)]
        counts = [int(x.local_count(ctx)) for x in ranks]
        places = [torch.from_numpy(x.global_positions(k)).to(meta.device)
                  for x, k in zip(ranks, counts)]
        nk = counts[lay.rank]
        blocks = torch.from_numpy(c.table[:(nk + bs - 1) // bs].astype(np.int64)).to(meta.device)
        got = meta.derived[key] = (counts, places, blocks)
    return got


def _prefill(layer, q_nope, q_pe, c, meta, dcp) -> torch.Tensor:
    n = q_nope.shape[0]
    rows = context_rows(layer, c, meta, dcp, n).to(q_nope.dtype)  # a narrower KV dtype widens
    ckv, k_pe = rows.split([layer.rank, layer.rope], dim=-1)
    k_nope, v = layer.kv_b_proj(ckv)
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, layer.heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    mask = None
    if c.start_pos:
        q_pos = torch.arange(c.start_pos, c.start_pos + n, device=q.device)
        mask = torch.arange(rows.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, is_causal=mask is None, scale=layer.scale)
    return o.transpose(0, 1)
