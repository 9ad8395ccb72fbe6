"""Token sampling: greedy, temperature, top-k, top-p; per-request seeds independent of batching."""

from __future__ import annotations

import torch

from loomserve.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1


def request_seed(seed: int, num_output_tokens: int) -> int:
    # Same (seed, position) -> same draw, whatever else shares the batch or how steps split.
    return (seed * 0x9E3779B97F4A7C15 + num_output_tokens * 0xBF58476D1CE4E5B9 + 1) & _SEED_MASK


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 num_output_tokens: list[int]) -> list[int]:
        """logits: [seqs, vocab], one row per request due a token."""
        greedy = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy.tolist()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        probs = _filtered_probs(logits[rows].float(), [params[i] for i in rows])
        out = greedy.tolist()
        unseeded = [j for j, i in enumerate(rows) if params[i].seed is None]
        if unseeded:
            drawn = torch.multinomial(probs[unseeded], 1, generator=self.generator).view(-1).tolist()
            for j, tok in zip(unseeded, drawn):
                out[rows[j]] = tok
        for j, i in enumerate(rows):
            if params[i].seed is not None:
                g = torch.Generator(device=self.device)
                g.manual_seed(request_seed(params[i].seed, num_output_tokens[i]))
                out[i] = int(torch.multinomial(probs[j], 1, generator=g))
        return out


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(1)
    logits = logits / temps
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device).unsqueeze(1)
        drop = ranks >= k
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        # top-p: keep the smallest prefix whose mass reaches p (the token crossing p stays in).
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        p = torch.tensor(top_p, device=logits.device).unsqueeze(1)
        drop = mass_before >= p
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits.softmax(dim=-1)
