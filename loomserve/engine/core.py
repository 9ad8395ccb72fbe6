"""The engine core: schedule, run, postprocess. Token ids in, token ids out.

It owns the scheduler, the KV cache manager (data plane) and the executor (the model on every
rank), and is driven by exactly one thread: the core loop (core_loop.py), in its own process
or, for debugging and `LLM`, in the caller's. Under --async-scheduling the model steps run on
an execution thread of their own, one step ahead of the update (step_overlap.py).
With KV tiers, a TierConnector (loomserve.kv.connector) sits beside the KV manager: the
scheduler asks it about waiting requests, each step offers it the blocks just computed and
polls it; its I/O runs on the tier store's threads.
Invariants: every request added gets exactly one finished CoreOutput (a rejection included);
at most `max_waiting_requests` requests wait for admission.
"""

from __future__ import annotations

import json
import logging
import os
import time

import msgspec

from loomserve.config import EngineConfig
from loomserve.engine.executor import Executor, make_executor
from loomserve.engine.messages import (
    REJECTED,
    CoreOutput,
    CoreReady,
    EngineCoreRequest,
    EngineStats,
)
from loomserve.engine.sched.request import Request, RequestStatus
from loomserve.engine.sched.scheduler import Scheduler, SchedulerOutput
from loomserve.engine.sched.step_cost import ModelLayout, StepCostModel, prior_seconds_per_unit
from loomserve.engine.spec.verify import SpecDecoder
from loomserve.engine.step_overlap import StepOverlap, leave_a_core
from loomserve.engine.step_trace import StepTrace
from loomserve.execution.batch import ModelInput, ModelOutput
from loomserve.execution.model_runner import ModelRunner
from loomserve.execution.models.loading.hub import pin_hub_model
from loomserve.execution.parallel.shared_pool import layout_id
from loomserve.execution.structured import StructuredManager
from loomserve.kv.cache_manager import KVCacheManager
from loomserve.kv.connector import (
    TierConnector,
    build_tiered_store,
    model_identity,
    tiers_supported,
)
from loomserve.kv.event_publisher import KVEventPublisher
from loomserve.kv.eviction import FlopModel
from loomserve.kv.retention import RetentionConfig
from loomserve.kv.spec import LinearStateSpec
from loomserve.kv.transfer import KVTransferConnector

log = logging.getLogger("loomserve.engine")


def make_tier_connector(config: EngineConfig, runner: ModelRunner, kv: KVCacheManager
                        ) -> TierConnector | None:
    """The KV tiers the config asks for, connected to the pool; None when off or unsupported."""
    if not config.tier.enabled:
        return None
    if not config.cache.enable_prefix_caching:
        log.warning("KV tiers need prefix caching; tiers disabled")
        return None
    if not tiers_supported(runner.kv_cache_config):
        kinds = sorted({g.spec.kind for g in runner.kv_cache_config.groups})
        log.warning("KV tiers disabled: no tier support for one of this model's layer kinds "
                    "(%s)", ", ".join(kinds))
        return None
    store = build_tiered_store(config.tier, runner.tier_page_bytes)
    log.info("KV tiers: %s", " -> ".join(t.name for t in store.tiers))
    return TierConnector(kv, store, runner.tier_pages, tier_model_id(config, runner),
                         config.tier.tier_max_inflight)


def tier_model_id(config: EngineConfig, runner: ModelRunner) -> str:
    """The weights' identity plus the rank layout of a logical page (tier fingerprint)."""
    return model_identity(kv_model_name(config, runner), runner.model_folder,
                          config.model.resolved_cache_dir) + layout_id(config)


def kv_model_name(config: EngineConfig, runner: ModelRunner) -> str:
    """The name KV identities hash: the model's, plus any --hf-overrides (RoPE scaling rotates
    every K of the same weights differently: such KV must not be shared with a plain run)."""
    o = config.model.hf_overrides
    return runner.model_name + (f"+{json.dumps(o, sort_keys=True)}" if o else "")


def _miss(req: Request) -> dict | None:
    """A finished request's miss attribution as the front end reads it (CoreOutput.miss)."""
    m = req.miss
    return None if m is None else {"causes": m.causes, "detail": m.detail}


