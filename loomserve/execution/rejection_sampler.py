"""Verification of drafts (speculative decoding): exact rejection sampling on rank 0.

A seq with d drafts x_1..x_d has 1 + d logits rows; row i scores the token after the request's
tokens plus x_1..x_i. Row i is processed as the request would be with x_1..x_i accepted
(penalty history, min_tokens suppression, grammar bitmask row i: the core filled it with the
grammar advanced over x_1..x_i), then drafts are accepted left to right:

- greedy: x_{i+1} is accepted while it equals row i's argmax; the first mismatch emits the
  argmax instead. The output is exactly the tokens of decoding one at a time.
- temperature > 0 (a deterministic drafter, the draft distribution a point mass): x_{i+1} is
  accepted with probability p_i(x_{i+1}) (p: the row's distribution after temperature, top-k,
  top-p); at the first rejection a token is drawn from p_i with x_{i+1}'s mass removed,
  renormalized. With every draft accepted, row d draws a bonus token. Each emitted token is
  then distributed as p, as without drafts (Leviathan et al., 2023).

Seeded requests draw row i's numbers from the generator of (seed, output position), so a
seeded request is reproducible; it does not reproduce the non-speculative draws.
Logprobs, as the plain sampler's, are the raw model's, one entry per emitted token.
"""

from __future__ import annotations

import copy

import torch

from loomserve.execution.batch import ModelOutput, ScheduledSeq
from loomserve.execution.logits_processors import apply_logits_processors
from loomserve.execution.sampler import (
    Sampler,
    _filtered_probs,
    _needs_processing,
    greedy_tensor,
    request_seed,
)


def row_views(seqs: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[int]]:
    """One ScheduledSeq per logits row (a seq with d drafts: 1 + d, as if its first i drafts
    were accepted) and each seq's first row."""
    rows, first = [], []
    for s in seqs:
        first.append(len(rows))
        d = s.num_draft
        if not d:
            rows.append(s)
            continue
        drafts = s.token_ids[-d:]
        min_tokens = s.sampling.min_tokens
        for i in range(d + 1):
            r = copy.copy(s)
            r.num_draft = 0
            r.num_output_tokens = s.num_output_tokens + i
            if s.history is not None:
                r.history = s.history + drafts[:i]
            if s.suppress and r.num_output_tokens >= min_tokens:
                r.suppress = None
            if s.bitmask_row is not None:
                r.bitmask_row = s.bitmask_row + i
            rows.append(r)
    return rows, first


def verify(sampler: Sampler, logits: torch.Tensor, seqs: list[ScheduledSeq],
           token_bitmask: torch.Tensor | None = None) -> ModelOutput:
    """logits: fp32 [rows, vocab], each seq's 1 + num_draft rows in turn; modified in place."""
    rows, first = row_views(seqs)
    params = [r.sampling for r in rows]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw = torch.log_softmax(logits[want], dim=-1) if want else None
    if any(_needs_processing(r) for r in rows):
        apply_logits_processors(logits, rows, token_bitmask)
        logits.masked_fill_(torch.isinf(logits).all(dim=-1, keepdim=True), 0.0)
    argmax = greedy_tensor(logits).tolist()
    drafts_of = [s.token_ids[len(s.token_ids) - s.num_draft:] for s in seqs]
    accept, drawn = _random_rows(sampler, logits, rows, seqs, first, drafts_of)
    out = ModelOutput(sampled={})
    emitted_rows: dict[int, int] = {}  # row -> the token emitted from it
    for s, r0, drafts in zip(seqs, first, drafts_of):
        greedy = s.sampling.greedy
        a = 0
        while a < len(drafts) and (drafts[a] == argmax[r0 + a] if greedy else accept[r0 + a]):
            emitted_rows[r0 + a] = drafts[a]
            a += 1
        last = argmax[r0 + a] if greedy else drawn[r0 + a]
        emitted_rows[r0 + a] = last
        if s.num_draft:
            out.verified[s.request_id] = drafts[:a] + [last]
        else:
            out.sampled[s.request_id] = last
    if raw is not None:
        _logprobs(out, raw, want, rows, first, seqs, emitted_rows)
    return out


