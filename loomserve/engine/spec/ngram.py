"""Prompt lookup (vLLM's "ngram" method): drafts copied from the request's own earlier tokens.

The longest suffix of the request's tokens, from prompt_lookup_max down to prompt_lookup_min
tokens, is looked up among the earlier tokens; at its latest earlier occurrence, the tokens
that followed it there are the drafts. Agent output copies from its context (an edit repeats
the file it changes, a tool call repeats paths), so the copy is often right.

Cost: one vectorized pass over the request's tokens per step (numpy, ~10 us at 10K tokens on
the 2-core host); each request's tokens live in an int32 buffer grown by the tokens appended
since its last step, dropped when the request finishes.
"""

from __future__ import annotations

import numpy as np

from loomserve.config.speculative import SpeculativeConfig
from loomserve.engine.spec.drafter import Drafter, DraftRequest


class _Tokens:
    """A request's tokens as a growing int32 array (the list only ever appends)."""

    __slots__ = ("array", "n")

    def __init__(self) -> None:
        self.array = np.empty(256, dtype=np.int32)
        self.n = 0

    def sync(self, tokens) -> np.ndarray:
        m = len(tokens)
        if m < self.n:  # not append-only after all (a reused id): start over
            self.n = 0
        if m > self.array.shape[0]:
            grown = np.empty(2 * m, dtype=np.int32)
            grown[:self.n] = self.array[:self.n]
            self.array = grown
        if m > self.n:
            self.array[self.n:m] = tokens[self.n:m]
            self.n = m
        return self.array[:m]


def lookup(a: np.ndarray, lo: int, hi: int, k: int) -> np.ndarray:
    """Drafts for tokens `a`: the up to k tokens after the latest earlier occurrence of the
    longest suffix of length in [lo, hi] (an empty array when none occurs)."""
    n = a.shape[0]
    if n < lo + 1 or k <= 0:
        return a[:0]
    # candidate ends p < n - 1 of an earlier occurrence: a[p] equals the last token
    ends = np.flatnonzero(a[:n - 1] == a[n - 1])
    if ends.size == 0:
        return a[:0]
    lens = np.ones(ends.shape[0], dtype=np.int32)
    alive = np.ones(ends.shape[0], dtype=bool)
    for j in range(1, min(hi, n - 1)):
        at = ends - j
        ok = alive & (at >= 0)
        ok[ok] = a[at[ok]] == a[n - 1 - j]
        if not ok.any():
            break
        lens += ok
        alive = ok
    best = int(lens.max())
    if best < lo:
        return a[:0]
    p = int(ends[np.flatnonzero(lens == best)[-1]])  # the latest of the longest
    return a[p + 1:min(p + 1 + k, n)]


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max
        self._tokens: dict[str, _Tokens] = {}

    def propose(self, req: DraftRequest, max_tokens: int) -> list[int]:
        buf = self._tokens.get(req.request_id)
        if buf is None:
            buf = self._tokens[req.request_id] = _Tokens()
        return lookup(buf.sync(req.tokens), self.lo, self.hi, max_tokens).tolist()

    def on_finished(self, req: DraftRequest) -> None:
        self._tokens.pop(req.request_id, None)
