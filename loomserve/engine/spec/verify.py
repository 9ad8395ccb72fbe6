"""The core's side of speculative decoding: drafts in, verified tokens out, counters.

Flow per step (the scheduler calls in; loomserve.execution.rejection_sampler runs on rank 0):
1. `begin_step`, before the step is scheduled, asks the drafter for up to k ids for each
   decoding request whose first draft may pay (budget.py), cut to what can be emitted
   (max_tokens, max_model_len), before the first stop token (nothing past a stop may be
   emitted, and a stop ends the request anyway) and before the first id the request's grammar
   forbids; the budget then chooses how many of each request's drafts the step verifies.
2. `drafts_for` hands a request its chosen drafts, cut to the step's token budget left. The
   request is scheduled as 1 + d query tokens: its last sampled token, then the drafts.
3. The runner scores every row and accepts drafts left to right (exact rejection sampling);
   `Scheduler.update` appends the accepted drafts and the one token sampled after them, and
   rolls back the rest: num_computed_tokens drops to the accepted length. The KV rows of
   rejected drafts are overwritten by the next tokens; no block is cached under their content
   (blocks are hashed from the request's accepted tokens only). The blocks allocated for them
   stay with the request, which fills them next (a block id list only grows: the runner's
   block tables and the TP step message depend on it); every block returns at finish.
4. `on_verified` feeds the budget (the request's and the batch's acceptance) and the metrics
   (vLLM's spec_decode_* counters); `observe_step` gives the budget the whole time of each
   decode-only step (the drafter's proposals and verification included; under async
   scheduling the period between two steps' updates), its request count and its draft rows.

Async scheduling (engine/step_overlap.py): drafts follow a request's latest token, and a
request with drafts in flight has an unknown count, so a step with drafts runs alone: the core
finishes the step in flight before scheduling one that may draft (`wants_drain`) and finishes
a step with drafts before scheduling the next. Steps without drafts overlap as usual. So that
a workload with nothing to copy keeps most of its overlap, the core drains only for a request
never asked, one whose last ask gave drafts, or one last asked REASK_EVERY steps ago (a drain
asks every decoding request, so their turns fall together).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loomserve.config.speculative import SpeculativeConfig
from loomserve.engine.spec.budget import DraftBudget
from loomserve.engine.spec.drafter import Drafter, DraftRequest
from loomserve.engine.spec.ngram import NgramDrafter

REASK_EVERY = 4  # async scheduling: steps a request whose drafter had nothing runs overlapped


def make_drafter(config: SpeculativeConfig) -> Drafter:
    """The drafter of config.method; any Drafter subclass plugs in through this."""
    if config.method == "ngram":
        return NgramDrafter(config)
    if config.method == "suffix":
        from loomserve.engine.spec.suffix import SuffixDrafter
        return SuffixDrafter(config)
    if config.method == "mtp":  # drafted by the runner after each step (execution/spec_mtp.py)
        from loomserve.engine.spec.mtp import MtpDrafter
        return MtpDrafter()
    raise ValueError(f"no drafter for method {config.method!r}")


@dataclass
class SpecDecodeStats:
    """Cumulative counters, vLLM's meaning: a draft is one request's drafts in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at position i


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 drafter: Drafter | None = None) -> None:
        self.config = config
        self.drafter = drafter or make_drafter(config)
        self.budget = DraftBudget(config)
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._planned: dict[str, list[int]] = {}
        self._views: dict[str, DraftRequest] = {}
        self._asked: dict[str, tuple[int, bool]] = {}  # id -> (budget step asked, got drafts)

    def begin_step(self, decodes: list) -> None:
        """Chooses this step's drafts for the decoding requests (before it is scheduled)."""
        self._planned = {}
        b = len(decodes)
        cap = self.budget.step_cap(b)
        if cap <= 0:
            return
        ids, proposals = [], []
        for req in decodes:
            if self.budget.worth_proposing(req.request_id, b):
                drafts = self._propose(req)
                self.budget.observe_ask(req.request_id, bool(drafts))
                if drafts:
                    ids.append(req.request_id)
                    proposals.append(drafts)
        counts = self.budget.allocate(list(zip(ids, map(len, proposals))), b, cap)
        for rid, drafts, n in zip(ids, proposals, counts):
            if n:
                self._planned[rid] = drafts[:n]
        for req in decodes:
            self._asked[req.request_id] = (self.budget.step, req.request_id in self._planned)

    def wants_drain(self, running: list) -> bool:
        """Async scheduling, a step in flight: would the next step draft for a request whose
        token that step samples (so it must be finished first)? See the module docstring."""
        decodes = [r for r in running if r.num_output_placeholders]
        if not self.budget.may_draft(len(decodes)):
            return False
        for req in decodes:
            last = self._asked.get(req.request_id)
            if last is None or last[1] or self.budget.step - last[0] >= REASK_EVERY:
                return True
        return False

    def view(self, req) -> DraftRequest:
        v = self._views.get(req.request_id)
        if v is None:
            v = self._views[req.request_id] = DraftRequest(
                req.request_id, req.session_id, req.all_token_ids, req.num_prompt_tokens)
        return v

    def _propose(self, req) -> list[int]:
        """The drafter's ids for req, cut to what may be emitted, a stop, the grammar."""
        k = min(self.config.num_speculative_tokens, req.max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens)
        if k <= 0:
            return []
        t = time.perf_counter()
        drafts = self.drafter.propose(self.view(req), k)[:k]
        self.budget.observe_proposal(time.perf_counter() - t)
        stops = req.stop_token_ids
        for i, t in enumerate(drafts):
            if t in stops:
                del drafts[i:]
                break
        if drafts and req.grammar is not None:
            drafts = _grammar_prefix(req.grammar.matcher, drafts)
        return drafts

    def drafts_for(self, req, token_budget: int) -> list[int]:
        """The drafts chosen for a decoding request this step (often none), cut to the
        step's token budget left (its own token included)."""
        drafts = self._planned.get(req.request_id)
        return drafts[:max(token_budget - 1, 0)] if drafts else []

    def receive(self, drafts: dict[str, tuple[int, list[int]]]) -> None:
        """A step's output carried drafts made in the execution plane (MTP)."""
        self.drafter.receive(drafts)

    def on_verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        per_pos = s.accepted_per_pos
        for i in range(min(num_accepted, len(per_pos))):
            per_pos[i] += 1
        self.budget.observe(request_id, num_accepted, num_accepted < num_drafts)

    @staticmethod
    def step_shape(inp) -> tuple[int, int] | None:
        """(decoding requests, draft rows) of a decode-only step's ModelInput; None else."""
        seqs = inp.seqs
        if not seqs or any(not s.sample or len(s.token_ids) != 1 + s.num_draft for s in seqs):
            return None
        return len(seqs), sum(s.num_draft for s in seqs)

    def observe_step(self, shape: tuple[int, int] | None, seconds: float) -> None:
        """A step of `shape` (step_shape) took `seconds`, scheduling to update: a decode-only
        one teaches the budget its costs."""
        if shape is not None:
            self.budget.observe_step(shape[0], shape[1], seconds)

    def end_step(self) -> None:
        self.budget.end_step()

    def on_finished(self, req) -> None:
        self.budget.forget(req.request_id)
        self._asked.pop(req.request_id, None)
        v = self._views.pop(req.request_id, None) or DraftRequest(
            req.request_id, req.session_id, req.all_token_ids, req.num_prompt_tokens)
        self.drafter.on_finished(v)

    def drop_session(self, session_id: str) -> None:
        self.drafter.drop_session(session_id)


def _grammar_prefix(matcher, drafts: list[int]) -> list[int]:
    """The longest prefix of drafts the grammar accepts from its current state (left as it
    was: accepted tokens are rolled back)."""
    n = 0
    for t in drafts:
        if matcher.is_terminated() or not matcher.accept_token(t):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return drafts[:n]
