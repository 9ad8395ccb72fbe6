"""KV events on the wire: vLLM's format, so llm-d's precise prefix-cache scorer and Dynamo's KV
router read a loomserve instance as they read a vLLM one.

A publisher sends each batch as a 3-frame ZMQ multipart message: topic (bytes, may be empty),
an 8-byte big-endian sequence number, and the msgpack of a `KVEventBatch` (an array
[ts, events, data_parallel_rank?]); each event a map tagged by its class name ("type":
"BlockStored"). The replay socket (ROUTER) answers a request frame holding an 8-byte start
sequence with every buffered batch from there as (topic, seq, payload), then an end marker
(empty topic, seq -1, empty payload).

The field names, their order and which ones have defaults mirror vLLM's
vllm/distributed/kv_events.py (0.33): a field vLLM requires must never be omitted here, which
is why lora_id/medium/lora_name have no defaults. tests/control check the bytes decode with
vLLM's own classes from a peer environment.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"  # the engine's own pool, whatever its device (consumers filter on it)
MEDIUM_CPU = "CPU"  # the host-memory tier
MEDIUM_STORAGE = "STORAGE"  # disk and shared-pool tiers
END_SEQ = (-1).to_bytes(8, "big", signed=True)

BlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; tag=True: encoded as a map with "type": the class name."""


class BlockStored(KVCacheEvent):
    """Blocks became hittable under block_hashes (chain order); token_ids of all of them (empty
    for a tier copy, whose tokens the consumer learned from the device event)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def batch_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(KVEventBatch)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
