"""A request as the engine core sees it: token ids in, token ids out.

Lifecycle: WAITING -> RUNNING -> (PREEMPTED -> WAITING ...) -> FINISHED_*. Preemption is by
recompute: the request drops its blocks and later prefills prompt + generated tokens again,
usually hitting its own freed-but-still-hashed blocks.
"""

from __future__ import annotations

import enum
import time

from loomserve.sampling_params import SamplingParams

# An output token not known yet (async scheduling): the step in flight samples it, the next
# step's input carries this in its place and the execution thread fills it in
# (loomserve.engine.step_overlap).
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class Request:
    """Satisfies loomserve.kv.cache_manager.KVRequest (the KV manager owns block_hashes)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 max_tokens: int, eos_token_ids: frozenset[int] = frozenset(), *,
                 session_id: str | None = None, parent_session_id: str | None = None,
                 cache_salt: str | None = None, sibling_of: str | None = None,
                 kv_transfer_params: dict | None = None, priority: int = 0) -> None:
        self.request_id = request_id
        # Scheduling priority (vLLM's): lower goes first under the priority and cache_aware
        # policies, and is preempted last.
        self.priority = priority
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.session_id = session_id
        self.parent_session_id = parent_session_id
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic()
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Async scheduling: tokens a scheduled step will sample, counted in num_tokens but not
        # yet in all_token_ids (which holds real tokens only: the KV manager hashes it).
        self.num_output_placeholders = 0
        self.block_hashes: list[bytes] = []
        self.status = RequestStatus.WAITING
        self.num_cached_tokens = -1  # set at first admission; -1 = not admitted yet
        self.num_tier_cached_tokens = 0  # of those, loaded from a KV tier (host/disk/remote)
        self.queued_s = -1.0  # arrival to first admission (set then; -1 = not admitted yet)
        # Why its uncached prompt tokens missed (kv.miss_causes.MissAttribution), set at
        # first admission; None before, or without prefix caching.
        self.miss = None
        self.num_preemptions = 0
        # Set at each admission: its uncached work exceeded one long-prefill chunk, so the
        # step-time budget cuts its chunks (a short prefill, e.g. a warm turn, goes whole).
        self.long_prefill = False
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= eos_token_ids
        self.stop_token_ids = frozenset(stop_ids)
        # n > 1: this sample waits for request `sibling_of` to prefill the shared prompt.
        self.sibling_of = sibling_of
        # Grammar-constrained decoding (loomserve.execution.structured.RequestGrammar); the
        # core sets it at add, the scheduler drops it when the request finishes.
        self.grammar = None
        # Prefill/decode disaggregation (loomserve.kv.transfer): the params the request came
        # with; remote_decode: it is a prefill leg, whose finished output carries
        # kv_transfer_result (the params for the decode leg, or None).
        self.kv_transfer_params = kv_transfer_params
        self.remote_decode = False
        self.kv_transfer_result: dict | None = None

    @classmethod
    def from_message(cls, msg) -> "Request":
        """The core's request for a front end's EngineCoreRequest (loomserve.engine.messages)."""
        return cls(msg.request_id, msg.prompt_token_ids, msg.sampling, msg.max_tokens,
                   frozenset(msg.eos_token_ids), session_id=msg.session_id,
                   parent_session_id=msg.parent_session_id, cache_salt=msg.cache_salt,
                   sibling_of=msg.sibling_of,
                   kv_transfer_params=getattr(msg, "kv_transfer_params", None),
                   priority=getattr(msg, "priority", 0))

    @property
    def num_tokens(self) -> int:
        """Tokens so far, the ones a step in flight will sample included."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Record a sampled token; return the finished status if it ends the request."""
        self.all_token_ids.append(token_id)
        if token_id in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        # Each sampled token is accepted exactly once (a recompute after preemption samples
        # only new tokens); the grammar ending (a stop token it accepted) ends the request.
        if self.grammar is not None and not self.grammar.accept(token_id):
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
