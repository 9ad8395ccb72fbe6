"""Messages between the front end and the engine core."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queried_tokens: int = 0  # cumulative
    prefix_hit_tokens: int = 0  # cumulative
    prompt_tokens: int = 0  # cumulative, prefill tokens requested
    generation_tokens: int = 0  # cumulative
    num_preemptions: int = 0  # cumulative
    # Served prefix-hit tokens by where they came from: "device" and one entry per KV tier,
    # counted once per admitted request (prefix_hit_tokens also counts retried lookups);
    # per-tier store counters under tiers.
    prefix_hit_tokens_by_source: dict[str, int] = field(default_factory=dict)
    tiers: dict = field(default_factory=dict)