def make_event_publisher(config: EngineConfig, runner: ModelRunner, kv: KVCacheManager,
                         tiers: TierConnector | None) -> KVEventPublisher | None:
    """The KV event publisher when --kv-events-endpoint is set, fed by the pool and tiers."""
    c = config.control
    if not c.kv_events_endpoint:
        return None
    pub = KVEventPublisher(c.kv_events_endpoint, c.kv_events_replay_endpoint,
                           runner.kv_cache_config, c.kv_events_topic, c.kv_events_buffer_steps)
    kv.subscribe(pub.on_pool_event)
    if tiers is not None:
        pub.watch_tiers(tiers)
    log.info("KV events: PUB %s, replay %s", pub.endpoint, pub.replay_endpoint)
    return pub


def make_transfer_connector(core: "EngineCore") -> KVTransferConnector:
    """Prefill/decode hooks (loomserve.kv.transfer); the backend starts at the first transfer."""
    r, c = core.runner, core.config
    kc = r.kv_cache_config
    identity = lambda: model_identity(kv_model_name(c, r), r.model_folder,  # noqa: E731
                                      c.model.resolved_cache_dir)
    attach = core.attach_tiers if tiers_supported(kc) else None
    return KVTransferConnector(c.control, core.kv, r.kv_buffer, identity, attach,
                               lambda: core.tiers)


def retention_config(config: EngineConfig) -> RetentionConfig:
    c = config.cache
    return RetentionConfig(interval="interval" in c.retention, every_n_tokens=c.checkpoint_every,
                           marconi="marconi" in c.retention,
                           max_checkpoints_per_path=c.max_checkpoints_per_path,
                           pin_ttl_s=c.session_pin_ttl, pin_budget_bytes=c.session_pin_budget)


def flop_model(runner: ModelRunner) -> FlopModel:
    """FLOPs to recompute a prefix: 2 per parameter per token, plus the quadratic attention term
    of the attention layers (what FLOP-aware eviction weighs a block or checkpoint by)."""
    mc = runner.model_config
    attn_layers = sum(len(g.layer_ids) for g in runner.kv_cache_config.groups
                      if not isinstance(g.spec, LinearStateSpec))
    return FlopModel(linear_flops_per_token=2.0 * runner.num_params,
                     attn_flops_per_pair=4.0 * attn_layers * mc.num_heads * mc.head_dim)


def step_cost_model(runner: ModelRunner) -> StepCostModel:
    """The online step-time model, its prior from the model's FLOPs at a rough device rate
    (100 GFLOP/s on CPU, 100 TFLOP/s on an accelerator); measured steps correct it within
    a few steps (loomserve.engine.sched.step_cost)."""
    mc = runner.model_config
    layout = ModelLayout.from_kv_config(runner.kv_cache_config)
    rate = 1e11 if str(runner.device).startswith("cpu") else 1e14
    return StepCostModel(prior_seconds_per_unit(layout, runner.num_params,
                                                mc.num_heads * mc.head_dim, rate))


def make_spec_decoder(config: EngineConfig, runner: ModelRunner,
                      max_model_len: int) -> SpecDecoder | None:
    """Speculative decoding when --speculative-config asks for it (on hybrid models too: the
    linear-state groups keep the state after each draft and restore the accepted one,
    kv/managers/linear_state.py)."""
    spec = config.speculative.speculative_config
    if spec is None:
        return None
    log.info("speculative decoding: %s, up to %d drafts a request a step", spec.method,
             spec.num_speculative_tokens)
    return SpecDecoder(spec, max_model_len)


def make_step_overlap(config: EngineConfig, executor: Executor,
                      scheduler: Scheduler) -> StepOverlap | None:
    """The execution thread of --async-scheduling (None without it)."""
    if not config.scheduler.async_scheduling:
        return None
    scheduler.async_scheduling = True
    scheduler.kv.keep_in_flight_windows()
    log.info("async scheduling: the next step is scheduled while this one executes")
    threads = leave_a_core(executor.driver_runner.device)
    if threads is not None:
        log.info("async scheduling on a CPU: the model runs %d threads, leaving a core to the "
                 "core thread (on a few cores the synchronous engine is faster: "
                 "docs/design/scheduler.md)", threads - 1)
    return StepOverlap(executor.execute_model, threads)


