"""The per-step draft budget: drafts only while they pay.

A draft costs one more query row in the step whatever its fate; it pays when accepted. With a
per-position acceptance probability a (drafts are accepted left to right until the first
rejection), d drafts yield E(d) = a (1 - a^d) / (1 - a) accepted tokens, so the yield per
draft token E(d) / d falls as d grows. The rule, each step:

- no drafts while more than `disable_by_batch_size` requests decode (vLLM's key; a large batch
  is compute-bound, where every extra row costs as much as a token);
- at most `max_draft_tokens_per_step` drafts in the step, split evenly: d <= that / decodes;
- among the lengths <= num_speculative_tokens whose expected yield E(d) / d is at least
  `min_accepted_per_draft`, d maximizes the step's expected tokens per second,
  gain(d) = (1 + E(d)) T(B) / T(B (1 + d)), where T(r) = t0 + t1 r is the measured time of a
  decode step of r rows (B decodes); no drafts unless gain(d) > MIN_GAIN. On a CPU a row costs
  nearly as much as a token at any batch, so drafts pay only at high acceptance; on a GPU rows
  are nearly free until the batch is compute-bound, and the fit says so.
- when no length pays, no drafts, except one probe step every PROBE_EVERY steps (d = 1) so a
  changed workload, and the cost of a drafted row, are measured again.

a is measured: accepted drafts / (accepted drafts + rejections) over verified requests (the
geometric estimate), with old steps decayed by DECAY, from an optimistic prior. T is a
least-squares line over the decode-only steps' (rows, seconds), decayed by STEP_DECAY; until
steps of at least two row counts were seen, the yield floor alone decides.
"""

from __future__ import annotations

from loomserve.config.speculative import SpeculativeConfig

PROBE_EVERY = 16
DECAY = 0.98
STEP_DECAY = 0.99
MIN_GAIN = 1.02


def expected_yield(a: float, d: int) -> float:
    """Expected accepted tokens per draft token for d drafts at per-position acceptance a."""
    if d <= 0:
        return 0.0
    if a >= 1.0:
        return 1.0
    return a * (1.0 - a ** d) / ((1.0 - a) * d)


class DraftBudget:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.max_batch = config.disable_by_batch_size
        self.max_tokens = config.max_draft_tokens_per_step
        self.min_yield = config.min_accepted_per_draft
        self.always = config.always_draft
        self.accepted = 2.0  # prior: a = 2/3
        self.rejected = 1.0
        self._off_steps = 0
        self._fit = [0.0] * 5  # decayed sums: w, w r, w r^2, w t, w r t

    @property
    def acceptance(self) -> float:
        """The measured per-position acceptance probability."""
        return self.accepted / (self.accepted + self.rejected)

    def per_request(self, num_decodes: int) -> int:
        """Most drafts each decoding request may get this step (0: none)."""
        if num_decodes <= 0 or (self.max_batch is not None and num_decodes > self.max_batch):
            return 0
        d = min(self.k, self.max_tokens // num_decodes)
        if self.always:
            return d
        a = self.acceptance
        while d > 0 and expected_yield(a, d) < self.min_yield:
            d -= 1
        line = self.step_time_line()
        if d > 0 and line is not None:
            d = max(range(d + 1), key=lambda n: self.gain(a, n, num_decodes, line))
            if self.gain(a, d, num_decodes, line) <= MIN_GAIN:
                d = 0
        if d > 0:
            self._off_steps = 0
            return d
        self._off_steps += 1
        return 1 if self._off_steps % PROBE_EVERY == 0 and self.max_tokens >= num_decodes else 0

    @staticmethod
    def gain(a: float, d: int, num_decodes: int, line: tuple[float, float]) -> float:
        """Expected tokens per second with d drafts each over without (1.0 for d = 0)."""
        t0, t1 = line
        return (1.0 + expected_yield(a, d) * d) * (t0 + t1 * num_decodes) / \
            (t0 + t1 * num_decodes * (1 + d))

    def step_time_line(self) -> tuple[float, float] | None:
        """(t0, t1): seconds of a decode step of r rows = t0 + t1 r; None until identified."""
        w, wr, wrr, wt, wrt = self._fit
        det = w * wrr - wr * wr
        if w <= 0 or det <= 1e-9 * w * w:
            return None  # every step had the same row count so far
        t1 = max((w * wrt - wr * wt) / det, 1e-9)
        t0 = max((wt - t1 * wr) / w, 0.0)
        return t0, t1

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step (drafts included) of `rows` rows took `seconds`."""
        f = self._fit
        for i, v in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            f[i] = f[i] * STEP_DECAY + v

    def observe(self, accepted: int, rejections: int) -> None:
        """One step's verified requests: accepted drafts, requests with a rejected draft."""
        self.accepted = self.accepted * DECAY + accepted
        self.rejected = self.rejected * DECAY + rejections
