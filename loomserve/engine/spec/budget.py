"""The per-step draft budget: which decoding requests get drafts, and how many, so they pay.

A draft costs one more query row in the step whatever its fate; it pays when accepted. Drafts
are accepted left to right until the first rejection, so with a per-position acceptance a_r
for request r, its j-th draft is worth a_r^j expected tokens. Each step, with B requests
decoding:

- no drafts while B > `disable_by_batch_size` (vLLM's key; a large batch is compute-bound);
- at most `max_draft_tokens_per_step` draft rows in the step, k per request;
- the step time is modelled as T(B, D) = t0 + tb B + td D + tv [D > 0] (D draft rows), a
  least-squares fit over the decode-only steps' whole time (scheduling with the drafter's
  proposals, execution, verification, update), decayed by STEP_DECAY: draft rows get their own
  price td, apart from the rows of the requests themselves (a request's draft rows share one
  pass over its context; a fit over batch sizes alone mixes context lengths), and tv is what a
  step with any drafts costs beyond its rows (on a small model, most of it);
- the drafter is asked only for requests whose first draft may pay, its own time included:
  q_r (a_r (T(B, 0) + tv) - ROW_MARGIN td B) >= ROW_MARGIN (the drafter's mean time a call) B,
  where q_r is the share of the request's recent asks that gave drafts, decayed by ASK_DECAY
  a step: the draft and its row come only with q_r, the call costs every time (a dear drafter
  is asked less often for a request with nothing to copy; a cheap one still every step);
- rows are given greedily, the most valuable first, while each still pays and while a
  request's rows yield on average at least `min_accepted_per_draft` expected tokens each
  (`_greedy`). When every decoding request drafts, the batch needs fewer steps and a token is
  worth its share of a step: a row pays while v T > ROW_MARGIN td tokens (T and tokens: the
  verified step's so far), the step if it beats none by STEP_MARGIN. When only some do, the
  steps go on for the others and a token saves one request row later: a row pays while
  v tb > ROW_MARGIN td, the step while the rows' tokens x tb cover td D + tv (tb unknown:
  never). A request's row values fall with j, so for a time linear in D the greedy choice
  is the optimum. Until the fit is known the floor alone decides;
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
from typing import NamedTuple

import numpy as np

from loomserve.config.speculative import SpeculativeConfig

PROBE_EVERY = 16
PROBE_SHARE = 4
DECAY = 0.98
REQUEST_DECAY = 0.9
PRIOR_WEIGHT = 2.0
ASK_PRIOR_WEIGHT = 1.0  # q_r's prior (every ask gives drafts) counts as this many asks
ASK_DECAY = 0.95  # per step: how fast a request's empty asks are forgotten
STEP_DECAY = 0.99
ROW_MARGIN = 1.05
STEP_MARGIN = 1.02
OUTLIER = 2.0
SETTLED_STEPS = 16


class Prices(NamedTuple):
    """A decode step's fitted costs at B requests, in seconds."""

    base: float  # T(B, 0): the step without drafts
    td: float  # one draft row
    tv: float  # a step with any drafts, beyond its rows (proposals' host work, verification)
    tb: float | None  # one more request's row (None: the batch size has not varied)


