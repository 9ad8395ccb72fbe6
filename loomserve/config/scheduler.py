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

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.long_prefill_threshold < 0:
            raise ValueError("long_prefill_threshold must be >= 0")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
