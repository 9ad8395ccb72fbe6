"""Multi-head latent attention (DeepSeek V2/V3, Kimi K2) over a paged cache of latent rows.

Per token the layer keeps ONE row shared by every head: c_kv (kv_lora_rank, after
kv_a_layernorm) then k_pe (qk_rope_head_dim, rotated). Per head, keys and values are linear in
c_kv: k_nope_h = W_UK_h c_kv, v_h = W_UV_h c_kv (the rows of kv_b_proj), so
    score_h(t) = q_nope_h . W_UK_h c_kv(t) + q_pe_h . k_pe(t) = (W_UK_h^T q_nope_h) . c_kv(t) + ...
    out_h      = W_UV_h sum_t p_h(t) c_kv(t)
- decode (absorbed): the query moves into latent space once per token (q_lat = W_UK^T q_nope),
  scores and the weighted sum run over the latent rows themselves, and W_UV maps the result
  back: the cache is read once for all heads, never expanded.
- prefill (decompressed): a chunk's context rows go through kv_b_proj into per-head k_nope and v
  (compute-bound work, where the MHA form is cheaper than the absorbed one for long chunks).
RoPE turns the last qk_rope_head_dim dims of q and k only; `rope=None` in forward leaves them as
they are (Kimi Linear's MLA is NoPE: its "rope" dims are a shared, unrotated key part). DeepSeek
checkpoints lay those dims out in interleaved pairs (x0, x1), (x2, x3), ...;
`deinterleave_rope_rows` reorders the producing weight rows at load to [evens | odds], after
which the usual rotate-half RoPE gives
exactly transformers' interleaved rotation (and q.k is unchanged: both sides move alike).
Softmax scale: qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.attention.kv_dtype import as_cached
from loomserve.execution.attention.metadata import padded_decode_tables
from loomserve.execution.layers.attention import AttentionMetadata
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.layers.rotary import apply_rope
from loomserve.execution.parallel.context_parallel import DcpLayout, softmax_partial


def yarn_softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """transformers' yarn_apply_mscale: YaRN with mscale_all_dim also sharpens the softmax."""
    scale = qk_head_dim ** -0.5
    s = rope_scaling or {}
    m_all, factor = s.get("mscale_all_dim"), float(s.get("factor", 1.0))
    if s and m_all and factor > 1:
        m = 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= m * m
    return scale


def deinterleave_rope_rows(t: torch.Tensor, rows_per_head: int, rope_start: int, rope_dim: int) -> torch.Tensor:
    """t: [heads * rows_per_head, ...] output rows of a projection; within each head, rows
    rope_start .. rope_start + rope_dim go from pair-interleaved to [evens | odds]."""
    perm = torch.arange(t.shape[0]).view(-1, rows_per_head)
    rope = perm[:, rope_start:rope_start + rope_dim]
    perm[:, rope_start:rope_start + rope_dim] = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    return t[perm.reshape(-1)]


def latent_view(k_view: torch.Tensor, width: int) -> torch.Tensor:
    """The runner binds a full-attention page region as K and V halves ([blocks, block_size, 1,
    w/2] each, V right after K); MLA reads the same region whole as [blocks, block_size, w]."""
    blocks, block_size = k_view.shape[:2]
    return torch.as_strided(k_view, (blocks, block_size, width), (k_view.stride(0), width, 1))


