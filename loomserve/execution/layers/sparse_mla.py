"""DeepSeek Sparse Attention (DeepSeek-V3.2): MLA whose queries see only the top-k keys that
the lightning indexer picks.

The indexer, per layer: q_idx = wq_b(q_resid) ([heads, index_head_dim]), one key per token
k_idx = LayerNorm(wk(x)), both rotated (half-split RoPE) on their first qk_rope_head_dim dims,
and per-head weights w = weights_proj(x) / sqrt(heads). A query at p scores each key t <= p as
    I(p, t) = sum_h w_h relu(q_idx_h . k_idx(t) / sqrt(index_head_dim))
and attends (MLA, as layers/mla.py) to the index_topk keys of highest I; with p + 1 <= index_topk
every key is chosen (dense MLA).

Cache: the indexer keys are their own KV group (kv/spec.py IndexerKeySpec: per token a row of
the keys of a few layers side by side, IndexerKeyBank), so prefix hits, tiers and P/D move them
like the latent rows. Each step the layer gets two metadata objects, (its latent group's, its
indexer group's): same positions, different pages.

- decode: the indexer's pass reads the context's indexer keys (index_head_dim per token), takes
  the top-k positions, maps them through the latent group's block table to pool slots, and the
  absorbed attention reads just those latent rows in place (Triton on CUDA: rows by slot, never a
  gather of the context; on the CPU: the top-k rows only). Past the indexer's pass the cost is
  top-k's, not the context's.
- prefill: each query row's top-k as a boolean mask over the chunk's context (decompressed
  attention, as MLA's prefill).
Decode context parallelism (-dcp D): each rank scores its own keys, the ranks' top-k
candidates are all-gathered and the global top-k taken alike on every rank (_dcp_attention).
TP x DCP as MLA's (layers/mla.py) with the same global top-k. Prefill context parallelism:
both caches' prefill rows exchanged (latent rows and indexer keys), then the one-rank path.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.attention.kv_dtype import as_cached, to_cache
from loomserve.execution.attention.metadata import padded_decode_tables
from loomserve.execution.layers.attention import AttentionMetadata
from loomserve.execution.layers.mla import (
    MultiHeadLatentAttention,
    chunk_inputs,
    context_rows,
    latent_view,
)
from loomserve.execution.layers.rotary import apply_rope
from loomserve.execution.parallel.context_parallel import softmax_partial

# Elements of one prefill score block ([rows, heads, context] fp32): bounds the indexer's
# prefill memory at long context.
PREFILL_SCORE_ELEMS = 1 << 25
# Keys one decode scoring pass reads at a time ([heads, keys] fp32 scores: 1 MiB at 64 heads).
DECODE_SCORE_KEYS = 4096


class LightningIndexer(nn.Module):
    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, rope: int,
                 topk: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rope, self.topk = heads, head_dim, rope, topk
        self.wq_b = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)
        self.scale = head_dim ** -0.5
        self.key_cache: torch.Tensor | None = None  # [blocks, block_size, >= head_dim]
        self._k_view: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None  # the runner's V half: part of key_cache

    @property
    def k_cache(self) -> torch.Tensor | None:
        return self._k_view

    @k_cache.setter
    def k_cache(self, view: torch.Tensor | None) -> None:
        """Bound by the runner (an IndexerKeySpec page region's K half), read whole."""
        self._k_view = view
        self.key_cache = None if view is None else latent_view(view, 2 * view.shape[-1])

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        """(q [n, heads, dim], k [n, dim], head weights [n, heads] fp32)."""
        n, r = x.shape[0], self.rope
        cos, sin, half = rope
        q = self.wq_b(q_resid).view(n, self.heads, self.head_dim)
        q = torch.cat([apply_rope(q[..., :r], cos, sin, half), q[..., r:]], dim=-1)
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        k = torch.cat([apply_rope(k[..., :r], cos, sin, half), k[..., r:]], dim=-1).squeeze(1)
        w = self.weights_proj(x).float() * self.heads ** -0.5
        return q, k, w

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [..., heads, dim], w [..., heads], keys [..., T, dim] -> I [..., T] fp32."""
        s = torch.matmul(q.float(), keys.float().transpose(-1, -2)).mul_(self.scale).relu_()
        return torch.matmul(w.unsqueeze(-2), s).squeeze(-2)

    def decode_scores(self, q: torch.Tensor, w: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """I [d, width * block_size] of decodes q [d, heads, dim] over the keys of their padded
        block tables [d, width], DECODE_SCORE_KEYS keys at a time (the per-head scores of a
        chunk stay in cache; the whole context's would be heads x context fp32)."""
        d, width = tables.shape
        bs = self.key_cache.shape[1]
        out = torch.empty(d, width * bs, dtype=torch.float32, device=q.device)
        step = max(1, DECODE_SCORE_KEYS // bs)
        for b0 in range(0, width, step):
            keys = self.key_cache[tables[:, b0:b0 + step]].flatten(1, 2)[..., :self.head_dim]
            out[:, b0 * bs:b0 * bs + keys.shape[1]] = self.scores(q, w, keys)
        return out

    def write(self, k: torch.Tensor, meta: AttentionMetadata) -> None:
        self.write_rows(meta.slot_blocks, meta.slot_offsets, k)

    def write_rows(self, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor) -> None:
        cache = self.key_cache
        cache[blocks, offsets, :self.head_dim] = to_cache(k, cache.dtype)

    def context_keys(self, table: torch.Tensor, n: int) -> torch.Tensor:
        """The first n keys of a block table [blocks] (prefill continuing a cached prefix)."""
        return self.key_cache.index_select(0, table).flatten(0, 1)[:n, :self.head_dim]


class IndexerKeyBank(nn.Module):
    """One cache entry holding the indexer keys of several layers side by side (a row of
    len(members) x index_head_dim per token), so that an indexer page holds about the bytes
    of a latent page (pages are as large as the largest group's block: one layer's keys per
    entry would leave most of each indexer page empty). Each member reads its own columns."""

    def __init__(self, members: list[LightningIndexer]) -> None:
        super().__init__()
        self._members = list(members)  # a plain list: the layers own the modules
        self._k_view: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    @property
    def k_cache(self) -> torch.Tensor | None:
        return self._k_view

    @k_cache.setter
    def k_cache(self, view: torch.Tensor | None) -> None:
        """Bound by the runner (an IndexerKeySpec page region's K half): member j's keys are
        columns j * head_dim .. (j + 1) * head_dim - 1 of the region read whole."""
        self._k_view = view
        rows = None if view is None else latent_view(view, 2 * view.shape[-1])
        for j, m in enumerate(self._members):
            m.key_cache = None if rows is None else rows[..., j * m.head_dim:(j + 1) * m.head_dim]


class SparseLatentAttention(MultiHeadLatentAttention):
    """MultiHeadLatentAttention with a lightning indexer; forward takes (latent meta, indexer
    meta). Requires a query LoRA (the indexer reads q_resid)."""

    def __init__(self, hidden: int, heads: int, q_lora_rank: int, kv_lora_rank: int, nope: int,
                 rope: int, v_head_dim: int, bias: bool, scale: float, index_heads: int,
                 index_head_dim: int, index_topk: int) -> None:
        super().__init__(hidden, heads, q_lora_rank, kv_lora_rank, nope, rope, v_head_dim, bias,
                         scale)
        self.indexer = LightningIndexer(hidden, q_lora_rank, index_heads, index_head_dim, rope,
                                        index_topk)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, int],
                meta: tuple[AttentionMetadata, AttentionMetadata]) -> torch.Tensor:
        lat, idx = meta
        dcp = getattr(lat.backend, "name", None) == "dcp"
        n = x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(n, self.heads, self.qk_dim).split([self.nope, self.rope], dim=-1)
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        cos, sin, half = rope
        q_pe = apply_rope(q_pe, cos, sin, half)
        k_pe = apply_rope(k_pe.unsqueeze(1), cos, sin, half).squeeze(1)
        # both rows rounded as their pages keep them, so a fresh chunk scores and attends as a
        # continued one (or a decode) reading them back does
        latent = as_cached(torch.cat([self.kv_a_layernorm(ckv), k_pe], dim=-1), self.latent_cache.dtype)
        rows = lat.write_rows  # decode context parallelism: the rows this rank stores
        self.latent_cache[lat.slot_blocks, lat.slot_offsets, :self.latent_dim] = (
            latent if rows is None else latent[rows]).to(self.latent_cache.dtype)
        iq, ik, iw = self.indexer.project(x, q_resid, rope)
        ik = as_cached(ik, self.indexer.key_cache.dtype)
        self.indexer.write(ik if idx.write_rows is None else ik[idx.write_rows], idx)
        if getattr(lat.backend, "name", None) == "pcp":  # the other ranks' prefill rows, both caches
            lat.backend.exchange(latent, lat, self._write_latent)
            idx.backend.exchange(ik, idx, self.indexer.write_rows)
        out = x.new_empty(n, self.heads, self.v_dim)
        if dcp and lat.backend.group.tp_size > 1:  # TP x DCP: this rank's heads, every rank's keys
            self._tp_dcp_attention(q_nope, q_pe, iq, iw, lat, idx, out)
            return self.o_proj(out.view(n, self.heads * self.v_dim))
        if dcp:
            self._dcp_attention(q_nope, q_pe, iq, iw, lat, idx, out)
            return self.o_proj(out.view(n, self.heads * self.v_dim))
        d = lat.num_decode
        if d:
            slots, valid = select_decode(self.indexer, iq[:d], iw[:d], lat, idx)
            triton = getattr(lat.backend, "name", None) == "triton" and \
                self.latent_cache.dtype in (torch.float32, torch.bfloat16, torch.float16)
            out[:d] = self._sparse_decode(q_nope[:d], q_pe[:d], slots, valid, triton)
        for c, ci in zip(lat.prefills, idx.prefills):
            s = slice(c.start, c.end)
            out[s] = self._sparse_prefill(q_nope[s], q_pe[s], iq[s], iw[s], latent[s], ik[s], c, ci, lat, idx)
        return self.o_proj(out.view(n, self.heads * self.v_dim))

    def _sparse_decode(self, q_nope, q_pe, slots: torch.Tensor, valid: torch.Tensor,
                       triton: bool) -> torch.Tensor:
        """Absorbed attention over the selected latent rows only: [d, heads, v_dim]. triton: the
        Triton kernel (the CUDA backend's; an 8-bit cache takes the torch path)."""
        w_uk, w_uv_t = self.kv_b_proj.absorbed()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [d, heads, rank]
        q_cat = torch.cat([q_lat, q_pe], dim=-1)
        decode = sparse_decode_triton if triton else sparse_decode_torch
        out_lat = decode(q_cat, self.latent_cache, slots, valid, self.rank, self.scale).to(w_uv_t.dtype)
        return torch.bmm(out_lat.transpose(0, 1), w_uv_t).transpose(0, 1)

    def _sparse_prefill(self, q_nope, q_pe, iq, iw, fresh, fresh_keys, c, ci, lat, idx):
        """Decompressed attention of one chunk, each query row masked to its top-k keys."""
        table, _ = chunk_inputs(lat, c)
        ctx = c.end - c.start + c.start_pos
        if table is None:
            rows, keys = fresh, fresh_keys
        else:
            rows = self.latent_cache.index_select(0, table).flatten(0, 1)[:ctx, :self.latent_dim]
            rows = rows.to(q_nope.dtype)
            itable, _ = chunk_inputs(idx, ci)
            keys = self.indexer.context_keys(itable, ctx)
        return self._masked_prefill(q_nope, q_pe, rows,
                                    select_prefill(self.indexer, iq, iw, keys, c.start_pos))

    def _masked_prefill(self, q_nope, q_pe, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Decompressed attention of n query rows over the context's latent rows [ctx, latent]
        under a boolean mask [n, ctx]: [n, heads, v_dim]."""
        ckv, k_pe = rows.split([self.rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(ckv)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, scale=self.scale)
        return o.transpose(0, 1)

    # --- decode context parallelism: each rank's keys, the top-k over every rank's ----------

    def _dcp_attention(self, q_nope, q_pe, iq, iw, lat, idx, out: torch.Tensor) -> None:
        """Under DCP (-dcp D) each rank holds 1/D of every sequence's latent rows and indexer
        keys (the same local slots in both groups). Per query: local indexer scores, their
        top-k candidates all-gathered, the global top-k taken (the same on every rank), and
        this rank's selected rows give a softmax partial merged across the ranks as MLA's
        (latent space for decodes, head space for prefill rows). Every rank runs the same
        collectives: per step one candidate gather for the decodes and per prefill row block,
        then one partial merge per kind present."""
        dcp, d = lat.backend, lat.num_decode
        if d:
            local, mine = dcp_select(self.indexer, iq[:d], iw[:d], lat, idx, dcp)
            ltables, _ = padded_decode_tables(lat)
            b = lat.block_size
            slots = ltables.gather(1, local // b) * b + local % b
            w_uk, w_uv_t = self.kv_b_proj.absorbed()
            q_lat = torch.bmm(q_nope[:d].transpose(0, 1), w_uk).transpose(0, 1)
            rows = rows_at(self.latent_cache, slots, self.latent_dim).to(q_lat.dtype)
            o_lat, lse = softmax_partial(torch.cat([q_lat, q_pe[:d]], dim=-1), rows,
                                         rows[..., :self.rank], mine[:, None, :], self.scale)
            o_lat, _ = dcp.merge_across(torch.cat([o_lat, lse.unsqueeze(-1)], dim=-1))
            out[:d] = torch.bmm(o_lat.to(w_uv_t.dtype).transpose(0, 1), w_uv_t).transpose(0, 1)
        if lat.prefills:
            parts = [self._dcp_prefill_partial(q_nope[c.start:c.end], q_pe[c.start:c.end],
                                               iq[c.start:c.end], iw[c.start:c.end], c, ci,
                                               dcp) for c, ci in zip(lat.prefills, idx.prefills)]
            merged, _ = dcp.merge_across(torch.cat(parts))
            out[d:] = merged.to(out.dtype)  # prefill chunks follow the decodes, back to back

    def _tp_dcp_attention(self, q_nope, q_pe, iq, iw, lat, idx, out: torch.Tensor) -> None:
        """TP x DCP (layers/mla.py's scheme, the indexer replicated on every rank): decodes
        take the global top-k as under DCP, every rank scores all heads' latent queries
        (all-gathered) over its selected rows, and keeps its heads after the merge; a prefill
        chunk gathers its context's latent rows and indexer keys from every rank and runs the
        one-rank masked prefill for this rank's heads."""
        dcp, d = lat.backend, lat.num_decode
        group, h = dcp.group, self.heads
        if d:
            local, mine = dcp_select(self.indexer, iq[:d], iw[:d], lat, idx, dcp)
            ltables, _ = padded_decode_tables(lat)
            b = lat.block_size
            rows = rows_at(self.latent_cache, ltables.gather(1, local // b) * b + local % b,
                           self.latent_dim)
            w_uk, w_uv_t = self.kv_b_proj.absorbed()
            q_lat = torch.bmm(q_nope[:d].transpose(0, 1), w_uk).transpose(0, 1)
            q_all = group.all_gather(torch.cat([q_lat, q_pe[:d]], dim=-1))  # [N, d, h, L]
            q_all = q_all.permute(1, 0, 2, 3).reshape(d, group.size * h, -1)  # rank order
            rows = rows.to(q_all.dtype)
            o_lat, lse = softmax_partial(q_all, rows, rows[..., :self.rank], mine[:, None, :],
                                         self.scale)
            merged, _ = dcp.merge_across(torch.cat([o_lat, lse.unsqueeze(-1)], dim=-1))
            heads = merged[:, group.rank * h:(group.rank + 1) * h].to(w_uv_t.dtype)
            out[:d] = torch.bmm(heads.transpose(0, 1), w_uv_t).transpose(0, 1)
        keys_of = SimpleNamespace(latent_cache=self.indexer.key_cache,
                                  latent_dim=self.indexer.head_dim)  # context_rows' reader
        for c, ci in zip(lat.prefills, idx.prefills):
            n, s = c.end - c.start, slice(c.start, c.end)
            rows = context_rows(self, c, lat, dcp, n).to(q_nope.dtype)
            keys = context_rows(keys_of, ci, idx, dcp, n)
            mask = select_prefill(self.indexer, iq[s], iw[s], keys, c.start_pos)
            out[s] = self._masked_prefill(q_nope[s], q_pe[s], rows, mask)

    def _dcp_prefill_partial(self, q_nope, q_pe, iq, iw, c, ci, dcp) -> torch.Tensor:
        """A chunk's rows over this rank's keys, each row over its global top-k among them:
        [n, heads, v_dim + 1] fp32, the LSE last."""
        n, lay = q_nope.shape[0], dcp.layout
        b = lay.local_block_size
        ctx = c.start_pos + n
        nk = int(lay.local_count(ctx))
        blocks, iblocks = (torch.from_numpy(t[:(nk + b - 1) // b].astype(np.int64)).to(q_nope.device)
                           for t in (c.table, ci.table))  # each group's own pages
        key_pos = torch.from_numpy(lay.global_positions(nk)).to(q_nope.device)
        q_pos = torch.arange(c.start_pos, ctx, device=q_nope.device)
        causal = key_pos[None, :] <= q_pos[:, None]  # [n, nk]
        keys = self.indexer.context_keys(iblocks, nk) if nk else None
        allowed = torch.zeros(n, nk + 1, dtype=torch.bool, device=q_nope.device)
        step = max(1, PREFILL_SCORE_ELEMS // (self.indexer.heads * ctx))  # the same on every rank
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            scores = (self.indexer.scores(iq[lo:hi], iw[lo:hi], keys) if nk else
                      iq.new_empty(hi - lo, 0, dtype=torch.float32))
            local, mine = global_topk(scores.masked_fill(~causal[lo:hi], float("-inf")),
                                      self.indexer.topk, dcp.group)
            allowed[lo:hi].scatter_(1, torch.where(mine, local, nk), True)  # others: column nk
        allowed = allowed[:, :nk] & causal
        part = torch.zeros(n, self.heads, self.v_dim + 1, dtype=torch.float32, device=q_nope.device)
        part[..., -1] = float("-inf")
        if nk == 0:
            return part
        rows = self.latent_cache.index_select(0, blocks).flatten(0, 1)[:nk, :self.latent_dim]
        ckv, k_pe = rows.to(q_nope.dtype).split([self.rank, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(ckv)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        o, lse = softmax_partial(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                 allowed, self.scale)
        part[..., :-1], part[..., -1] = o.transpose(0, 1), lse.transpose(0, 1)
        return part


def global_topk(scores: torch.Tensor, k: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [rows, local keys] fp32 (-inf: not a key) on every rank of `group` -> (local key
    index [rows, k], mine [rows, k]): the k best keys over every rank's, those held here. The
    ranks' top-k candidates are all-gathered (value, local index; indices < 2^24 are exact in
    fp32) and the same top-k is taken on every rank; fewer than k real keys: the rest not mine."""
    rows, n = scores.shape
    kl = min(k, n)
    pack = torch.full((rows, k, 2), float("-inf"), dtype=torch.float32, device=scores.device)
    if kl:
        val, j = scores.topk(kl, dim=-1)
        pack[:, :kl, 0], pack[:, :kl, 1] = val, j.float()
    every = group.all_gather(pack)  # [D, rows, k, 2]
    vals = every[..., 0].permute(1, 0, 2).reshape(rows, -1)
    top_v, top = vals.topk(k, dim=-1)
    src, col = top // k, top % k
    mine = (src == group.rank) & (top_v > float("-inf"))
    local = every[group.rank, :, :, 1].gather(1, col).clamp_min(0).long()
    return torch.where(mine, local, 0), mine


def dcp_select(indexer: LightningIndexer, q: torch.Tensor, w: torch.Tensor, lat: AttentionMetadata,
               idx: AttentionMetadata, dcp) -> tuple[torch.Tensor, torch.Tensor]:
    """The decodes' global top-k under DCP: (local key index into the padded local tables
    [d, k], mine [d, k])."""
    itables, ivalid = padded_decode_tables(idx)  # local key counts (0 allowed)
    scores = indexer.decode_scores(q, w, itables).masked_fill_(~ivalid, float("-inf"))
    return global_topk(scores, indexer.topk, dcp.group)


def select_decode(indexer: LightningIndexer, q: torch.Tensor, w: torch.Tensor,
                  lat: AttentionMetadata, idx: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's pass for the step's decodes: (latent pool slots [d, k] of each decode's
    top-k positions, k = min(index_topk, padded context), flat over [blocks * block_size];
    valid [d, k]: the slot is a real key). A context of <= index_topk keys selects all of it."""
    itables, ivalid = padded_decode_tables(idx)  # same lengths as the latent group's
    ltables, _ = padded_decode_tables(lat)
    bs = idx.block_size
    scores = indexer.decode_scores(q, w, itables).masked_fill_(~ivalid, float("-inf"))  # [d, T]
    k = min(indexer.topk, scores.shape[1])
    top = scores.topk(k, dim=-1).indices  # positions
    valid = ivalid.gather(1, top)
    slots = ltables.gather(1, top // bs) * bs + top % bs
    return slots, valid


def select_prefill(indexer: LightningIndexer, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                   start_pos: int) -> torch.Tensor:
    """Boolean [n, ctx]: query row i (position start_pos + i) may see key t: causal and among
    its index_topk highest-scoring keys. Scored in row blocks (PREFILL_SCORE_ELEMS)."""
    n, ctx = q.shape[0], keys.shape[0]
    q_pos = torch.arange(start_pos, start_pos + n, device=q.device)
    causal = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
    k = min(indexer.topk, ctx)
    if k == ctx:  # every causal key is chosen
        return causal
    mask = torch.zeros(n, ctx, dtype=torch.bool, device=q.device)
    step = max(1, PREFILL_SCORE_ELEMS // (indexer.heads * ctx))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        s = indexer.scores(q[lo:hi], w[lo:hi], keys).masked_fill(~causal[lo:hi], float("-inf"))
        mask[lo:hi].scatter_(1, s.topk(k, dim=-1).indices, True)
    return mask & causal


def rows_at(cache: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
    """cache [blocks, block_size, >= width] rows at flat slots (block * block_size + row)
    [d, k] -> [d, k, width]. Where pages lie a whole number of rows apart (both pool layouts)
    the cache is viewed as one run of rows and read by one index_select of whole rows (6x
    faster than two-index advanced indexing for 2,048 rows of 576 here)."""
    blocks, bs, full = cache.shape
    s0 = cache.stride(0)
    if cache.stride(2) == 1 and cache.stride(1) == full and s0 % full == 0:
        per = s0 // full  # rows from one page's start to the next's
        flat = torch.as_strided(cache, ((blocks - 1) * per + bs, full), (full, 1))
        at = (slots // bs) * per + slots % bs
        return flat.index_select(0, at.reshape(-1)).view(*slots.shape, full)[..., :width]
    return cache[slots // bs, slots % bs, :width]


def sparse_decode_torch(q_cat: torch.Tensor, latent_cache: torch.Tensor, slots: torch.Tensor,
                        valid: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """q_cat [d, heads, rank + rope] over the rows at `slots` [d, k] -> [d, heads, rank]: reads
    those k rows per decode, whatever the context."""
    rows = rows_at(latent_cache, slots, q_cat.shape[-1]).to(q_cat.dtype)  # [d, k, latent]
    scores = torch.bmm(q_cat, rows.transpose(1, 2))
    scores = (scores * scale).float().masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(rows.dtype)
    return torch.bmm(probs, rows[..., :rank])


def sparse_decode_triton(q_cat: torch.Tensor, latent_cache: torch.Tensor, slots: torch.Tensor,
                         valid: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """The Triton path (attention/triton_kernels.py sparse_mla_decode): each selected row read
    in place from the pages by its slot, split over the k rows, merged here; fp32 [d, heads,
    rank]. Same contract as sparse_decode_torch."""
    from loomserve.execution.attention import triton_kernels

    cfg = sparse_decode_config(q_cat, rank, slots.shape[1])
    d, heads = q_cat.shape[:2]
    q_cat = q_cat.contiguous()
    slots = torch.where(valid, slots, -1).to(torch.int32).contiguous()
    n_split, pad = cfg["n_split"], cfg["RANK_PAD"]
    acc = torch.empty(d, n_split, heads, pad, dtype=torch.float32, device=q_cat.device)
    ml = torch.empty(d, n_split, heads, 2, dtype=torch.float32, device=q_cat.device)
    grid = (d, -(-heads // cfg["BLOCK_H"]), n_split)
    triton_kernels.sparse_mla_decode[grid](
        q_cat, latent_cache, slots, acc, ml, q_cat.stride(0), q_cat.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), slots.stride(0), scale,
        latent_cache.shape[1], slots.shape[1], heads, n_split,
        **{k: v for k, v in cfg.items() if k != "n_split"})
    top, total = ml[..., 0], ml[..., 1]  # per split: (max, sum) [d, splits, heads]
    w = torch.exp(top - top.amax(dim=1, keepdim=True)).nan_to_num(0.0)  # empty: exp(-inf) = 0
    out = (w.unsqueeze(-1) * acc).sum(1) / (w * total).sum(1).unsqueeze(-1)
    return out[..., :rank]


def sparse_decode_config(q_cat: torch.Tensor, rank: int, k: int) -> dict:
    """Launch constants: tl.dot needs every dimension >= 16; splits so that a few decodes still
    fill the device (each split at least 256 rows); IEEE fp32 products for fp32 runs and under
    the interpreter (its 16-bit dot is wrong)."""
    from triton import knobs

    pad = lambda n: max(16, 1 << (max(n, 1) - 1).bit_length())  # noqa: E731
    rope = q_cat.shape[-1] - rank
    return dict(n_split=max(1, min(16, k // 256)), RANK=rank, RANK_PAD=pad(rank), ROPE=rope,
                ROPE_PAD=pad(rope), BLOCK_H=16, BLOCK_K=16 if rank > 256 else 32,
                IEEE=q_cat.dtype == torch.float32 or bool(knobs.runtime.interpret))
