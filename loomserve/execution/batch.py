"""The contract between the control plane (scheduler) and the execution plane (model runner).

The scheduler decides, per step, which requests run and how many of their tokens; the runner
turns that into forward passes and sampled tokens. Nothing else crosses the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from loomserve.kv.directives import StateDirective
from loomserve.sampling_params import SamplingParams


@dataclass
class ScheduledSeq:
    """One request's share of a step.

    token_ids are the tokens to compute this step: a prefill chunk, or the one latest token of a
    decoding request. Their positions are start_pos .. start_pos + len(token_ids) - 1, and the
    KV of positions < start_pos is already in the cache (computed earlier or a prefix hit).
    block_ids[g] is the request's block table for KV group g; it covers every position up to
    start_pos + len(token_ids) - 1. The list objects are the scheduler's own and only grow, so
    passing them costs nothing (the worker-receives-diffs rule matters once the worker is
    another process).
    sample is True when the chunk ends at the request's latest token, so a next token is due.
    Speculative decoding: the last num_draft of token_ids are drafts after the request's latest
    token (token_ids[0]); the runner runs the 1 + num_draft tokens as decode rows, each gets
    logits and the drafts are verified (loomserve.execution.rejection_sampler).
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[list[int]]
    sample: bool
    sampling: SamplingParams
    # Generated tokens so far; the runner uses len() to derive per-token seeds.
    num_output_tokens: int = 0
    # Linear/SSM-state groups only: group index -> what to do with the request's state.
    states: dict[int, StateDirective] = field(default_factory=dict)
    # Logits processing, set only for seqs whose sampling needs it (plain seqs pay nothing):
    # history is the request's prompt + output ids (the scheduler's own list) for penalties;
    # suppress are token ids masked this step (stop tokens before min_tokens); bitmask_row is
    # this seq's row in ModelInput.token_bitmask (grammar-constrained decoding).
    history: list[int] | None = None
    num_prompt_tokens: int = 0
    suppress: list[int] | None = None
    bitmask_row: int | None = None  # with drafts: the first of its 1 + num_draft rows
    num_draft: int = 0


@dataclass
class ModelInput:
    seqs: list[ScheduledSeq]
    # Requests that ended since the last step, so the runner can drop per-request state.
    finished_request_ids: list[str] = field(default_factory=list)
    # Allowed-token bitmask (int32 [rows, ceil(vocab / 32)], CPU) of the seqs with a grammar,
    # filled by the core after scheduling; None when no scheduled seq has one.
    token_bitmask: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class ModelOutput:
    # request_id -> sampled token id, only for seqs with sample=True.
    sampled: dict[str, int]
    # request_id -> (sampled token's logprob, top-k ids, their logprobs), for seqs asking.
    # (a request with drafts: a list of those, one per token of `verified`)
    logprobs: dict[str, Any] = field(default_factory=dict)
    # request_id -> accepted drafts then the token sampled after them, seqs with drafts only.
    verified: dict[str, list[int]] = field(default_factory=dict)
    # MTP drafting (execution/spec_mtp.py): request_id -> (the request's token count they
    # follow, draft ids), proposed to the next step by the core's MtpDrafter.
    drafts: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
