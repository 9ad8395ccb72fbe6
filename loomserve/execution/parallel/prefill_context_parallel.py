"""Prefill context parallelism (PCP): a step's prefill tokens split over P ranks.

Each of the P ranks (world = P, tensor_parallel_size 1) holds the whole model and a whole replica
of the KV cache. A step's decode rows run on every rank (one token each); each prefill chunk's
rows are cut into P contiguous pieces, rank r computing piece r, so the projections, MLP and MoE
work of a long prefill splits P ways. At each attention layer the ranks all-gather the K/V of
their prefill rows and every rank writes the whole chunk's K/V into its replica; then each rank
attends for its own rows only, as a chunk starting where its piece starts (the pieces before it
are cached context by then): exact causal attention, its FLOPs split P ways as well. After the
last layer the ranks all-gather the prefill rows' hidden states, so rank 0 samples as at P = 1.

Communication per attention layer: one all-gather of [rows, kv_heads, 2 x head_dim] fp values
per rank (rows = the most prefill rows any rank has this step, the others padded to it); per
step one all-gather of [rows, hidden]. vLLM's PCP also shards the KV across the ranks (its
decode then runs as DCP); here every rank keeps a whole replica (no capacity gain: PCP is for
the latency of long cold prefills) and prefix caching, hits and cached_tokens are those of one
rank. MLA layers exchange their latent rows the same way (one [rows, latent] all-gather per
layer). Linear-state / Mamba layers run through a chunk's tokens in order, so they are not
split: every rank gathers the layer's input rows and runs it on the whole batch (PcpStateLayer),
keeping the state replicas identical. Refused at start: combinations with tensor,
decode-context or data parallelism (ParallelConfig).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from loomserve.execution.attention.metadata import AttentionMetadata, PrefillChunk


@dataclass
class PcpSplit:
    """Which rows of a step's flattened batch (decodes first, then prefill chunks) each rank
    computes. Invariant: every rank computes every decode row and exactly one piece of each
    chunk; the pieces of a chunk are contiguous, in rank order, and cover it."""

    num_decode: int
    local_rows: np.ndarray  # this rank's rows, in batch order
    prefill_rows: list[np.ndarray]  # per rank: the batch rows of its prefill pieces, in order
    pieces: list[tuple[int, int, int]]  # this rank's (chunk index, first row, end row)

    @classmethod
    def of(cls, num_decode: int, chunks: list[PrefillChunk], rank: int, size: int) -> "PcpSplit":
        per_rank: list[list[np.ndarray]] = [[] for _ in range(size)]
        pieces = []
        for i, c in enumerate(chunks):
            n = c.end - c.start
            step = -(-n // size)
            for r in range(size):
                lo, hi = c.start + min(n, r * step), c.start + min(n, (r + 1) * step)
                per_rank[r].append(np.arange(lo, hi, dtype=np.int64))
                if r == rank and hi > lo:
                    pieces.append((i, lo, hi))
        rows = [np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in per_rank]
        local = np.concatenate([np.arange(num_decode, dtype=np.int64), rows[rank]])
        return cls(num_decode, local, rows, pieces)

    @property
    def max_prefill_rows(self) -> int:
        return max(len(r) for r in self.prefill_rows)

    @functools.cached_property
    def local_index(self) -> torch.Tensor:
        """local_rows as a tensor, built once per step for every layer that selects them."""
        return torch.from_numpy(self.local_rows)

    @functools.cached_property
    def prefill_index(self) -> list[torch.Tensor]:
        return [torch.from_numpy(rows) for rows in self.prefill_rows]


def localize(meta: AttentionMetadata, split: PcpSplit, rank: int) -> None:
    """The full step's metadata -> this rank's: only its rows are written by paged_attention
    (the backend writes the other ranks' prefill rows after the exchange), its prefill pieces
    are chunks starting at their own positions."""
    full_blocks, full_offsets = meta.slot_blocks, meta.slot_offsets
    idx = torch.from_numpy(split.local_rows).to(full_blocks.device)
    meta.slot_blocks, meta.slot_offsets = full_blocks[idx], full_offsets[idx]
    chunks, row = [], split.num_decode
    for i, lo, hi in split.pieces:
        c = meta.prefills[i]
        chunks.append(PrefillChunk(row, row + hi - lo, c.start_pos + lo - c.start, c.table))
        row += hi - lo
    meta.prefills = chunks
    others = []
    for r, rows in enumerate(split.prefill_rows):
        if r != rank and len(rows):
            t = torch.from_numpy(rows).to(full_blocks.device)
            others.append((r, full_blocks[t], full_offsets[t]))
    meta.derived["pcp"] = (split.num_decode, split.max_prefill_rows, others)


def gather_rows(group, local: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """All ranks' local[start:] (each padded to `width` rows): [ranks, width, ...]."""
    mine = local[start:]
    pad = torch.zeros((width, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
    pad[:mine.shape[0]] = mine
    return group.all_gather(pad)


class PcpBackend:
    """The attention backend of a PCP rank: the prefill K/V exchange, then `inner` on this
    rank's rows (its pieces' own keys and the cached context before them)."""

    name = "pcp"

    def __init__(self, inner, group) -> None:
        self.inner, self.group = inner, group
        self.exchanged_bytes = 0  # bytes of every all-gathered K/V tensor (all ranks' shares)

    def exchange(self, rows: torch.Tensor, meta: AttentionMetadata, write) -> None:
        """All-gather the prefill rows of `rows` ([local rows, ...], this layer's new cache
        rows) and write(blocks, offsets, their rows) for every other rank's share. Every rank
        calls it once per layer with the same step, so the collectives line up."""
        d, width, others = meta.derived["pcp"]
        if not width:
            return
        every = gather_rows(self.group, rows, d, width)
        self.exchanged_bytes += every.numel() * every.element_size()
        for r, blocks, offsets in others:
            write(blocks, offsets, every[r, :blocks.shape[0]])

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                sinks: torch.Tensor | None) -> torch.Tensor:
        hd = k.shape[-1]

        def write(blocks, offsets, rows):  # exact casts: every rank's paged_attention rounded them
            k_cache[blocks, offsets] = rows[..., :hd].to(k_cache.dtype)
            v_cache[blocks, offsets] = rows[..., hd:].to(v_cache.dtype)
        self.exchange(torch.cat([k, v], dim=-1), meta, write)
        return self.inner.forward(q, k, v, k_cache, v_cache, meta, scale, sinks)


class PcpStateLayer(torch.nn.Module):
    """A linear-state / Mamba mixer under PCP: its state runs through a chunk's tokens in order,
    so every rank gathers the whole batch's input rows, runs the mixer on all of them (the state
    pages stay identical replicas) and keeps its own rows of the output. These layers are not
    split: PCP speeds up the attention and MLP layers of a hybrid model only."""

    def __init__(self, inner: torch.nn.Module, group) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor, sb) -> torch.Tensor:
        split = sb.pcp
        full = full_hidden(self.group, split, x, sb.num_rows)
        out = self.inner(full, sb)
        return out[split.local_index.to(out.device)]


def wrap_state_layers(model: torch.nn.Module, group, kinds: tuple) -> int:
    """Replace every module of the given mixer classes by a PcpStateLayer; how many."""
    found = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, kinds)]
    for parent, name, child in found:
        setattr(parent, name, PcpStateLayer(child, group))
    return len(found)


def full_hidden(group, split: PcpSplit, hidden: torch.Tensor, tokens: int) -> torch.Tensor:
    """This rank's hidden states [local rows, H] -> the whole batch's [tokens, H]."""
    width = split.max_prefill_rows
    out = torch.empty((tokens, hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
    out[:split.num_decode] = hidden[:split.num_decode]
    if width:
        every = gather_rows(group, hidden, split.num_decode, width)
        for r, rows in enumerate(split.prefill_index):
            if len(rows):
                out[rows.to(out.device)] = every[r, :len(rows)]
    return out
