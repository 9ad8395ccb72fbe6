"""Continuous batching with chunked prefill under a per-step token budget.

Every request has `num_tokens - num_computed_tokens` tokens left to compute (a fresh prompt, a
preempted request's prompt + outputs, or one decode token). Each step serves running requests
first, preempting the most recently admitted by recompute when the pool cannot hold them, then
admits waiting ones, each claiming its longest cached prefix, asking the TierConnector first
when there is one. The policy: docs/architecture.md, "Scheduling"; the step in detail:
"Details by module".

Invariants:
- A request is in exactly one of `waiting` / `running` or finished.
- A running request's blocks cover its computed tokens; a finished, preempted or waiting
  request holds no block (rows a tier is loading for a waiting request belong to the
  TierConnector).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loomserve.execution.batch import ModelInput, ScheduledSeq
from loomserve.execution.request import Request, RequestStatus
from loomserve.kv.cache_manager import KVCacheManager


@dataclass
class SchedulerOutput:
    model_input: ModelInput
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num tokens)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 long_prefill_threshold: int = 0, tiers=None) -> None:
        self.kv = kv
        self.tiers = tiers  # TierConnector or None
        self.transfer = None  # KVTransferConnector (prefill/decode legs) or None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.long_prefill_threshold = long_prefill_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # for the runner, reported once
        self.num_preemptions = 0
        # Hybrid models only: per-step state directives ride along with each seq.
        self._states = kv.state_directives if getattr(kv, "has_state_groups", False) else None

    # -- queue management ------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        if self.tiers is not None:
            self.tiers.on_add(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and release everything it holds."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            self.waiting.remove(req)
        req.status = status
        req.grammar = None  # frees its matcher
        aborted = status == RequestStatus.FINISHED_ABORTED
        if self.tiers is not None:
            self.tiers.on_finish(req, aborted=aborted)
        self.kv.free(req)
        if self.transfer is not None:
            # after free: a state checkpoint at the prompt's end is hashed by it
            self.transfer.on_finish(req)
            self.transfer.on_freed(req, finished_ok=not aborted)
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(ModelInput([], self._finished_ids))
        self._finished_ids = []
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self._add_to_batch(out, req, n)
                budget -= n
                i += 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        tiers = self.tiers
        waiting = self.waiting
        i = 0  # requests before i wait for their tier I/O
        while i < len(waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = waiting[i]
            if self._held(req):
                i += 1
                continue
            if tiers is not None:
                verdict = tiers.prepare(req)
                if verdict == "wait":
                    i += 1
                    continue
                if verdict == "full":
                    break
            hit, num_hit = self.kv.get_computed_blocks(req, record_stats=False)
            n = self._chunk(req, req.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, hit, num_hit):
                break  # the pool is full; running requests free blocks as they finish
            if i:
                del waiting[i]
            else:
                waiting.popleft()
            req.num_computed_tokens = num_hit
            # Hit-rate counters count a request once, at its first admission, as its usage's
            # cached_tokens does: not the probes of a request waiting for blocks, not the
            # re-admission of a preempted one.
            first = req.num_cached_tokens < 0
            tier_tokens = tiers.on_admit(req, num_hit, count=first) if tiers is not None else 0
            if first:
                req.num_cached_tokens = num_hit
                req.num_tier_cached_tokens = tier_tokens
                if self.kv.enable_caching:
                    self.kv.stats.prefix_queried_tokens += len(req.all_token_ids)
                    self.kv.stats.prefix_hit_tokens += num_hit
            req.status = RequestStatus.RUNNING
            if self.transfer is not None:
                self.transfer.on_admit(req)
            self.running.append(req)
            self._add_to_batch(out, req, n)
            budget -= n

    def _held(self, req: Request) -> bool:
        """A waiting request sits out while its grammar compiles, or while the request whose
        prompt it shares (n > 1) has not prefilled it yet, so it then hits those blocks."""
        if req.grammar is not None and not req.grammar.ready:
            return True
        if req.sibling_of is None:
            return False
        first = self.requests.get(req.sibling_of)
        if first is None or first.sibling_of is not None:
            return False  # gone, or itself a sibling: never wait in a chain (or a cycle)
        if first.status != RequestStatus.RUNNING:
            return True  # still waiting (maybe for its grammar, which always becomes ready)
        return first.num_computed_tokens < first.num_prompt_tokens

    def _chunk(self, req: Request, left: int, budget: int) -> int:
        if self.long_prefill_threshold and left > self.long_prefill_threshold:
            left = self.long_prefill_threshold
        return min(left, budget)

    def _add_to_batch(self, out: SchedulerOutput, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        out.scheduled.append((req, n))
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:start + n],
            start_pos=start,
            block_ids=self.kv.get_block_ids(req.request_id),
            sample=start + n == req.num_tokens,
            sampling=req.sampling,
            num_output_tokens=req.num_output_tokens,
        )
        if self._states is not None:
            seq.states = self._states(req)
        sp = req.sampling
        if sp.uses_penalties:
            seq.history, seq.num_prompt_tokens = req.all_token_ids, req.num_prompt_tokens
        if req.num_output_tokens < sp.min_tokens and req.grammar is None:  # a grammar decides
            seq.suppress = sorted(req.stop_token_ids)
        out.model_input.seqs.append(seq)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- after the model ran ---------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[tuple[Request, list[int]]]:
        """Advance computed counts, append sampled tokens, finish what stopped.

        Returns (request, new token ids) for every request that produced a token."""
        produced = []
        for req, n in out.scheduled:
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += n
            token = sampled.get(req.request_id)
            if token is None:
                continue  # a prefill chunk that does not reach the end of the prompt yet
            status = req.append_token(token)
            produced.append((req, [token]))
            if status is not None:
                self.finish(req, status)
        return produced
