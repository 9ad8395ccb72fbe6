"""What the engine reports per request as it makes progress."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # all output tokens so far
    text: str = ""  # all output text so far, stop strings cut off
    new_token_ids: list[int] = field(default_factory=list)  # since the previous report
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (device + tiers)
    num_tier_cached_tokens: int = 0  # of those, loaded from a KV tier below the device
    # Aligned with new_token_ids when SamplingParams.logprobs is set (else None): per token,
    # (its logprob, [(token_id, logprob) of the top-k]), the model's raw log-softmax.
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # all so far
    stop_reason: str | None = None  # the stop string that ended the output, if one did
    # A finished prefill leg's kv_transfer_params for its decode leg (loomserve.kv.transfer);
    # None otherwise, and when nothing could be staged.
    kv_transfer_params: dict | None = None
    # Seconds the core held the request before its first admission (None: not admitted yet).
    queued_s: float | None = None
    # Once finished: why its uncached prompt tokens missed, cause -> tokens (they sum to
    # prompt tokens - num_cached_tokens; loomserve.kv.miss_causes), and details (diverged
    # position, eviction policy and age). None without prefix caching or before the end.
    miss_causes: dict[str, int] | None = None
    miss_detail: dict | None = None
