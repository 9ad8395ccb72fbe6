"""The per-step draft budget: which decoding requests get drafts, and how many, so they pay.

A draft costs one more query row in the step whatever its fate; it pays when accepted. Drafts
are accepted left to right until the first rejection, so with a per-position acceptance a_r
for request r, its j-th draft is worth a_r^j expected tokens. Each step, with B requests
decoding:

- no drafts while B > `disable_by_batch_size` (vLLM's key; a large batch is compute-bound);
- at most `max_draft_tokens_per_step` draft rows in the step, k per request;
- the step time is modelled as T(B, D) = t0 + tb B + td D (D draft rows), a least-squares fit
  over the decode-only steps, decayed by STEP_DECAY: draft rows get their own price td, apart
  from the rows of the requests themselves (they cost differently: a request's draft rows
  share one pass over its context, and the fit over batch sizes alone mixes context lengths);
- rows are given greedily, the most valuable first, while each still raises the step's
  expected tokens per second: v T > ROW_MARGIN td tokens (T and tokens = B + the values so far
  of the rows given), and while a request's rows yield on average at least
  `min_accepted_per_draft` expected tokens each. A request's row values fall with j,
  so for a time linear in D the greedy choice is the optimum. Until td is known (no steps of
  two draft-row counts seen) the row-cost rule uses tb, and before that the floor alone;
- when no request got drafts for PROBE_EVERY steps, one probe step gives one draft to the
  max(1, B // PROBE_SHARE) candidates of highest a_r, so a workload that becomes predictable,
  and td, are measured again.

a_r is the request's own geometric estimate, accepted drafts / (accepted + rejections) over its
verified steps, decayed by REQUEST_DECAY per step of the batch and shrunk toward the batch's
estimate a with weight PRIOR_WEIGHT: a request that stops copying loses its drafts within a few
steps and one that starts copying is not held back by the others. a itself is measured over all
verified requests, decayed by DECAY a step, from an optimistic prior of 2/3.
"""

from __future__ import annotations

import heapq

import numpy as np

from loomserve.config.speculative import SpeculativeConfig

PROBE_EVERY = 16
PROBE_SHARE = 4
DECAY = 0.98
REQUEST_DECAY = 0.9
PRIOR_WEIGHT = 2.0
STEP_DECAY = 0.99
ROW_MARGIN = 1.05


class StepTimeFit:
    """T(B, D) = t0 + tb B + td D by decayed least squares over decode-only steps."""

    def __init__(self) -> None:
        self._xx = np.zeros((3, 3))
        self._xt = np.zeros(3)

    def observe(self, num_decodes: int, draft_rows: int, seconds: float) -> None:
        x = np.array([1.0, num_decodes, draft_rows])
        self._xx = self._xx * STEP_DECAY + np.outer(x, x)
        self._xt = self._xt * STEP_DECAY + x * seconds

    def _varies(self, i: int) -> bool:
        w = self._xx[0, 0]
        return w > 0 and self._xx[i, i] / w - (self._xx[0, i] / w) ** 2 > 1e-6

    def prices(self, num_decodes: int) -> tuple[float, float] | None:
        """(T(B, 0), td): the step's time without drafts and a draft row's; None until known.
        With one batch size seen, T(B, 0) is still known at it (min-norm split of t0, tb)."""
        if self._xx[0, 0] <= 0:
            return None
        b_varies, d_varies = self._varies(1), self._varies(2)
        if not (b_varies or d_varies):
            return None
        t0, tb, td = np.linalg.lstsq(self._xx, self._xt, rcond=1e-9)[0]
        if not d_varies:
            td = tb if b_varies else 0.0  # no draft rows seen: a row as a request's
        base = t0 + tb * num_decodes
        if td <= 0.0 or base <= 0.0:
            return None
        return float(base), float(td)


