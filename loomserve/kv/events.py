"""KV cache events: what the pool stores and drops, for routers and shared caches to index.

The pool calls its subscribers in-process, synchronously, in order; there is no transport here.
Events are only built when someone subscribed, so an unobserved pool pays nothing for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


@dataclass
class BlockStored:
    """Blocks of one group became hittable under `block_hashes` (in chain order).

    parent_block_hash is the hash of the block before the first one (None at a prefix start);
    token_ids are the tokens of all the stored blocks, block_size per block.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    group_id: int
    medium: str = "device"


@dataclass
class BlockRemoved:
    """Blocks of one group are no longer hittable (reused for other content)."""

    block_hashes: list[bytes]
    group_id: int
    medium: str = "device"


@dataclass
class AllBlocksCleared:
    """The whole prefix cache was dropped."""


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
EventHook = Callable[[KVCacheEvent], None]
