"""Tensor-parallel layers (Megatron's split): each rank holds a slice, one collective joins them.

- Column-parallel (q/k/v, gate/up): the output features are split; each rank's slice is a plain
  nn.Linear of out/N rows and needs no communication (its heads / intermediate columns are its
  own), so the fused qkv_proj / gate_up_proj stay the single-rank modules, built smaller.
- RowParallelLinear (o_proj, down_proj): the input features are split, each rank computes a
  partial sum of the full output, and one all-reduce adds them (no bias: none of the
  supported families has one there).
- VocabParallelEmbedding: rank r holds vocabulary rows [r*V/N, (r+1)*V/N) (padded to a
  multiple of N with zero rows); a token outside the slice gives zeros, so an all-reduce gives
  every rank the full embedding. As the LM head it yields logits of the rank's vocab slice;
  gather_logits joins them on rank 0 (the sampler's rank) and drops the padding.
The inner modules stay nn.Linear / nn.Embedding, so the CPU weight layouts (weight_layout.py)
apply to them unchanged. Nothing here runs at tensor_parallel_size 1.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.parallel.state import TPGroup


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) (+ bias once): x_r and W_r the rank's input-feature slice."""

    def __init__(self, linear: nn.Module, tp: TPGroup) -> None:
        super().__init__()
        self.linear = linear
        self.tp = tp
        if linear.bias is not None:
            # it would be summed N times; the Llama split has none (gpt-oss's biased o_proj
            # is all-reduced by a hook instead: gpt_oss.py, its bias loaded on rank 0 only)
            raise NotImplementedError("a row-parallel linear with a bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.linear.forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over the rank's vocabulary slice; forward returns full embeddings."""

    def __init__(self, vocab_per_rank: int, hidden: int, vocab_size: int, tp: TPGroup) -> None:
        super().__init__(vocab_per_rank, hidden)
        self.tp = tp
        self.vocab_size = vocab_size
        self.start = tp.rank * vocab_per_rank
        self.end = min(self.start + vocab_per_rank, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding((ids - self.start).masked_fill_(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


def vocab_per_rank(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size)


def gather_logits(local: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """Rank 0: [rows, vocab_size] logits from every rank's slice; other ranks: their slice
    (which nobody reads: only rank 0 samples)."""
    parts = tp.gather_to_driver(local)
    if parts is None:
        return local
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def argmax_logits(local: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """argmax over the whole vocabulary of vocab-split logits ([rows, V/N] per rank), the same
    ids on every rank: each rank's best of its slice (its padding rows excluded), all-gathered
    as (value, id) pairs; among equal values the lowest id wins, as torch.argmax of the joined
    logits does. [rows, 2] values move, not the logits."""
    start = tp.rank * local.shape[-1]
    real = max(0, min(local.shape[-1], vocab_size - start))
    if real:
        idx = local[..., :real].argmax(dim=-1)  # the first maximum of the slice
        best = local.gather(-1, idx.unsqueeze(-1)).squeeze(-1).double()
    else:  # a rank whose slice is padding only (a vocabulary of fewer than N(N - 1) ids)
        idx = torch.zeros(local.shape[:-1], dtype=torch.long, device=local.device)
        best = torch.full(local.shape[:-1], float("-inf"), dtype=torch.double,
                          device=local.device)
    every = tp.all_gather(torch.stack([best, (idx + start).double()], dim=-1))  # [N, rows, 2]
    winner = every[..., 0].argmax(dim=0)  # the first rank holding the maximum: the lowest id
    return every[..., 1].gather(0, winner.unsqueeze(0)).squeeze(0).long()