class DraftBudget:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.max_batch = config.disable_by_batch_size
        self.max_tokens = config.max_draft_tokens_per_step
        self.min_yield = config.min_accepted_per_draft
        self.always = config.always_draft
        self.accepted = 2.0  # prior: a = 2/3
        self.rejected = 1.0
        self.fit = StepTimeFit()
        self._requests: dict[str, list[float]] = {}  # id -> [accepted, rejections, step]
        self._step = 0
        self._off_steps = 0
        self._step_accepted = self._step_rejections = 0

    @property
    def acceptance(self) -> float:
        """The batch's measured per-position acceptance probability."""
        return self.accepted / (self.accepted + self.rejected)

    def request_acceptance(self, request_id: str) -> float:
        """a_r: the request's decayed estimate shrunk toward the batch's."""
        a = self.acceptance
        s = self._requests.get(request_id)
        if s is None:
            return a
        decay = REQUEST_DECAY ** (self._step - s[2])
        acc, rej = s[0] * decay, s[1] * decay
        return (acc + PRIOR_WEIGHT * a) / (acc + rej + PRIOR_WEIGHT)

    # -- each step ---------------------------------------------------------------------------
    def step_cap(self, num_decodes: int) -> int:
        """Starts a step: the most draft rows it may hold (0: none)."""
        self._step += 1
        if num_decodes <= 0 or (self.max_batch is not None and num_decodes > self.max_batch):
            return 0
        return self.max_tokens

    def _probing(self) -> bool:
        return self._off_steps + 1 >= PROBE_EVERY

    def worth_proposing(self, request_id: str, num_decodes: int) -> bool:
        """May a first draft of this request pay this step? (Skips the drafter where not.)"""
        if self.always or self._probing():
            return True
        a = self.request_acceptance(request_id)
        if a < self.min_yield:
            return False
        prices = self.fit.prices(num_decodes)
        return prices is None or a * prices[0] >= ROW_MARGIN * prices[1] * num_decodes

    def allocate(self, candidates: list[tuple[str, int]], num_decodes: int,
                 cap: int) -> list[int]:
        """Draft rows per candidate (request id, drafts it has), in the candidates' order."""
        counts = [0] * len(candidates)
        if self.always:
            for i, (_, n) in enumerate(candidates):
                counts[i] = min(n, self.k, cap - sum(counts))
            return counts
        acc = [self.request_acceptance(rid) for rid, _ in candidates]
        prices = self.fit.prices(num_decodes)
        tokens = float(num_decodes)
        time, td = prices if prices is not None else (0.0, 0.0)
        heap = [(-a, i) for i, a in enumerate(acc)]  # each candidate's next row, by value
        heapq.heapify(heap)
        total, yields = 0, [0.0] * len(candidates)
        while heap and total < cap:
            v, i = heapq.heappop(heap)
            v = -v
            if prices is not None and v * time < ROW_MARGIN * td * tokens:
                break  # no later row pays either: values only fall
            if (yields[i] + v) / (counts[i] + 1) < self.min_yield:
                continue  # this request's drafts would yield too little per row
            counts[i] += 1
            yields[i] += v
            total += 1
            tokens, time = tokens + v, time + td
            if counts[i] < min(candidates[i][1], self.k):
                heapq.heappush(heap, (-v * acc[i], i))
        if total == 0 and self._probing() and candidates:
            for i in sorted(range(len(candidates)), key=lambda j: -acc[j])[
                    :max(1, num_decodes // PROBE_SHARE)]:
                counts[i] = 1
        self._off_steps = 0 if any(counts) else self._off_steps + 1
        return counts

    # -- what the steps measured ---------------------------------------------------------------
    def observe_step(self, num_decodes: int, draft_rows: int, seconds: float) -> None:
        """A decode-only step of num_decodes requests and draft_rows drafts took `seconds`."""
        self.fit.observe(num_decodes, draft_rows, seconds)

    def observe(self, request_id: str, accepted: int, rejected: bool) -> None:
        """One verified request: its accepted drafts, whether one was rejected."""
        s = self._requests.get(request_id)
        if s is None:
            s = self._requests[request_id] = [0.0, 0.0, self._step]
        decay = REQUEST_DECAY ** (self._step - s[2])
        s[0], s[1], s[2] = s[0] * decay + accepted, s[1] * decay + rejected, self._step
        self._step_accepted += accepted
        self._step_rejections += rejected

    def end_step(self) -> None:
        """Folds the step's verified requests into the batch's estimate."""
        if self._step_accepted or self._step_rejections:
            self.accepted = self.accepted * DECAY + self._step_accepted
            self.rejected = self.rejected * DECAY + self._step_rejections
            self._step_accepted = self._step_rejections = 0

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
