"""Per-row logits processing before sampling: grammar bitmask, suppressed tokens (min_tokens),
logit_bias, repetition / frequency / presence penalties.

Each step touches only the rows that use a feature, with batched tensor ops on the logits'
device (the bitmask is unpacked there). Order, as vLLM's: grammar and suppression (-inf),
logit_bias, then penalties; temperature / top-k / top-p come after, in the sampler.
Semantics: repetition_penalty as HF / vLLM (over prompt + output tokens, a positive logit is
divided by it, a negative one multiplied); frequency / presence as OpenAI (over output tokens
only: logit -= frequency * count + presence * (count > 0)).
"""

from __future__ import annotations

import torch

from loomserve.execution.batch import ScheduledSeq


def apply_logits_processors(logits: torch.Tensor, seqs: list[ScheduledSeq],
                            token_bitmask: torch.Tensor | None) -> None:
    """Modify `logits` ([len(seqs), vocab], fp32) in place."""
    masked = [i for i, s in enumerate(seqs) if s.bitmask_row is not None]
    if masked and token_bitmask is not None:
        apply_bitmask(logits, token_bitmask, masked, [seqs[i].bitmask_row for i in masked])
    for i, s in enumerate(seqs):
        if s.suppress:
            logits[i, _ids(s.suppress, logits)] = float("-inf")
        bias = s.sampling.logit_bias
        if bias:
            ids = _ids(list(bias), logits)
            logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype,
                                           device=logits.device)
    penalized = [i for i, s in enumerate(seqs) if s.history is not None]
    if penalized:
        apply_penalties(logits, [seqs[i] for i in penalized], penalized)


def _ids(ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    return torch.tensor([t for t in ids if t < logits.shape[-1]], dtype=torch.long,
                        device=logits.device)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [rows, words] (bit j of word w: token 32 w + j allowed) -> bool [rows, vocab].
    Unpacked bytewise (little-endian words), so the temporary is one byte per token."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    by = bitmask.contiguous().view(torch.uint8)
    bits = (by.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].view(torch.bool)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                  bitmask_rows: list[int]) -> None:
    """Set to -inf the logits of tokens the grammar disallows, in the given rows (bitmask row
    bitmask_rows[i] for logits row rows[i]). Ids past the bitmask's width (a logits width
    beyond the tokenizer's vocab) are disallowed too. On CPU, xgrammar's kernel (several
    times faster than the torch ops, benchmarks/grammar_mask.py); elsewhere plain torch."""
    width = min(logits.shape[-1], bitmask.shape[-1] * 32)
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        import xgrammar as xgr
        if bitmask.shape[0] != logits.shape[0] or rows != bitmask_rows:
            # The core lays the bitmask out one row per due seq, so this copy is rare.
            full = torch.full((logits.shape[0], bitmask.shape[-1]), -1, dtype=torch.int32)
            full[rows] = bitmask[bitmask_rows]
            bitmask = full
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
    else:
        apply_bitmask_torch(logits, bitmask, rows, bitmask_rows, width)
    if width < logits.shape[-1]:
        logits[torch.tensor(rows, device=logits.device), width:] = float("-inf")


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
                        bitmask_rows: list[int], width: int) -> None:
    """Device-agnostic: the bitmask moves to the logits' device and is unpacked there."""
    bm = bitmask[bitmask_rows].to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(bm, width)
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[idx, :width] = torch.where(allowed, logits[idx, :width], float("-inf"))


def apply_penalties(logits: torch.Tensor, seqs: list[ScheduledSeq], rows: list[int]) -> None:
    vocab = logits.shape[-1]
    dev = logits.device
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    out_counts = _counts([s.history[s.num_prompt_tokens:] for s in seqs], vocab, dev)
    sub = logits[idx]
    rep = torch.tensor([s.sampling.repetition_penalty for s in seqs], device=dev).unsqueeze(1)
    if (rep != 1.0).any():
        seen = _counts([s.history[:s.num_prompt_tokens] for s in seqs], vocab, dev) > 0
        seen |= out_counts > 0
        scaled = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, scaled, sub)
    freq = torch.tensor([s.sampling.frequency_penalty for s in seqs], device=dev).unsqueeze(1)
    pres = torch.tensor([s.sampling.presence_penalty for s in seqs], device=dev).unsqueeze(1)
    sub = sub - freq * out_counts - pres * (out_counts > 0).float()
    logits[idx] = sub


def _counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] fp32 occurrence counts (ids >= vocab ignored)."""
    longest = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), longest), vocab, dtype=torch.long)
    for r, toks in enumerate(token_lists):
        if toks:
            padded[r, :len(toks)] = torch.tensor(toks, dtype=torch.long).clamp_(max=vocab)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]
