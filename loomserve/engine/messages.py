"""Every message between the front end and the engine core, as msgspec structs.

The same structs cross a ZMQ socket (msgpack, tagged unions below) when the core runs in its
own process, and are handed over as objects when it runs in a thread or in `LLM`. The core
only sees token ids: text (chat templates, tokenization, detokenization, stop strings) stays in
the front end.

Front end -> core: `CoreInput` (add, abort, end a session, shut down).
Core -> front end: `CoreEvent` (ready after boot, a failed boot, a batch of outputs with an
optional stats snapshot, the core's death). Invariants: a request id gets exactly one output
with finished=True (a rejection is one too), after which nothing more; a `CoreDead` is the
last event the core sends.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from loomserve.sampling_params import SamplingParams

# finish_reason of a request the core refused to queue (its waiting queue is full): HTTP 429.
REJECTED = "rejected"


class EngineCoreRequest(msgspec.Struct, tag="add", kw_only=True):
    """A validated request: prompt ids within the context, max_tokens resolved."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    eos_token_ids: list[int] = []
    session_id: str | None = None
    parent_session_id: str | None = None
    cache_salt: str | None = None
    sibling_of: str | None = None  # n > 1: prefill after this request, reusing its prompt KV
    # Prefill/decode disaggregation (loomserve.kv.transfer.params): {"do_remote_decode": true}
    # on a prefill leg, the prefill's returned params on a decode leg.
    kv_transfer_params: dict[str, Any] | None = None
    # Scheduling priority (vLLM's `priority`): lower is served first (policies priority and
    # cache_aware, loomserve.engine.sched.waiting_queue) and preempted last.
    priority: int = 0


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]
    # "abort" (client gone), or "stop" (a stop string matched in the front end)
    status: str = "abort"


class EndSession(msgspec.Struct, tag="end_session"):
    session_id: str


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


CoreInput = Union[EngineCoreRequest, AbortRequests, EndSession, Shutdown]


class CoreOutput(msgspec.Struct, array_like=True):
    """One request's progress in one step (array_like: sent once per request per step)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    num_tier_cached_tokens: int = 0
    # Per new token, when the request asked for logprobs: (sampled token's logprob, top-k ids,
    # their logprobs), the model's raw log-softmax.
    logprobs: list[tuple[float, list[int], list[float]]] | None = None
    # A finished prefill leg's kv_transfer_params for the decode leg (None: none staged).
    kv_transfer_params: dict[str, Any] | None = None
    # Seconds from the core's receipt to the request's first admission (-1: not admitted
    # yet); the front end's queue span and vllm:request_queue_time_seconds read it.
    queued_s: float = -1.0
    # On the finished output: why its uncached prompt tokens missed, {"causes": {cause:
    # tokens}, "detail": {...}} (loomserve.kv.miss_causes); None otherwise.
    miss: dict[str, Any] | None = None


class EngineStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_queried_tokens: int = 0  # cumulative
    prefix_hit_tokens: int = 0  # cumulative
    prompt_tokens: int = 0  # cumulative, prefill tokens requested
    generation_tokens: int = 0  # cumulative
    num_preemptions: int = 0  # cumulative
    num_rejected: int = 0  # cumulative, refused with a full waiting queue
    # Preemptions by cause (decode_blocks, prefill_blocks), cumulative; they sum to
    # num_preemptions.
    num_preemptions_by_cause: dict[str, int] = {}
    # The step-time budget (loomserve.engine.sched.scheduler): the latest step's target in ms
    # (0: none), and the step cost model's relative prediction error over recent steps.
    target_step_ms: float = 0.0
    step_cost_error_p50: float = 0.0
    step_cost_error_p90: float = 0.0
    step_cost_samples: int = 0  # cumulative steps the cost model learned from
    # Served prefix-hit tokens by where they came from: "device" and one entry per KV tier,
    # counted once per admitted request (prefix_hit_tokens also counts retried lookups);
    # connector and store counters under tiers.
    prefix_hit_tokens_by_source: dict[str, int] = {}
    tiers: dict[str, Any] = {}
    # Per tier: counters, health and latency histograms (loomserve.kv.tiers.stats snapshots,
    # histograms as {bounds, counts, total, count}).
    tier_snapshots: list[dict[str, Any]] = []
    # Speculative decoding (loomserve.engine.spec.verify), cumulative, vLLM's meanings: drafts
    # (one request's drafts in one step), draft tokens, accepted tokens, accepted at position i.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []


class CoreReady(msgspec.Struct, tag="ready", kw_only=True):
    """What the front end needs from the loaded model: names, limits and where the tokenizer
    files are (it reads them itself)."""

    model_name: str
    model_folder: str
    eos_token_ids: list[int]
    max_model_len: int
    vocab_size: int
    block_size: int
    kv_capacity_tokens: int
    kv_blocks_total: int
    max_waiting_requests: int
    num_params: int
    weight_bytes: int
    device: str = "cpu"
    dtype: str = "float32"
    quantization: str = "none"  # the weights' mode as loaded (--quantization auto resolved)
    kv_cache_dtype: str = "float32"  # the pages' dtype, resolved (--kv-cache-dtype auto: dtype)
    tier_names: list[str] = []
    pid: int = 0
    role: str = "both"  # prefill | decode | both (loomserve.config.control)
    # Where the core publishes its KV events (the bound addresses, ports resolved), or None.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""


class CoreFailed(msgspec.Struct, tag="failed"):
    """The core could not start (bad model path, pool too small...): a user error or a bug."""

    error: str
    traceback: str = ""


class CoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[CoreOutput]
    # A snapshot rides along at most every few tens of ms, and whenever a request finished or
    # the core went idle, so /metrics is never staler than a response the client already has.
    stats: EngineStats | None = None


class CoreDead(msgspec.Struct, tag="dead"):
    """The core loop hit an exception: every in-flight request fails; the core exits."""

    error: str
    traceback: str = ""


CoreEvent = Union[CoreReady, CoreFailed, CoreOutputs, CoreDead]


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreInput)


def event_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreEvent)
