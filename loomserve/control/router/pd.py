"""Prefill/decode disaggregation, the router's half: when to split a request, and the two
bodies of the handshake (the instances' half is in the serve side; the contract: the
kv_transfer_params dict, which the router passes through without looking inside).

The decision is per request: disaggregate only when the tokens the decode instance would have
to prefill itself (prompt tokens - its cached prefix x block_size) exceed the threshold.
Default 2048 tokens: below that a prefill is a single chunk of a typical step budget
(max_num_batched_tokens 2048-8192) that the decode instance absorbs in one step, for less
than the transfer's fixed cost (an extra HTTP hop, a KV pull); above it, a prefill stalls the
decode instance's running streams for several steps, which a prefill instance spares them. A
warm agent turn (96% of a 50K-token prompt cached) leaves ~2K uncached and goes straight to
decode; a cold 50K prompt is disaggregated.

Roles: prefill-role instances receive only prefill legs; decode- and both-role instances
receive client requests (everything below the threshold, and decode legs).
"""

from __future__ import annotations

import copy

from loomserve.control.router.instances import Instance
from loomserve.control.router.kv_index import KVIndex
from loomserve.control.router.policies import Decision, RouteRequest
from loomserve.control.router.tokens import API_RESPONSES

DEFAULT_PD_THRESHOLD_TOKENS = 2048
CLIENT_ROLES = ("both", "decode")


def client_candidates(healthy: list[Instance]) -> list[Instance]:
    """Instances a client's request (or a decode leg) may go to."""
    return [i for i in healthy if i.role in CLIENT_ROLES]


def prefill_candidates(healthy: list[Instance]) -> list[Instance]:
    return [i for i in healthy if i.role == "prefill"]


def uncached_tokens(req: RouteRequest, decision: Decision, index: KVIndex,
                    block_size: int) -> int | None:
    """Prompt tokens the chosen instance does not hold (None: the prompt is unknown)."""
    keys = req.keys()
    if keys is None:
        return None
    ids, hashes = keys
    overlap = decision.overlap
    if overlap is None:
        overlap = index.overlaps(hashes).get(decision.instance.name, 0)
    return max(0, len(ids) - overlap * block_size)


def should_disaggregate(uncached: int | None, threshold: int) -> bool:
    return uncached is not None and uncached > threshold


def prefill_body(api: str, body: dict) -> dict:
    """The prefill leg: the client's body computing one token, not streamed, asking the
    instance to hold the KV for a remote decode."""
    out = copy.copy(body)
    out["max_output_tokens" if api == API_RESPONSES else "max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    if api == API_RESPONSES:
        out["store"] = False  # the leg is not a turn of the conversation
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_body(body: dict, params: dict) -> dict:
    """The decode leg: the client's body plus the prefill's kv_transfer_params."""
    out = copy.copy(body)
    out["kv_transfer_params"] = params
    return out