class StepTimeFit:
    """T(B, D) = t0 + tb B + td D + tv [D > 0] by decayed least squares over decode-only
    steps (tv: what any verified step costs beyond its rows: proposals, verification)."""

    def __init__(self) -> None:
        self._xx = np.zeros((4, 4))
        self._xt = np.zeros(4)
        self._coef: np.ndarray | None = None

    def observe(self, num_decodes: int, draft_rows: int, seconds: float) -> None:
        """One step; once the fit has SETTLED_STEPS behind it, a step off by more than OUTLIER x (a first call's
        warm-up, a pause of the host) counts as OUTLIER x the prediction, so one such step
        cannot move the prices for the next hundred."""
        x = np.array([1.0, num_decodes, draft_rows, float(draft_rows > 0)])
        if self._xx[0, 0] >= SETTLED_STEPS and self._known():
            predicted = float(self._solve() @ x)
            if predicted > 0:
                seconds = min(max(seconds, predicted / OUTLIER), predicted * OUTLIER)
        self._xx = self._xx * STEP_DECAY + np.outer(x, x)
        self._xt = self._xt * STEP_DECAY + x * seconds
        self._coef = None

    def _known(self) -> bool:
        return self._xx[0, 0] > 0 and (self._varies(1) or self._varies(2))

    def _solve(self) -> np.ndarray:
        """(t0, tb, td, tv); solved once per observation (every request's check of a step
        asks for the prices)."""
        if self._coef is None:
            self._coef = np.linalg.lstsq(self._xx, self._xt, rcond=1e-9)[0]
        return self._coef

    def _varies(self, i: int) -> bool:
        w = self._xx[0, 0]
        return w > 0 and self._xx[i, i] / w - (self._xx[0, i] / w) ** 2 > 1e-6

    def prices(self, num_decodes: int) -> Prices | None:
        """The step's prices at B = num_decodes; None until known. With one batch size seen,
        T(B, 0) is still known at it (the min-norm split of t0 and tb) but tb is not; with one
        draft-row count seen, td + tv is known."""
        if not self._known():
            return None
        b_varies, d_varies = self._varies(1), self._varies(2)
        t0, tb, td, tv = self._solve()
        if not d_varies:
            td, tv = (tb if b_varies else 0.0), 0.0  # no draft rows seen: a row as a request's
        base = t0 + tb * num_decodes
        if td <= 0.0 or base <= 0.0:
            return None
        return Prices(float(base), float(td), max(float(tv), 0.0),
                      float(min(max(tb, 0.0), base / num_decodes)) if b_varies else None)


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
        self._asks: dict[str, list[float]] = {}  # id -> [asks that gave drafts, asks, step]
        self._step = 0
        self._off_steps = 0
        self._step_accepted = self._step_rejections = 0
        self.propose_s = 0.0  # the drafter's mean time for one request's proposal
        self._prices: Prices | None = None  # the fit's, at the step's B (step_cap)

    @property
    def step(self) -> int:
        """Steps begun (step_cap calls)."""
        return self._step

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

    def ask_yield(self, request_id: str) -> float:
        """q_r: the decayed share of the request's asks that gave drafts (prior: 1)."""
        s = self._asks.get(request_id)
        if s is None:
            return 1.0
        decay = ASK_DECAY ** (self._step - s[2])
        return (s[0] * decay + ASK_PRIOR_WEIGHT) / (s[1] * decay + ASK_PRIOR_WEIGHT)

    # -- each step ---------------------------------------------------------------------------
    def may_draft(self, num_decodes: int) -> bool:
        """Whether a step of num_decodes decoding requests may hold drafts at all."""
        return num_decodes > 0 and (self.max_batch is None or num_decodes <= self.max_batch)

    def step_cap(self, num_decodes: int) -> int:
        """Starts a step: the most draft rows it may hold (0: none)."""
        self._step += 1
        if not self.may_draft(num_decodes):
            return 0
        self._prices = self.fit.prices(num_decodes)  # for this step's checks, at its B
        return self.max_tokens

    def _probing(self) -> bool:
        return self._off_steps + 1 >= PROBE_EVERY

    def worth_proposing(self, request_id: str, num_decodes: int) -> bool:
        """May a first draft of this request pay this step (after step_cap(num_decodes))?
        (Skips the drafter where not.)"""
        if self.always or self._probing():
            return True
        a = self.request_acceptance(request_id)
        if a < self.min_yield:
            return False
        prices = self._prices
        if prices is None:
            return True
        # the first draft's value net of its row, had only with q_r; the call costs always
        pays = a * (prices.base + prices.tv) - ROW_MARGIN * prices.td * num_decodes
        return self.ask_yield(request_id) * pays >= ROW_MARGIN * self.propose_s * num_decodes

    def allocate(self, candidates: list[tuple[str, int]], num_decodes: int,
                 cap: int) -> list[int]:
        """Draft rows per candidate (request id, drafts it has), in the candidates' order."""
        if self.always:
            counts = [0] * len(candidates)
            for i, (_, n) in enumerate(candidates):
                counts[i] = min(n, self.k, cap - sum(counts))
            return counts
        acc = [self.request_acceptance(rid) for rid, _ in candidates]
        p = self._prices
        counts = self._greedy(acc, candidates, num_decodes, cap, p, whole=True)
        if p is not None and sum(c > 0 for c in counts) < num_decodes:
            counts = self._greedy(acc, candidates, num_decodes, cap, p, whole=False)
        if not any(counts) and self._probing() and candidates:
            for i in sorted(range(len(candidates)), key=lambda j: -acc[j])[
                    :max(1, num_decodes // PROBE_SHARE)]:
                counts[i] = 1
        self._off_steps = 0 if any(counts) else self._off_steps + 1
        return counts

    def _greedy(self, acc: list[float], candidates: list[tuple[str, int]], num_decodes: int,
                cap: int, p: Prices | None, whole: bool) -> list[int]:
        """Rows, most valuable first, while each pays (p None: the yield floor alone).
        `whole`: every decoding request drafts, so the batch needs fewer steps and a token is
        worth its share of a step: a row pays while v T > ROW_MARGIN td tokens. Else only the
        drafted requests finish sooner, the steps go on for the others, and an accepted token
        saves one request row in a later step: a row pays while v tb > ROW_MARGIN td (tb not
        known, as in a batch that never changed size: never)."""
        n = len(candidates)
        counts, yields = [0] * n, [0.0] * n
        heap = [(-a, i) for i, a in enumerate(acc)]  # each candidate's next row, by value
        heapq.heapify(heap)
        tokens, time = float(num_decodes), (p.base + p.tv if p is not None else 0.0)
        saves = 0.0 if p is None or whole or p.tb is None else p.tb
        gained, total = 0.0, 0
        while heap and total < cap:
            v, i = heapq.heappop(heap)
            v = -v
            if p is not None and (v * time < ROW_MARGIN * p.td * tokens if whole
                                  else v * saves < ROW_MARGIN * p.td):
                break  # no later row pays either: values only fall
            if (yields[i] + v) / (counts[i] + 1) < self.min_yield:
                continue  # this request's drafts would yield too little per row
            counts[i] += 1
            yields[i] += v
            total += 1
            gained += v
            tokens, time = tokens + v, time + (p.td if p is not None else 0.0)
            if counts[i] < min(candidates[i][1], self.k):
                heapq.heappush(heap, (-v * acc[i], i))
        if p is not None and total and not (
                tokens * p.base >= STEP_MARGIN * num_decodes * time if whole
                else gained * saves >= STEP_MARGIN * (p.td * total + p.tv)):
            return [0] * n  # the rows do not carry the verified step's overhead
        if whole and sum(c > 0 for c in counts) < num_decodes:
            return counts if p is None else [0] * n
        return counts

    # -- what the steps measured ---------------------------------------------------------------
    def observe_step(self, num_decodes: int, draft_rows: int, seconds: float) -> None:
        """A decode-only step of num_decodes requests and draft_rows drafts took `seconds`."""
        self.fit.observe(num_decodes, draft_rows, seconds)

    def observe_proposal(self, seconds: float) -> None:
        """One call of the drafter took `seconds` (host time that a request's drafts cost
        whether or not they are given: it counts against its first row)."""
        self.propose_s = self.propose_s * DECAY + seconds * (1.0 - DECAY)

    def observe_ask(self, request_id: str, gave: bool) -> None:
        """The drafter was asked for the request this step; `gave`: it had drafts."""
        s = self._asks.get(request_id)
        if s is None:
            s = self._asks[request_id] = [0.0, 0.0, self._step]
        decay = ASK_DECAY ** (self._step - s[2])
        s[0], s[1], s[2] = s[0] * decay + gave, s[1] * decay + 1.0, self._step

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
        self._asks.pop(request_id, None)