def _random_rows(sampler: Sampler, logits: torch.Tensor, rows: list[ScheduledSeq],
                 seqs: list[ScheduledSeq], first: list[int], drafts_of: list[list[int]]
                 ) -> tuple[dict[int, bool], dict[int, int]]:
    """For the rows of sampled (temperature > 0) seqs: whether each draft row accepts its
    draft (u < p(x)), and a draw from p minus the draft's mass (the bonus row: from p)."""
    idx, draft = [], []
    for s, r0, drafts in zip(seqs, first, drafts_of):
        if not s.sampling.greedy:
            for i in range(len(drafts) + 1):
                idx.append(r0 + i)
                draft.append(drafts[i] if i < len(drafts) else -1)
    if not idx:
        return {}, {}
    dev = logits.device
    probs = _filtered_probs(logits[idx].float(), [rows[i].sampling for i in idx])
    n = len(idx)
    at = torch.arange(n, device=dev)
    x = torch.tensor([max(t, 0) for t in draft], dtype=torch.long, device=dev)
    has = torch.tensor([t >= 0 for t in draft], device=dev)
    p_x = torch.where(has, probs[at, x], torch.zeros((), device=dev))
    q = probs.clone()
    q[at[has], x[has]] = 0.0
    q = torch.where(q.sum(dim=-1, keepdim=True) > 0, q, probs)  # p(x) = 1: never rejected
    u = torch.empty(n, device=dev)
    tok = torch.empty(n, dtype=torch.long, device=dev)
    unseeded = [j for j, i in enumerate(idx) if rows[i].sampling.seed is None]
    if unseeded:
        sel = torch.tensor(unseeded, device=dev)
        u[sel] = torch.rand(len(unseeded), device=dev, generator=sampler.generator)
        tok[sel] = torch.multinomial(q[sel], 1, generator=sampler.generator).view(-1)
    for j, i in enumerate(idx):
        sp = rows[i].sampling
        if sp.seed is not None:
            g = torch.Generator(device=dev)
            g.manual_seed(request_seed(sp.seed, rows[i].num_output_tokens))
            if draft[j] >= 0:
                u[j] = torch.rand(1, device=dev, generator=g)[0]
            tok[j] = torch.multinomial(q[j], 1, generator=g)[0]
    ok = (u < p_x).tolist()
    tokens = tok.tolist()
    return dict(zip(idx, ok)), dict(zip(idx, tokens))


def _logprobs(out: ModelOutput, raw: torch.Tensor, want: list[int], rows: list[ScheduledSeq],
              first: list[int], seqs: list[ScheduledSeq], emitted: dict[int, int]) -> None:
    """Raw logprobs of each emitted token, with the row's top-k, per seq asking."""
    k = max(rows[i].sampling.logprobs for i in want)
    keep = [j for j, i in enumerate(want) if i in emitted]
    chosen = torch.tensor([emitted[want[j]] for j in keep], device=raw.device).unsqueeze(1)
    picked = raw[keep].gather(1, chosen).view(-1).tolist()
    top_lp, top_ids = raw[keep].topk(k, dim=-1) if k else (raw[keep][:, :0],
                                                          raw[keep][:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    by_row = {}
    for m, j in enumerate(keep):
        n = rows[want[j]].sampling.logprobs
        by_row[want[j]] = (picked[m], top_ids[m][:n], top_lp[m][:n])
    for s, r0 in zip(seqs, first):
        if s.sampling.logprobs is None:
            continue
        if s.num_draft:
            got = out.verified[s.request_id]
            out.logprobs[s.request_id] = [by_row[r0 + i] for i in range(len(got))]
        else:
            out.logprobs[s.request_id] = by_row[r0]