class LatentUpProjection(nn.Module):
    """kv_b_proj: c_kv -> per head [k_nope | v]. Not an nn.Linear on purpose: the absorbed decode
    reads its weight per head, so CPU layouts that repack linears must leave it plain."""

    def __init__(self, rank: int, heads: int, nope: int, v: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads * (nope + v), rank))
        self.heads, self.nope, self.v = heads, nope, v

    def forward(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, rank] -> (k_nope [n, heads, nope], v [n, heads, v])."""
        kv = F.linear(c, self.weight).view(c.shape[0], self.heads, self.nope + self.v)
        return kv.split([self.nope, self.v], dim=-1)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, rank], W_UV^T [heads, rank, v]): strided views of the weight,
        which batched matmuls take as they are (no copy, nothing to keep in sync)."""
        w = self.weight.view(self.heads, self.nope + self.v, -1)
        return w[:, :self.nope], w[:, self.nope:].transpose(1, 2)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 nope: int, rope: int, v_head_dim: int, bias: bool, scale: float) -> None:
        super().__init__()
        self.heads, self.nope, self.rope, self.v_dim, self.rank = heads, nope, rope, v_head_dim, kv_lora_rank
        self.qk_dim, self.latent_dim, self.scale = nope + rope, kv_lora_rank + rope, scale
        if q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6)  # transformers: default eps, not the config's
            self.q_b_proj = nn.Linear(q_lora_rank, heads * self.qk_dim, bias=False)
            self.q_proj = None
        else:
            self.q_proj = nn.Linear(hidden, heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6)
        self.kv_b_proj = LatentUpProjection(kv_lora_rank, heads, nope, v_head_dim)
        self.o_proj = nn.Linear(heads * v_head_dim, hidden, bias=bias)
        self.latent_cache: torch.Tensor | None = None  # [blocks, block_size, >= latent_dim]
        self._k_view: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None  # the runner's V half: part of latent_cache

    @property
    def k_cache(self) -> torch.Tensor | None:
        return self._k_view

    @k_cache.setter
    def k_cache(self, view: torch.Tensor | None) -> None:
        """Bound by the runner (an MLAAttentionSpec page region's K half); see latent_view."""
        self._k_view = view
        self.latent_cache = None if view is None else latent_view(view, 2 * view.shape[-1])

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, int] | None,
                meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        if self.q_proj is None:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(n, self.heads, self.qk_dim).split([self.nope, self.rope], dim=-1)
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        ckv = self.kv_a_layernorm(ckv)
        if rope is not None:  # None: NoPE (Kimi Linear)
            cos, sin, half = rope
            q_pe = apply_rope(q_pe, cos, sin, half)
            k_pe = apply_rope(k_pe.unsqueeze(1), cos, sin, half).squeeze(1)
        latent = as_cached(torch.cat([ckv, k_pe], dim=-1), self.latent_cache.dtype)
        rows = meta.write_rows  # decode context parallelism: the rows this rank stores
        self.latent_cache[meta.slot_blocks, meta.slot_offsets, :self.latent_dim] = (
            latent if rows is None else latent[rows]).to(self.latent_cache.dtype)  # exact: rounded
        if getattr(meta.backend, "name", None) == "pcp":  # the other ranks' prefill rows
            meta.backend.exchange(latent, meta, self._write_latent)
        out = x.new_empty(n, self.heads, self.v_dim)
        d = meta.num_decode
        if getattr(meta.backend, "name", None) == "dcp":
            if meta.backend.group.tp_size > 1:  # TP x DCP: this rank's heads, every rank's keys
                tp_dcp_attention(self, q_nope, q_pe, meta, out)
            else:
                self._dcp_attention(q_nope, q_pe, meta, out)
            return self.o_proj(out.view(n, self.heads * self.v_dim))
        if d:
            out[:d] = self._decode(q_nope[:d], q_pe[:d], meta)
        for c in meta.prefills:
            out[c.start:c.end] = self._prefill(q_nope[c.start:c.end], q_pe[c.start:c.end],
                                               latent[c.start:c.end], c, meta)
        return self.o_proj(out.view(n, self.heads * self.v_dim))

    def _write_latent(self, blocks: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> None:
        # exact: every rank rounded its latents (as_cached) before the exchange
        self.latent_cache[blocks, offsets, :self.latent_dim] = rows.to(self.latent_cache.dtype)

    # --- decode context parallelism (loomserve.execution.parallel.context_parallel) -----------

    def _dcp_attention(self, q_nope, q_pe, meta: AttentionMetadata, out: torch.Tensor) -> None:
        """This rank's partials over its latent rows, merged across the ranks: decodes in
        latent space before W_UV (linear: the merge commutes with it), prefill rows per head.
        One all-gather per kind present (every rank has the same step, so the same calls)."""
        dcp, d = meta.backend, meta.num_decode
        if d:
            o_lat, lse = self._dcp_decode_partial(q_nope[:d], q_pe[:d], meta)
            o_lat, _ = dcp.merge_across(torch.cat([o_lat, lse.unsqueeze(-1)], dim=-1))
            _, w_uv_t = self.kv_b_proj.absorbed()
            o_lat = o_lat.to(w_uv_t.dtype)
            out[:d] = torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)
        if meta.prefills:
            parts = [self._dcp_prefill_partial(q_nope[c.start:c.end], q_pe[c.start:c.end], c,
                                               meta, dcp.layout) for c in meta.prefills]
            merged, _ = dcp.merge_across(torch.cat(parts))
            out[d:] = merged.to(out.dtype)  # prefill chunks follow the decodes, back to back

    def _dcp_decode_partial(self, q_nope, q_pe, meta: AttentionMetadata):
        """Absorbed scores over the local rows: (out_lat [d, heads, rank], lse [d, heads])."""
        tables, valid = decode_inputs(meta)  # local key counts (0 allowed)
        d = q_nope.shape[0]
        rows = self.latent_cache.index_select(0, tables.view(-1)).view(d, valid.shape[1], -1)
        rows = rows[..., :self.latent_dim]
        w_uk, _ = self.kv_b_proj.absorbed()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        return softmax_partial(torch.cat([q_lat, q_pe], dim=-1), rows, rows[..., :self.rank],
                               valid[:, None, :], self.scale)

    def _dcp_prefill_partial(self, q_nope, q_pe, c, meta: AttentionMetadata, layout):
        """Decompressed over the local rows of positions < the chunk's end, causal by global
        position: [n, heads, v_dim + 1] fp32, the LSE last."""
        n, bs = q_nope.shape[0], meta.block_size
        nk = int(layout.local_count(c.start_pos + n))
        part = torch.zeros(n, self.heads, self.v_dim + 1, dtype=torch.float32, device=q_nope.device)
        part[..., -1] = float("-inf")
        if nk == 0:
            return part
        blocks = torch.from_numpy(c.table[:(nk + bs - 1) // bs].astype(np.int64)).to(q_nope.device)
        rows = self.latent_cache.index_select(0, blocks).flatten(0, 1)[:nk, :self.latent_dim]
        ckv, k_pe = rows.to(q_nope.dtype).split([self.rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(ckv)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        key_pos = torch.from_numpy(layout.global_positions(nk)).to(q.device)
        q_pos = torch.arange(c.start_pos, c.start_pos + n, device=q.device)
        o, lse = softmax_partial(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                 key_pos[None, :] <= q_pos[:, None], self.scale)
        part[..., :-1], part[..., -1] = o.transpose(0, 1), lse.transpose(0, 1)
        return part

    def _decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Absorbed: [decodes, heads, v_dim] from the latent rows, never expanded per head."""
        tables, valid = decode_inputs(meta)
        d = q_nope.shape[0]
        rows = self.latent_cache.index_select(0, tables.view(-1)).to(q_nope.dtype)
        rows = rows.view(d, -1, rows.shape[-1])  # [d, keys, latent (+1 pad)], contiguous
        if rows.shape[-1] != self.latent_dim:
            rows = rows[..., :self.latent_dim]
        w_uk, w_uv_t = self.kv_b_proj.absorbed()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [d, heads, rank]
        # [q_lat | q_pe] . [c_kv | k_pe]: both score terms in one product over whole rows.
        scores = torch.bmm(torch.cat([q_lat, q_pe], dim=-1), rows.transpose(1, 2))  # [d, heads, keys]
        scores = (scores * self.scale).float().masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(rows.dtype)
        out_lat = torch.bmm(probs, rows)[..., :self.rank]  # k_pe columns computed and dropped
        return torch.bmm(out_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [d, heads, v]

    def _prefill(self, q_nope, q_pe, fresh: torch.Tensor, c, meta: AttentionMetadata) -> torch.Tensor:
        """Decompressed: the chunk's context rows (its own, or gathered from the pages when it
        continues a cached prefix) become per-head K and V; [n, heads, v_dim]."""
        table, mask = chunk_inputs(meta, c)
        if table is None:
            rows = fresh
        else:
            rows = self.latent_cache.index_select(0, table).flatten(0, 1)[:mask.shape[-1], :self.latent_dim]
            rows = rows.to(q_nope.dtype)  # a --kv-cache-dtype narrower than the model's widens
        ckv, k_pe = rows.split([self.rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(ckv)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return o.transpose(0, 1)


def decode_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded block tables [decodes, width] and the valid-key mask [decodes, width * block_size],
    built once per step for every MLA layer (attention.metadata.padded_decode_tables)."""
    if meta.sliding_window is not None:
        raise ValueError("multi-head latent attention has no sliding-window variant")
    return padded_decode_tables(meta)


def chunk_inputs(meta: AttentionMetadata, c) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(block ids covering the chunk's context, causal mask [n, context]) of a chunk that
    continues a cached prefix, once per step; (None, None) for a fresh chunk (plain causal)."""
    key = ("mla_chunk", c.start)
    got = meta.derived.get(key)
    if got is not None:
        return got
    table = mask = None
    if c.start_pos:
        n, ctx = c.end - c.start, c.start_pos + (c.end - c.start)
        blocks = c.table[:(ctx + meta.block_size - 1) // meta.block_size].astype(np.int64)
        table = torch.from_numpy(blocks).to(meta.device)
        q_pos = torch.arange(c.start_pos, c.start_pos + n)
        mask = (torch.arange(ctx)[None, :] <= q_pos[:, None]).to(meta.device)
    meta.derived[key] = (table, mask)
    return table, mask

# MLA under TP x DCP.
# MLA under TP x DCP (tensor_parallel_size = decode_context_parallel_size = N): the N ranks
# split the query heads (TP: rank r owns heads r*h .. r*h + h - 1, h = heads / N, with their
# kv_b_proj rows and o_proj columns) AND every sequence's latent rows by token (DCP layout), so a
# 100K context's latent cache is stored once across the ranks instead of once per rank, as
# vLLM's `-tp 8 -dcp 8` does for DeepSeek.
#
# - decode (absorbed): each rank moves its heads' queries into latent space (its W_UK rows), the
#   ranks all-gather them, each rank scores every head over its own latent rows (the latent rows
#   are shared by all heads, so no per-head weight is needed), and the partials [decodes, heads,
#   kv_lora_rank + 1] are all-gathered and merged by log-sum-exp; each rank keeps its heads and
#   maps them back with its W_UV rows. Two all-gathers per layer.
# - prefill (decompressed): each rank all-gathers the chunk's context latent rows (every rank's
#   share, placed at their global positions) and runs the usual decompressed attention for its
#   heads. Prefill is compute-bound; its context rows cross once per chunk and layer.
# Every rank runs the same collectives in the same order (decodes first, then chunks in order).


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
