"""Token sampling: logits processing (logits_processors.py), greedy, temperature, top-k, top-p,
logprobs; per-request seeds independent of batching."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loomserve.execution.batch import ScheduledSeq
from loomserve.execution.logits_processors import apply_logits_processors
from loomserve.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1


def request_seed(seed: int, num_output_tokens: int) -> int:
    # Same (seed, position) -> same draw, whatever else shares the batch or how steps split.
    return (seed * 0x9E3779B97F4A7C15 + num_output_tokens * 0xBF58476D1CE4E5B9 + 1) & _SEED_MASK


@dataclass
class SamplerOutput:
    tokens: list[int]
    # row -> (sampled token's logprob, top-k ids, their logprobs), rows that asked only
    logprobs: dict[int, tuple[float, list[int], list[float]]]


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """Argmax of each row (the first index on ties, as torch's). On a CPU, numpy's SIMD
    argmax: torch's CPU argmax is scalar, 48 us for one 49K-vocab row and 0.8 ms for 32 rows
    against numpy's 5 us and 0.13 ms (2-core Zen 4; 5% of a 1K-context decode step of the
    long-context benchmark model). Elsewhere torch's, on the device."""
    return greedy_tensor(logits).tolist()


def greedy_tensor(logits: torch.Tensor) -> torch.Tensor:
    """greedy_ids as a tensor where the logits are (no host copy on a GPU)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _needs_processing(s: ScheduledSeq) -> bool:
    return (s.bitmask_row is not None or bool(s.suppress) or bool(s.sampling.logit_bias)
            or s.history is not None)


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq],
               token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """logits: [len(seqs), vocab] fp32, one row per seq due a token; modified in place.

        Logprobs are the model's raw log-softmax (vLLM's default "raw_logprobs"): before the
        grammar mask, logit_bias, penalties and temperature, so they say what the model thought."""
        params = [s.sampling for s in seqs]
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = torch.log_softmax(logits[want], dim=-1) if want else None
        if any(_needs_processing(s) for s in seqs):
            apply_logits_processors(logits, seqs, token_bitmask)
            # A row with nothing allowed (min_tokens over a tiny vocabulary, a grammar dead
            # end) must not reach multinomial as NaN, which would end every request: it
            # samples uniformly, and a grammar then rejects the token and ends the request.
            # (masked in place: no host sync on a GPU to ask whether any row is dead)
            logits.masked_fill_(torch.isinf(logits).all(dim=-1, keepdim=True), 0.0)
        tokens = self(logits, params, [s.num_output_tokens for s in seqs])
        logprobs = {}
        if raw is not None:
            chosen = torch.tensor([tokens[i] for i in want], device=raw.device).unsqueeze(1)
            picked = raw.gather(1, chosen).view(-1).tolist()
            k = max(params[i].logprobs for i in want)
            top_lp, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
            top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
            for j, i in enumerate(want):
                n = params[i].logprobs
                logprobs[i] = (picked[j], top_ids[j][:n], top_lp[j][:n])
        return SamplerOutput(tokens, logprobs)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 num_output_tokens: list[int]) -> list[int]:
        """logits: [seqs, vocab], one row per request due a token."""
        if all(p.greedy for p in params):
            return greedy_ids(logits)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        probs = _filtered_probs(logits[rows].float(), [params[i] for i in rows])
        out = greedy_tensor(logits)  # the greedy rows' picks; sampled rows overwritten below
        unseeded = [j for j, i in enumerate(rows) if params[i].seed is None]
        if unseeded:
            at = torch.tensor([rows[j] for j in unseeded], device=out.device)
            out[at] = torch.multinomial(probs[unseeded], 1, generator=self.generator).view(-1)
        for j, i in enumerate(rows):
            if params[i].seed is not None:
                g = torch.Generator(device=self.device)
                g.manual_seed(request_seed(params[i].seed, num_output_tokens[i]))
                out[i] = torch.multinomial(probs[j], 1, generator=g)[0]
        return out.tolist()  # the step's one host copy of its tokens


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
