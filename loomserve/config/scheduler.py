"""Continuous batching limits and admission."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64  # most requests running at once
    long_prefill_threshold: int = 512  # per-request prefill cap per step; 0 disables it
    # Most requests waiting for admission; beyond it new requests are refused (HTTP 429).
    # None: one per KV block of the pool (more could never all be admitted at once).
    max_waiting_requests: int | None = None
    # Admission order of waiting requests (loomserve.engine.sched.waiting_queue): cache_aware
    # (priority, then warm sessions, then least uncached work, with aging), priority (vLLM's:
    # the request's priority, then arrival), fcfs (arrival; preempted first).
    scheduling_policy: str = "cache_aware"
    # Step-time budget in ms: None = auto (2.5x the learned cost of the step's decodes), 0 = off
    # (token budget only); the token budget stays the upper bound. Off by default: on the
    # 2-core test CPU the auto budget cut stream stalls (worst gap 7.8 -> 1.8 s beside a cold
    # 6K prefill) but stretched cold prefills 5.6x, and on equal-work AgentX replays it cost
    # 5-9% of TPGS (ITL p99/p50 4.88 -> 4.22 at 16 sessions, 2.76 -> 3.31 at 4;
    # docs/design/scheduler.md); opt in with --target-step-ms auto (or a number).
    target_step_ms: float | None = 0.0
    # Aging: a request waiting longer than this goes to the front of the admission order.
    max_postpone_ms: float = 10_000.0
    # New prefill work (admitting a waiting request) only on steps whose number is a multiple
    # of this; decodes and running prefill chunks continue every step (see Scheduler).
    prefill_schedule_interval: int = 1
    # Streaming granularity (SGLang's and vLLM's --stream-interval): a request's tokens go to
    # the front end once N have gathered; its first token, its last and any output while a
    # stats snapshot goes out (every few tens of ms) go at once. 1 = every token. Larger
    # values save the per-token hops (core -> API process -> client), which a small host pays
    # out of the decode (docs/design/scheduler.md).
    stream_interval: int = 1
    # vLLM's --async-scheduling: step N+1 is scheduled while step N executes on another
    # thread (loomserve.engine.step_overlap). Off until measured to help on the host it runs
    # on (docs/design/scheduler.md, "Async scheduling").
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.long_prefill_threshold < 0:
            raise ValueError("long_prefill_threshold must be >= 0")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if self.scheduling_policy not in ("cache_aware", "priority", "fcfs"):
            raise ValueError("scheduling_policy must be cache_aware, priority or fcfs")
        if self.target_step_ms is not None and self.target_step_ms < 0:
            raise ValueError("target_step_ms must be >= 0 (0: off, None: auto)")
        if self.max_postpone_ms < 0:
            raise ValueError("max_postpone_ms must be >= 0")
        if self.prefill_schedule_interval < 1:
            raise ValueError("prefill_schedule_interval must be >= 1")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
