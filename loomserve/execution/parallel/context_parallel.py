"""Decode context parallelism (DCP): every sequence's KV split over D ranks by token.

Layout, and how it maps to vLLM's. vLLM keeps its KV manager on a *virtual* block of
block_size x D tokens, of which each rank physically stores block_size. Here the scheduler's
block IS the virtual block: --block-size B stays the unit of the KV manager, prefix hashing,
tiers and hit accounting, and each rank's page of a block holds b = B / D of its tokens. Token
t of a sequence lives on rank (t // I) % D, at local slot (t % B) // (I D) * I + t % I of block
t // B (I = --dcp-kv-cache-interleave-size; I x D divides B). A block id names the same block on
every rank, so a prefix hit is a hit on every rank and cached_tokens is what it is at D = 1;
a page holds b tokens, so the same --kv-cache-memory per rank plans D x the blocks: the pool
holds D x the tokens (the scheduler sees capacity_tokens D x larger).

Ranks: world = D with tensor_parallel_size 1 (or D, below). Every rank runs the whole model on every token
(the non-attention work is replicated, as vLLM's DCP ranks replicate it inside their TP group),
writes only the K/V rows it owns, and attends over its share: per query row a softmax partial
(o_r, lse_r) over rank r's keys the row may see (global positions <= its own). The partials are
all-gathered and merged exactly (merge_partials): lse = logsumexp_r lse_r,
o = sum_r exp(lse_r - lse) o_r. Every rank merges the same gathered tensor in the same order, so
the replicas hold identical hidden states and never drift. Decodes read the local pages with the
C paged kernel (its per-split maxima and sums give the LSE, cpu_backend.decode_lse); prefill
chunks (cached context and their own keys, causal by global position) take torch's CPU flash
kernel with a mask (it returns the LSE) in tiles of keys, or a portable matmul path elsewhere.
Communication: one all-gather per attention layer of [tokens, heads, head_dim + 1] fp32 per rank.
MLA (DeepSeek-V3, layers/mla.py) merges its absorbed decode's partials in latent space, before
W_UV (linear, so the merge commutes with it), and its decompressed prefill's in head space.
Sliding-window layers (Mistral, Gemma 3, gpt-oss) keep keys by global position in both
partials; their decodes take the torch partial (the C kernel's window would count local keys).
Linear-state (Qwen3-Next) and Mamba (Nemotron-H) layers run replicated: every rank keeps the
whole state in its pages (a page is sized by the larger of its groups, so where the state
outweighs half a block's attention, DCP adds no capacity).
TP x DCP (tensor_parallel_size = D, the same ranks): MLA models only (layers/mla.py, tp_dcp_attention).
A model class opts in by declaring `supports_dcp = True` in its own body (`supports_tp_dcp` for
TP x DCP) once verified against one rank (tests/execution/test_decode_context_parallel.py);
others are refused at start (preflight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from loomserve.execution.attention.metadata import (
    AttentionMetadata,
    PrefillChunk,
    padded_decode_tables,
)
from loomserve.execution.parallel.state import get_dcp

TILE_KEYS = 2048  # keys per step of the prefill partial (bounds its score matrix)
TILE_ROWS = 256  # query rows per step of the prefill partial (the matmul path)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(frozen=True)
class DcpLayout:
    """Where each token's K/V lives. Invariant: block_size % (interleave * size) == 0."""

    rank: int
    size: int
    block_size: int  # B, the scheduler's block
    interleave: int = 1

    def __post_init__(self) -> None:
        if self.block_size % (self.interleave * self.size):
            raise ValueError(f"--block-size {self.block_size} must be a multiple of "
                             f"--dcp-kv-cache-interleave-size {self.interleave} x "
                             f"--decode-context-parallel-size {self.size}")

    @property
    def local_block_size(self) -> int:
        return self.block_size // self.size

    def owner(self, pos: np.ndarray) -> np.ndarray:
        return (pos % self.block_size) // self.interleave % self.size

    def local_slot(self, pos: np.ndarray) -> np.ndarray:
        w, i = pos % self.block_size, self.interleave
        return w // (i * self.size) * i + w % i

    def local_count(self, lengths) -> np.ndarray:
        """Keys of a sequence of `lengths` tokens that this rank holds (local slots 0..n-1)."""
        n = np.asarray(lengths, dtype=np.int64)
        i, d = self.interleave, self.size
        w = n % self.block_size
        return (n // self.block_size * self.local_block_size + w // (i * d) * i
                + np.clip(w % (i * d) - self.rank * i, 0, i))

    def global_positions(self, n_local: int) -> np.ndarray:
        """Sequence positions of this rank's local keys 0..n_local-1."""
        j = np.arange(n_local, dtype=np.int64)
        off, i = j % self.local_block_size, self.interleave
        return (j // self.local_block_size * self.block_size + off // i * (i * self.size)
                + self.rank * i + off % i)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax partials over disjoint key sets -> the joint attention.
    outs: [P, ..., head_dim] (each normalized over its own keys; 0 where it saw none),
    lses: [P, ...] (-inf where it saw none). Returns (out [..., head_dim], lse [...])."""
    lse = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # no key at all: out 0
    w = torch.exp(lses - safe)
    return (w.unsqueeze(-1) * outs).sum(0), lse


def softmax_partial(q, k, v, allowed, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (out, lse) of q [..., rows, hd] over k, v [..., keys, hd], `allowed` broadcast to
    [..., rows, keys]; rows that see no key get out 0 and lse -inf."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    return torch.matmul(p, v.float()), lse


def decode_partial(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, group: int,
                   layout: DcpLayout | None = None):
    """Torch (out, lse) of the decode rows over this rank's pages (meta localized). A sliding
    window (meta.sliding_window; layout then required) keeps the keys whose global position is
    within it of the row's (localize left the rows' positions in derived["dcp_decode_pos"])."""
    d, heads, hd = q.shape
    kvh = heads // group
    tables, valid = padded_decode_tables(meta)  # local key counts (0 allowed)
    w = meta.sliding_window
    if w is not None:
        key_pos = torch.from_numpy(layout.global_positions(valid.shape[1])).to(valid.device)
        q_pos = torch.from_numpy(meta.derived["dcp_decode_pos"]).to(valid.device)
        valid = valid & (key_pos[None, :] > (q_pos - w)[:, None])
    ids = tables.view(-1)
    kb = k_cache[ids].view(d, valid.shape[1], kvh, hd).transpose(1, 2)
    vb = v_cache[ids].view(d, valid.shape[1], kvh, hd).transpose(1, 2)
    o, lse = softmax_partial(q.view(d, kvh, group, hd), kb, vb, valid[:, None, None, :], scale)
    return o.reshape(d, heads, hd), lse.reshape(d, heads)


def prefill_partial(q, k_cache, v_cache, meta: AttentionMetadata, c: PrefillChunk,
                    layout: DcpLayout, scale: float, group: int, flash: bool | None = None):
    """(out, lse) of a chunk's rows q [n, heads, hd] over this rank's keys of positions
    < the chunk's end, each row seeing keys at positions <= its own (its own chunk included:
    the rows were written before the call) and, with a sliding window W, at positions > its
    own - W. flash: torch's CPU flash kernel with a mask (the default on CPU) instead of the
    portable matmul path."""
    n, heads, hd = q.shape
    b = meta.block_size
    w = meta.sliding_window
    nk = int(layout.local_count(c.start_pos + n))
    # keys before the first row's window are skipped in whole local blocks
    first = 0 if w is None else int(layout.local_count(max(0, c.start_pos - w + 1))) // b * b
    out = torch.zeros(n, heads, hd, dtype=torch.float32, device=q.device)
    lse = torch.full((n, heads), float("-inf"), dtype=torch.float32, device=q.device)
    if nk == 0:
        return out, lse
    flash = q.device.type == "cpu" if flash is None else flash
    key_pos = torch.from_numpy(layout.global_positions(nk)).to(q.device)
    q_pos = torch.arange(c.start_pos, c.start_pos + n, device=q.device)
    tile = max(1, TILE_KEYS // b) * b
    for a in range(first, nk, tile):
        z = min(a + tile, nk)
        blocks = torch.from_numpy(c.table[a // b:math.ceil(z / b)].astype(np.int64)).to(q.device)
        kt = k_cache[blocks].flatten(0, 1)[:z - a].to(q.dtype)  # [keys, kv_heads, hd]
        vt = v_cache[blocks].flatten(0, 1)[:z - a].to(q.dtype)
        allowed = key_pos[None, a:z] <= q_pos[:, None]  # [n, keys]
        if w is not None:
            allowed &= key_pos[None, a:z] > q_pos[:, None] - w
        step = _flash_tile if flash else _matmul_tile
        ot, lt = step(q, kt, vt, allowed, scale, group)
        out, lse = merge_partials(torch.stack([out, ot]), torch.stack([lse, lt]))
    return out, lse


def _flash_tile(q, k, v, allowed, scale: float, group: int):
    """torch's flash kernel over one key tile: fp32 ([n, heads, hd], [n, heads]). It gives a
    row that sees no key lse 0 (and out 0), so those rows' lse is set to -inf here."""
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
    o, lse = _flash(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0), 0.0, False, attn_mask=mask[None, None],
                    scale=scale)
    lse = lse[0].transpose(0, 1).masked_fill(~allowed.any(-1)[:, None], float("-inf"))
    return o[0].transpose(0, 1).float(), lse