def _shape(inp) -> str:
    """A step's batch for the slow-step log: sequences, new tokens, longest context."""
    seqs = inp.seqs
    new = sum(len(s.token_ids) for s in seqs) if seqs else 0
    ctx = max((s.start_pos + len(s.token_ids) for s in seqs), default=0)
    return f"seqs={len(seqs)} new_tokens={new} max_context={ctx}"


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        # a hub id -> its snapshot, once, before any rank starts (loading/hub.py); a path: as is
        self.config = config = pin_hub_model(config)
        self.executor = executor or make_executor(config)
        self.runner = self.executor.driver_runner
        self.kv = KVCacheManager(self.runner.kv_cache_config,
                                 enable_caching=config.cache.enable_prefix_caching,
                                 retention=retention_config(config), eviction=config.cache.eviction,
                                 flop_model=flop_model(self.runner))
        self.tiers = make_tier_connector(config, self.runner, self.kv)
        self.transfer = make_transfer_connector(self)
        sc = config.scheduler
        self.cost_model = step_cost_model(self.runner)
        self.scheduler = Scheduler(self.kv, sc.max_num_batched_tokens, sc.max_num_seqs,
                                   sc.long_prefill_threshold, self.tiers,
                                   policy=sc.scheduling_policy, cost_model=self.cost_model,
                                   target_step_ms=sc.target_step_ms,
                                   max_postpone_ms=sc.max_postpone_ms,
                                   prefill_schedule_interval=sc.prefill_schedule_interval)
        self.scheduler.transfer = self.transfer
        capacity = self.runner.kv_cache_config.capacity_tokens
        if capacity < self.runner.kv_cache_config.block_size:
            raise ValueError("the KV cache holds less than one block: raise --kv-cache-memory")
        max_len = config.model.max_model_len
        if max_len and max_len > capacity:
            raise ValueError(f"--max-model-len {max_len} exceeds the KV cache capacity "
                             f"of {capacity} tokens: raise --kv-cache-memory")
        # A request must fit in the pool alone, or preemption could never make room for it.
        self.max_model_len = min(self.runner.max_model_len, capacity)
        # A waiting request holds no block, but more of them than blocks could never all run.
        self.max_waiting_requests = (sc.max_waiting_requests if sc.max_waiting_requests
                                     is not None else self.kv.num_blocks)
        self.spec = make_spec_decoder(config, self.runner, self.max_model_len)
        if self.spec is not None and self.kv.pins is not None:  # drafts live as long as the KV
            self.kv.pins.on_drop = self.spec.drop_session
        self.scheduler.spec = self.spec
        self.overlap = make_step_overlap(config, self.executor, self.scheduler)
        self._pace_tiers()
        self._last_update: float | None = None  # async: when the latest step was updated
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_rejected = 0
        self.structured: StructuredManager | None = None
        self.trace = StepTrace()
        # Last: its sockets are bound only once nothing else in the constructor can fail.
        self.events = make_event_publisher(config, self.runner, self.kv, self.tiers)

    def add(self, msg: EngineCoreRequest) -> CoreOutput | None:
        """Queue a front end's request; a finished REJECTED output when the queue is full."""
        if len(self.scheduler.waiting) >= self.max_waiting_requests:
            self.num_rejected += 1
            return CoreOutput(msg.request_id, [], True, REJECTED, 0)
        req = Request.from_message(msg)
        if req.sampling.structured is not None:
            self.structured_manager().attach(req)
        self.add_request(req)
        return None

    def structured_manager(self) -> StructuredManager:
        """Made at the first structured request (it loads the tokenizer's vocabulary)."""
        if self.structured is None:
            r = self.runner
            self.structured = StructuredManager(r.model_folder, r.vocab_size,
                                                list(r.model_config.eos_token_ids))
        return self.structured

    def add_request(self, req: Request) -> None:
        self.transfer.on_add(req)
        self.scheduler.add(req)
        self.prompt_tokens += req.num_prompt_tokens

    def abort(self, request_id: str,
              status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> bool:
        """End a request early (client gone, or a stop string the front end matched)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, status)
        return True

    def end_session(self, session_id: str) -> None:
        """The agent session is over: release its pinned blocks and its prefix-hash memo."""
        self.kv.end_session(session_id)
        if self.spec is not None:
            self.spec.drop_session(session_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or (self.overlap is not None and
                                             self.overlap.in_flight)

    def step(self) -> list[CoreOutput]:
        trace = self.trace
        trace.begin()
        start = time.perf_counter()
        tiers = self.tiers
        if tiers is not None:
            tiers.poll()
        self.transfer.poll()
        trace.mark("poll")
        outputs = self._grammar_failures() if self.structured is not None else []
        sched = SchedulerOutput(ModelInput([])) if self._drain_first() else \
            self.scheduler.schedule()
        inp = sched.model_input
        if self.structured is not None:
            self.structured.fill_bitmask(inp, self.scheduler.requests)
        trace.mark("schedule")
        if self.overlap is not None:  # async scheduling: start this step, finish the one before
            sched, result = self._swap(sched)
            inp = sched.model_input
        else:
            result = self._execute(sched)
        shape = self.spec.step_shape(inp) if self.spec is not None else None
        trace.mark("execute")
        if tiers is not None:
            tiers.after_execute()
            if not sched.model_input.seqs:
                tiers.wait_io(0.005)  # only tier I/O is pending: do not spin
        if not inp.seqs and self.structured is not None:
            self.structured.wait(0.005)  # only grammars are compiling: do not spin
        trace.mark("after")
        if result.drafts and self.spec is not None:  # MTP: drafted by the runner (before the
            self.spec.receive(result.drafts)  # update, so a request it finishes drops them)
        logprobs = result.logprobs
        for req, tokens in self.scheduler.update(sched, result.sampled, result.verified):
            self.generation_tokens += len(tokens)
            done = req.status.finished
            lp = logprobs.get(req.request_id)
            if lp is not None:  # a list with drafts: one per token verified, cut at the finish
                lp = lp[:len(tokens)] if isinstance(lp, list) else [lp]
            outputs.append(CoreOutput(req.request_id, tokens, done,
                                      req.status.value if done else None, req.num_cached_tokens,
                                      req.num_tier_cached_tokens, lp,
                                      getattr(req, "kv_transfer_result", None) if done else None,
                                      queued_s=req.queued_s, miss=_miss(req) if done else None))
        if self.events is not None:
            self.events.flush()
        trace.mark("update")
        if inp.seqs:  # the drafts' whole cost: proposals, rows, verification
            seconds = self._step_seconds(start)
            if shape is not None and seconds is not None:
                self.spec.observe_step(shape, seconds)
        if trace.enabled:
            trace.end(_shape(inp))
        return outputs

    def _drain_first(self) -> bool:
        """Async scheduling: this step only finishes the one in flight (1) while a decode leg
        may get its tail copied at admission: the copy writes a block allocated at schedule
        time, and rows a finish, abort or preemption freed meanwhile may still be written by
        the step in flight (an import's tier load waits for that step itself,
        kv/connector/loads.py); (2) when the step in flight verifies drafts, or the next may
        draft for a request whose token it samples (drafts follow known tokens,
        step_overlap.py)."""
        ov = self.overlap
        if ov is None or not ov.in_flight:
            return False
        if self.scheduler.waiting and self.transfer.tails_held():
            return True
        spec = self.spec
        return spec is not None and (ov.drafts_in_flight or
                                     spec.wants_drain(self.scheduler.running))

    def _step_seconds(self, start: float) -> float | None:
        """A step's whole time for the draft budget: schedule to update without async
        scheduling; with it, the time since the update before (the steps' period: an
        overlapped step costs what the overlap leaves; a drained one its whole length).
        None for the first step after idling."""
        now = time.perf_counter()
        if self.overlap is None:
            return now - start
        last, self._last_update = self._last_update, now
        return None if last is None else now - last

    def _execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Run a scheduled step on the workers and time it for the cost model."""
        inp = sched.model_input
        # Finished ids go to the workers even in a step without seqs (their per-request state).
        if not inp.seqs:
            return (self.executor.execute_model(inp)
                    if inp.finished_request_ids else ModelOutput({}))
        t0 = time.perf_counter()
        result = self.executor.execute_model(inp)
        seconds = time.perf_counter() - t0
        self.cost_model.observe(sched.features, seconds)
        return result

    def _swap(self, sched: SchedulerOutput) -> tuple[SchedulerOutput, ModelOutput]:
        """Async scheduling: start sched; the step that ran before it, with its output, to
        update now (an empty step when none was in flight)."""
        done = self.overlap.swap(sched)
        if done is None:
            return SchedulerOutput(ModelInput([])), ModelOutput({})
        sched, result, seconds = done
        if sched.model_input.seqs:
            self.cost_model.observe(sched.features, seconds)
        return sched, result

    def _grammar_failures(self) -> list[CoreOutput]:
        """End the requests whose grammar failed to compile (the front end validated the spec,
        so this is rare: e.g. a schema feature xgrammar only rejects when compiling)."""
        outputs = []
        for req, error in self.structured.poll():
            log.warning("request %s: grammar failed to compile: %s", req.request_id, error)
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            outputs.append(CoreOutput(req.request_id, [], True, req.status.value, 0))
        return outputs

    def attach_tiers(self, store, max_inflight: int | None = None) -> TierConnector:
        """Connect a ready-made TieredStore (e.g. with custom tiers) to this engine's pool."""
        if self.tiers is not None:
            raise RuntimeError("this engine already has KV tiers")
        runner = self.runner
        self.tiers = TierConnector(self.kv, store, runner.tier_pages,
                                   tier_model_id(self.config, runner),
                                   max_inflight or self.config.tier.tier_max_inflight)
        self.scheduler.tiers = self.tiers
        self._pace_tiers()
        if self.events is not None:
            self.events.watch_tiers(self.tiers)
        return self.tiers

    def _pace_tiers(self) -> None:
        """Async scheduling: tier copies wait for the steps that write their rows."""
        if self.overlap is not None and self.tiers is not None:
            self.tiers.pace(lambda: self.overlap.in_flight)

    def idle(self) -> None:
        """No request to run: notice a dead worker rank (so an idle engine reports it within
        the loop's idle wait, not at the next request), release finished tier writes and
        start due prefetches."""
        self.trace.idle()
        self._last_update = None  # an idle gap is no step's time
        self.executor.check_health()
        if self.tiers is not None:
            self.tiers.poll()
        self.transfer.poll()
        if self.events is not None:
            self.events.flush()

    def close(self) -> None:
        if self.overlap is not None:
            self.overlap.close()
        self.executor.shutdown()
        self.transfer.close()
        if self.structured is not None:
            self.structured.close()
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
            self.scheduler.tiers = None
        if self.events is not None:
            self.events.close()

    def stats(self) -> EngineStats:
        kv = self.kv
        p50, p90 = self.cost_model.error_quantiles()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_blocks_total=kv.num_blocks,
            prefix_queried_tokens=kv.stats.prefix_queried_tokens,
            prefix_hit_tokens=kv.stats.prefix_hit_tokens,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_preemptions_by_cause=dict(self.scheduler.preemptions_by_cause),
            target_step_ms=(self.scheduler.last_target_s or 0.0) * 1000.0,
            step_cost_error_p50=p50, step_cost_error_p90=p90,
            step_cost_samples=self.cost_model.num_samples,
            num_rejected=self.num_rejected,
            prefix_hit_tokens_by_source=(
                self.tiers.hit_tokens_by_source()
                if self.tiers is not None else {"device": kv.stats.prefix_hit_tokens}),
            tiers=self.tiers.stats() if self.tiers is not None else {},
            tier_snapshots=self.tier_snapshots(),
            **self.spec_stats(),
        )

    def spec_stats(self) -> dict:
        if self.spec is None:
            return {}
        s = self.spec.stats
        return {"spec_decode_num_drafts": s.num_drafts,
                "spec_decode_num_draft_tokens": s.num_draft_tokens,
                "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(s.accepted_per_pos)}

    def ready(self) -> CoreReady:
        """What the front end learns once the model is loaded (see CoreReady)."""
        r = self.runner
        kc = r.kv_cache_config
        return CoreReady(
            model_name=self.config.model.served_model_name or r.model_name,
            model_folder=r.model_folder, eos_token_ids=list(r.model_config.eos_token_ids),
            max_model_len=self.max_model_len, vocab_size=r.vocab_size,
            block_size=kc.block_size, kv_capacity_tokens=kc.capacity_tokens,
            kv_blocks_total=kc.num_blocks, max_waiting_requests=self.max_waiting_requests,
            num_params=r.num_params, weight_bytes=r.weight_bytes, device=str(r.device),
            dtype=self.config.model.resolved_dtype, quantization=r.quantization,
            kv_cache_dtype=str(r.kv_dtype).removeprefix("torch."),
            tier_names=[t.name for t in self.tiers.store.tiers] if self.tiers else [],
            pid=os.getpid(), role=self.config.control.role,
            **(self.events_ready() if self.events is not None else {}))

    def events_ready(self) -> dict:
        e = self.events
        return {"kv_events_endpoint": e.endpoint, "kv_events_replay_endpoint": e.replay_endpoint,
                "kv_events_topic": e.topic}

    def tier_snapshots(self) -> list[dict]:
        """Each tier's counters, health and latency histograms, as plain data."""
        if self.tiers is None:
            return []
        # to_builtins: the same plain data whether the snapshot crosses a socket or not
        return [msgspec.to_builtins(s.snapshot()) for s in self.tiers.store.stats()]
