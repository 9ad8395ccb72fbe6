"""Continuous batching with chunked prefill under a per-step token budget and time budget.

Every request has `num_tokens - num_computed_tokens` tokens left to compute (a fresh prompt, a
preempted request's prompt + outputs, or one decode token). Each step serves running requests
first, preempting by recompute when the pool cannot hold them, then admits waiting ones, each
claiming its longest cached prefix (asking the TierConnector first when there is one); more in
docs/design/scheduler.md.

Policies (each in its own module): the waiting queue's admission order and aging
(waiting_queue.py: fcfs, priority, cache_aware), the preemption victim (preemption.py: the
cheapest recompute given what stays cached), and the step-time budget (step_budget.py, priced
by step_cost.py's learned model): decodes go first, then long prefills are cut to what fits the
step's target and short ones (warm turns) go whole; the token budget bounds either way.

Invariants:
- A request is in exactly one of `waiting` / `running` or finished.
- A running request's blocks cover its computed tokens; a finished, preempted or waiting one
  holds none (rows a tier is loading for a waiting request belong to the TierConnector).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from loomserve.engine.sched.preemption import victim_for
from loomserve.engine.sched.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from loomserve.engine.sched.step_budget import StepPlan
from loomserve.engine.sched.step_cost import ModelLayout, StepCostModel, StepFeatures
from loomserve.engine.sched.waiting_queue import WaitingQueue
from loomserve.execution.batch import ModelInput, ScheduledSeq
from loomserve.kv.cache_manager import KVCacheManager


@dataclass
class SchedulerOutput:
    model_input: ModelInput
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num tokens)
    preempted: list[Request] = field(default_factory=list)
    features: object = None  # np.ndarray of step_cost.FEATURES for the scheduled step
    target_s: float | None = None  # the step-time target this step was filled to (None: none)
    num_drafts: dict[str, int] = field(default_factory=dict)  # request id -> drafts verified
    # Async scheduling: the requests this step samples for, holding a placeholder until update.
    placeholders: list[Request] = field(default_factory=list)


def token_history(req: Request) -> list[int]:
    """req's prompt and outputs, a placeholder for each token still in flight."""
    return req.all_token_ids + [PLACEHOLDER_TOKEN] * req.num_output_placeholders


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 long_prefill_threshold: int = 0, tiers=None, *, policy: str = "fcfs",
                 cost_model: StepCostModel | None = None, target_step_ms: float | None = 0,
                 max_postpone_ms: float = 10_000.0, clock=time.monotonic,
                 prefill_schedule_interval: int = 1) -> None:
        """Defaults keep the plain behaviour (fcfs, token budget only); EngineCore passes the
        configured policy, cost model and target (loomserve.config.scheduler)."""
        # Waiting requests are admitted only on steps whose number (schedule() calls; a
        # lockstep driver may set it) is a multiple of the prefill schedule interval, so DP
        # ranks start prefills together and none waits for another's at the MoE all-to-all.
        self.prefill_schedule_interval = prefill_schedule_interval
        self.step_number = 0
        self.kv = kv
        self.tiers = tiers  # TierConnector or None
        self.transfer = None  # KVTransferConnector (prefill/decode legs) or None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.long_prefill_threshold = long_prefill_threshold
        self.policy = policy
        self.cost_model = cost_model
        self.target_step_ms = target_step_ms
        self.layout = ModelLayout.from_kv_config(getattr(kv, "config", None))
        self.waiting = WaitingQueue(policy, max_postpone_ms / 1000.0, kv, clock)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # for the runner, reported once
        self.num_preemptions = 0
        self.preemptions_by_cause: Counter[str] = Counter()  # decode_blocks, prefill_blocks
        self.last_target_s: float | None = None  # the latest step's time target (stats)
        # Hybrid models only: per-step state directives ride along with each seq.
        self._states = kv.state_directives if getattr(kv, "has_state_groups", False) else None
        # Speculative decoding (loomserve.engine.spec.verify.SpecDecoder) or None: decode
        # requests may carry drafts, verified in the step and rolled back in update().
        self.spec = None
        # Async scheduling (loomserve.engine.step_overlap): schedule() counts the step as
        # computed at once and gives each sampling request a placeholder token; update() puts
        # the real tokens in. Set by EngineCore.
        self.async_scheduling = False

    # -- queue management ------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.kv.refresh_prefix(req)
        if self.tiers is not None:
            self.tiers.on_add(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and release everything it holds."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            self.waiting.remove(req)
        self.waiting.forget(req)
        if status != RequestStatus.FINISHED_ABORTED:
            self.waiting.note_turn(req.session_id)
        req.status = status
        req.grammar = None  # frees its matcher
        aborted = status == RequestStatus.FINISHED_ABORTED
        if self.tiers is not None:
            self.tiers.on_finish(req, aborted=aborted)
        if self.transfer is not None:
            self.transfer.before_free(req)
        self.kv.free(req)
        if self.transfer is not None:
            # after free: a state checkpoint at the prompt's end is hashed by it
            self.transfer.on_finish(req)
            self.transfer.on_freed(req, finished_ok=not aborted)
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)
        if self.spec is not None:
            self.spec.on_finished(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Running requests first (fcfs, or no time target: in order; else decodes first and
        then running prefills and waiting requests together in the policy's order, so a warm
        turn is not queued behind a running cold prefill for the step's spare time)."""
        out = SchedulerOutput(ModelInput([], self._finished_ids))
        self._finished_ids = []
        budget = self.max_num_batched_tokens
        plan = self._plan()
        split = plan.target is not None and self.policy != "fcfs"
        if self.spec is not None:  # drafts follow a request's latest token: never a placeholder
            self.spec.begin_step([r for r in self.running
                                  if r.num_tokens - r.num_computed_tokens == 1
                                  and not r.num_output_placeholders])
        if self.policy != "fcfs":  # higher priority first; victims come from later ones
            self.running.sort(key=lambda r: r.priority)
        done: set[str] = set()  # given blocks this step
        deferred = []
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted by an earlier one this step
            if self.async_scheduling and self._awaits_token(req):
                continue
            if split and req.num_tokens - req.num_computed_tokens > 1:
                deferred.append(req)
                continue
            budget = self._run_one(out, req, budget, plan, done)
        if split:
            self._fill_prefills(out, deferred, budget, plan, done)
        elif not out.preempted:
            self._admit_waiting(out, budget, plan)
        self._finish_plan(out, plan)
        if self.async_scheduling:
            for req, n in out.scheduled:  # as if the step had run: the next one follows it
                req.num_computed_tokens += n
        self.step_number += 1
        return out

    def _awaits_token(self, req: Request) -> bool:
        """Async scheduling: req sits this step out until its placeholder is real, when the
        token in flight may be its last (max_tokens: no extra step is run for it) or its
        grammar must accept that token before the next mask is built."""
        p = req.num_output_placeholders
        return p > 0 and (req.grammar is not None or req.num_output_tokens + p >= req.max_tokens)

    def _prefill_allowed(self) -> bool:  # may this step admit new prefill work?
        return self.step_number % self.prefill_schedule_interval == 0

    def _run_one(self, out: SchedulerOutput, req: Request, budget: int, plan: StepPlan,
                 done: set[str]) -> int:
        """Schedule a running request's next chunk, preempting while the pool is short;
        returns the budget left."""
        left = req.num_tokens - req.num_computed_tokens
        n = self._chunk(req, left, budget, plan, req.num_computed_tokens)
        if n == 0:
            return budget  # no time left for this prefill chunk this step
        drafts = self.spec.drafts_for(req, budget) if left == 1 and self.spec is not None \
            else ()
        if drafts and not self.kv.allocate_slots(req, 1 + len(drafts), num_draft=len(drafts)):
            drafts = ()  # no room for the drafts: a plain decode step (which may preempt)
        elif drafts:
            self._add_to_batch(out, req, 1, drafts)
            done.add(req.request_id)
            return budget - 1 - len(drafts)
        while not self.kv.allocate_slots(req, n):
            victim = self._victim(req, n, done)
            self.running.remove(victim)
            self._preempt(victim, "decode_blocks" if left == 1 else "prefill_blocks")
            out.preempted.append(victim)
            if victim is req:
                return budget
        self._add_to_batch(out, req, n)
        done.add(req.request_id)
        if left > 1:
            plan.add(req.num_computed_tokens, n)
            self.waiting.progressed(req)
        return budget - n

    def _fill_prefills(self, out: SchedulerOutput, deferred: list[Request], budget: int,
                       plan: StepPlan, done: set[str]) -> None:
        """The step's time left, to running prefills and waiting requests in one policy order
        (a running prefill's key counts its tokens left as its uncached work)."""
        key = self.waiting.key
        items = [(key(r, r.num_tokens - r.num_computed_tokens), k, r)
                 for k, r in enumerate(deferred)]
        admit = not out.preempted and bool(self.waiting) and self._prefill_allowed() and \
            len(self.running) < self.max_num_seqs
        if admit:
            items += [(key(r), len(deferred) + k, r) for k, r in enumerate(self.waiting.order())]
        items.sort(key=lambda x: x[:2])
        for _, _, req in items:
            if budget <= 0:
                break
            if req.status == RequestStatus.RUNNING:
                budget = self._run_one(out, req, budget, plan, done)
            elif admit and not out.preempted:
                admitted, budget = self._admit_one(out, req, budget, plan)
                admit = admitted is not None

    def _plan(self) -> StepPlan:
        return StepPlan.for_step(self.running, self.layout, self.cost_model, self.target_step_ms,
                                 self.kv.block_size)

    def _finish_plan(self, out: SchedulerOutput, plan: StepPlan) -> None:
        """The exact features of what was scheduled (for the cost model to learn from)."""
        feats = StepFeatures(self.layout)
        for req, n in out.scheduled:
            feats.add(req.num_computed_tokens, n)
        out.features = feats.vector
        out.target_s = plan.target
        self.last_target_s = plan.target

    def _victim(self, req: Request, n: int, done: set[str]) -> Request:
        """fcfs: the last admitted; else the cheapest recompute not yet given blocks this step."""
        return self.running[-1] if self.policy == "fcfs" else victim_for(
            req, n, self.running, done, self.kv, self.cost_model, self.layout)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, plan: StepPlan) -> None:
        if not self.waiting or budget <= 0 or len(self.running) >= self.max_num_seqs or \
                not self._prefill_allowed():
            return  # before ordering: the order may probe the prefix cache
        for req in self.waiting.order():
            if budget <= 0:
                break
            admitted, budget = self._admit_one(out, req, budget, plan)
            if admitted is None:
                break

    def _admit_one(self, out: SchedulerOutput, req: Request, budget: int, plan: StepPlan
                   ) -> tuple[bool | None, int]:
        """Try to admit one waiting request: (True admitted / False skipped, it waits for
        something of its own / None: stop admitting this step, budget left)."""
        if len(self.running) >= self.max_num_seqs or not self._prefill_allowed():
            return None, budget
        if self._held(req):
            return False, budget
        tiers = self.tiers
        if tiers is not None:
            verdict = tiers.prepare(req)
            if verdict == "wait":
                return False, budget  # waits for its tier I/O; the ones behind it may go
            if verdict == "full":
                return None, budget
        hit, num_hit = self.kv.get_computed_blocks(req, record_stats=False)
        # A decode leg whose tail block arrived computes only its last prompt token.
        tail = self.transfer.tail_for(req, num_hit) if self.transfer is not None else None
        left = req.num_tokens - num_hit
        req.long_prefill = left > (self.long_prefill_threshold or self.max_num_batched_tokens)
        n = 1 if tail else self._chunk(req, left, budget, plan, num_hit)
        if n == 0:
            return None, budget  # no time left this step: the head keeps its place
        if not self.kv.allocate_slots(req, left if tail else n, hit, num_hit):
            return None, budget  # the pool is full: running requests free blocks as they end
        self.waiting.remove(req)
        req.num_computed_tokens = num_hit
        if tail is not None:
            self.transfer.apply_tail(req, tail)
            req.num_computed_tokens = req.num_tokens - 1
        # Hit-rate counters count a request once, at its first admission, as its usage's
        # cached_tokens does: not the probes of a request waiting for blocks, not the
        # re-admission of a preempted one.
        first = req.num_cached_tokens < 0
        tier_tokens = tiers.on_admit(req, num_hit, count=first) if tiers is not None else 0
        if first:
            req.num_cached_tokens = req.num_computed_tokens  # with a tail: all but the last
            req.num_tier_cached_tokens = tier_tokens
            req.queued_s = time.monotonic() - req.arrival_time
            explain = getattr(self.kv, "explain_miss", None)
            if explain is not None:  # why the rest missed (kv.miss_causes)
                req.miss = explain(req, req.num_cached_tokens, tiers is not None)
            if self.kv.enable_caching:
                self.kv.stats.prefix_queried_tokens += len(req.all_token_ids)
                self.kv.stats.prefix_hit_tokens += num_hit
        req.status = RequestStatus.RUNNING
        if self.transfer is not None:
            self.transfer.on_admit(req)
        self.running.append(req)
        self._add_to_batch(out, req, n)
        plan.add(req.num_computed_tokens, n)
        self.waiting.progressed(req)
        return True, budget - n

    def _held(self, req: Request) -> bool:
        """A waiting request sits out while its grammar compiles, its tail block (a decode leg)
        is read (at most TailReads.max_wait_s), or while the request whose prompt it shares
        (n > 1) has not prefilled it yet, so it then hits those blocks."""
        if req.num_output_placeholders:
            return True  # preempted with a token in flight: re-admitted once it is known
        if (req.grammar is not None and not req.grammar.ready) or \
                (self.transfer is not None and self.transfer.tail_waiting(req)):
            return True
        if req.sibling_of is None:
            return False
        first = self.requests.get(req.sibling_of)
        if first is None or first.sibling_of is not None:
            return False  # gone, or itself a sibling: never wait in a chain (or a cycle)
        if first.status != RequestStatus.RUNNING:
            return True  # still waiting (maybe for its grammar, which always becomes ready)
        return first.num_computed_tokens < first.num_prompt_tokens

    def _chunk(self, req: Request, left: int, budget: int, plan: StepPlan, context: int) -> int:
        """Tokens of req to compute this step: its left tokens capped by the long-prefill
        threshold and the token budget, then by the step-time plan (0: none this step)."""
        if self.long_prefill_threshold and left > self.long_prefill_threshold:
            left = self.long_prefill_threshold
        return plan.chunk(min(left, budget), context, req.long_prefill)

    def _add_to_batch(self, out: SchedulerOutput, req: Request, n: int,
                      drafts: list[int] | tuple = ()) -> None:
        """n of the request's tokens from num_computed_tokens, then its drafts (a decode's)."""
        start = req.num_computed_tokens
        out.scheduled.append((req, n + len(drafts)))
        token_ids = req.all_token_ids[start:start + n]
        if len(token_ids) < n:  # async scheduling: the token the step in flight samples
            token_ids += [PLACEHOLDER_TOKEN] * (n - len(token_ids))
        num_output = req.num_output_tokens + req.num_output_placeholders
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=token_ids,
            start_pos=start,
            block_ids=self.kv.get_block_ids(req.request_id),
            sample=start + n == req.num_tokens,
            sampling=req.sampling,
            num_output_tokens=num_output,
        )
        if drafts:
            seq.token_ids += drafts
            seq.num_draft = len(drafts)
            out.num_drafts[req.request_id] = len(drafts)
        if self._states is not None:
            seq.states = self._states(req)
        sp = req.sampling
        if sp.uses_penalties:
            seq.history, seq.num_prompt_tokens = req.all_token_ids, req.num_prompt_tokens
            if self.async_scheduling:  # a copy: update() appends while the step runs
                seq.history = token_history(req)
        if num_output < sp.min_tokens and req.grammar is None:  # a grammar decides
            seq.suppress = sorted(req.stop_token_ids)
        if self.async_scheduling and seq.sample:
            req.num_output_placeholders += 1
            out.placeholders.append(req)
        out.model_input.seqs.append(seq)

    def _preempt(self, req: Request, cause: str) -> None:
        self.kv.free(req, release="preempted")  # its evicted blocks: a preemption's misses
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.preemptions_by_cause[cause] += 1
        self.waiting.appendleft(req)

    # -- after the model ran ---------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               verified: dict[str, list[int]] | None = None
               ) -> list[tuple[Request, list[int]]]:
        """Advance computed counts, append sampled tokens, finish what stopped. verified:
        per request with drafts, its accepted drafts then the token sampled after them.

        Returns (request, new token ids) for every request that produced a token."""
        if self.async_scheduling:
            return self._update_async(out, sampled, verified)
        produced = []
        for req, n in out.scheduled:
            if req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += n
            d = out.num_drafts.get(req.request_id) if out.num_drafts else None
            if d:
                produced.append((req, self._accept(req, d, verified[req.request_id])))
                continue
            token = sampled.get(req.request_id)
            if token is None:
                continue  # a prefill chunk that does not reach the end of the prompt yet
            status = req.append_token(token)
            produced.append((req, [token]))
            if status is not None:
                self.finish(req, status)
        if self.spec is not None:
            self.spec.end_step()
        return produced

    def _update_async(self, out: SchedulerOutput, sampled: dict[str, int],
                      verified: dict[str, list[int]] | None
                      ) -> list[tuple[Request, list[int]]]:
        """Async scheduling: computed counts advanced at schedule time; here each placeholder
        becomes its real token. A request that finished meanwhile (a stop token found by the
        update before, an abort) drops it: its extra row in this step emits nothing. A request
        preempted meanwhile keeps it, as it would have without async scheduling. A request with
        drafts was not scheduled again while they were verified (EngineCore drains the step
        first): its count rolls back past the rejected ones as without async scheduling."""
        produced = []
        drafted = out.num_drafts
        for req in out.placeholders:
            req.num_output_placeholders -= 1
            if req.status.finished:
                continue
            d = drafted.get(req.request_id) if drafted else None
            if d:
                produced.append((req, self._accept(req, d, verified[req.request_id])))
                if not req.status.finished:
                    self.kv.cache_computed_blocks(req)
                continue
            token = sampled[req.request_id]
            status = req.append_token(token)
            self.kv.cache_computed_blocks(req)  # a block that ended at the placeholder
            produced.append((req, [token]))
            if status is not None:
                self.finish(req, status)
        if self.spec is not None:
            self.spec.end_step()
        return produced

    def _accept(self, req: Request, num_drafts: int, tokens: list[int]) -> list[int]:
        """A verified decode: roll num_computed_tokens back past the rejected drafts (their
        KV rows are rewritten by later tokens), append the tokens up to a finishing one."""
        accepted = len(tokens) - 1
        req.num_computed_tokens -= num_drafts - accepted
        self.spec.on_verified(req.request_id, num_drafts, accepted)
        for i, token in enumerate(tokens):
            status = req.append_token(token)
            if status is not None:
                self.finish(req, status)
                return tokens[:i + 1]
        return tokens