def _matmul_tile(q, k, v, allowed, scale: float, group: int):
    """The portable path over one key tile, in row tiles of TILE_ROWS (bounds the scores)."""
    n, heads, hd = q.shape
    kvh = heads // group
    qh = q.view(n, kvh, group, hd).permute(1, 2, 0, 3)  # [kvh, group, n, hd]
    kh, vh = k.permute(1, 0, 2).unsqueeze(1), v.permute(1, 0, 2).unsqueeze(1)
    outs, lses = [], []
    for r in range(0, n, TILE_ROWS):
        e = min(r + TILE_ROWS, n)
        o, lse = softmax_partial(qh[:, :, r:e], kh, vh, allowed[r:e], scale)
        outs.append(o.permute(2, 0, 1, 3).reshape(e - r, heads, hd))
        lses.append(lse.permute(2, 0, 1).reshape(e - r, heads))
    return torch.cat(outs), torch.cat(lses)


class DcpBackend:
    """The attention backend of a DCP rank: local partials, one all-gather, the exact merge.
    `inner` is the device's backend (its C decode kernel reads the local pages on CPU)."""

    name = "dcp"

    def __init__(self, inner, layout: DcpLayout, group) -> None:
        self.inner, self.layout, self.group = inner, layout, group
        self.calls = {"decode_kernel": 0, "decode_torch": 0, "prefill": 0}
        self.gathered_bytes = 0  # bytes of every all-gathered [tokens, heads, hd + 1] tensor

    def localize(self, meta: AttentionMetadata, positions: torch.Tensor) -> None:
        """Turn the scheduler-block metadata (block size B) into this rank's: only its own
        rows are written, at their local slots in pages of b tokens; decode key counts local."""
        lay = self.layout
        pos = positions.cpu().numpy()
        rows = np.flatnonzero(lay.owner(pos) == lay.rank)
        rows_t = torch.from_numpy(rows).to(meta.slot_blocks.device)
        meta.slot_blocks = meta.slot_blocks[rows_t]
        meta.slot_offsets = torch.from_numpy(lay.local_slot(pos[rows])).to(rows_t.device)
        meta.write_rows = rows_t
        meta.new_blocks = None  # local slots: the runner derives the fresh pages on the device
        meta.block_size = lay.local_block_size
        if meta.decode_lens is not None:
            meta.derived["dcp_decode_pos"] = meta.decode_lens.astype(np.int64) - 1
            meta.decode_lens = lay.local_count(meta.decode_lens).astype(np.int32)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                sinks: torch.Tensor | None) -> torch.Tensor:
        tokens, heads, hd = q.shape
        group = heads // k.shape[1]
        part = torch.empty(tokens, heads, hd + 1, dtype=torch.float32, device=q.device)
        d = meta.num_decode
        if d:
            part[:d, :, :hd], part[:d, :, hd] = self._decode(q[:d], k_cache, v_cache, meta,
                                                             scale, group)
        for c in meta.prefills:
            self.calls["prefill"] += 1
            part[c.start:c.end, :, :hd], part[c.start:c.end, :, hd] = prefill_partial(
                q[c.start:c.end], k_cache, v_cache, meta, c, self.layout, scale, group)
        out, lse = self.merge_across(part)
        if sinks is not None:  # softmax over [scores, sink]: scale by e^lse / (e^lse + e^sink)
            out = out * torch.sigmoid(lse - sinks.float().view(1, -1)).unsqueeze(-1)
        return out.to(q.dtype)

    def merge_across(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """part [..., width + 1] fp32: this rank's partial outputs with their LSE last. One
        all-gather, then the exact merge: (out [..., width], lse [...]), the same on every rank."""
        every = self.group.all_gather(part)  # [D, ..., width + 1]
        self.gathered_bytes += every.numel() * 4
        return merge_partials(every[..., :-1], every[..., -1])

    def _decode(self, q, k_cache, v_cache, meta, scale: float, group: int):
        if meta.sliding_window is not None:  # the kernel's window counts local keys: torch
            self.calls["decode_torch"] += 1
            return decode_partial(q, k_cache, v_cache, meta, scale, group, self.layout)
        kernel = getattr(self.inner, "decode_lse", None)
        got = kernel(q, k_cache, v_cache, meta, scale, group) if kernel is not None else None
        if got is not None:
            self.calls["decode_kernel"] += 1
            return got
        self.calls["decode_torch"] += 1
        return decode_partial(q, k_cache, v_cache, meta, scale, group)


def layout_for(config, block_size: int) -> DcpLayout | None:
    """This process's DCP layout (set_layout ran before the runner), or None without DCP."""
    g = get_dcp()
    if g is None:
        return None
    return DcpLayout(g.rank, g.size, block_size, config.parallel.dcp_kv_cache_interleave_size)


def preflight(config, model_cls: type) -> None:
    """Refuse what DCP cannot serve from the config and the model class (the loader's
    resolve_config) alone, before any process starts (the runner refuses unsupported layer
    kinds again at planning)."""
    pc = config.parallel
    DcpLayout(0, pc.decode_context_parallel_size, config.cache.block_size,
              pc.dcp_kv_cache_interleave_size)
    name = model_cls.__name__
    if pc.tensor_parallel_size > 1 and not vars(model_cls).get("supports_tp_dcp", False):
        raise NotImplementedError(f"decode context parallelism with --tensor-parallel-size > 1 "
                                  f"serves MLA models (their class declares supports_tp_dcp), "
                                  f"whose latent cache TP would replicate; not {name}: use "
                                  f"--tensor-parallel-size 1 with -dcp, or -dcp 1")
    if not vars(model_cls).get("supports_dcp", False):
        raise NotImplementedError(f"decode context parallelism is verified for the model classes "
                                  f"that declare supports_dcp so far, not {name}: serve it with "
                                  f"--decode-context-parallel-size 1")
