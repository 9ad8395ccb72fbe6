"""KVCacheManager: the facade the scheduler uses (pool + hasher + coordinator + managers).

Call pattern per request (see the engine's scheduler):
    hit, n_hit = kv.get_computed_blocks(req)          # only while req holds no blocks
    ok = kv.allocate_slots(req, n_new, hit, n_hit)    # right after; False = pool too small
    ... the scheduler advances req.num_computed_tokens ...
    ok = kv.allocate_slots(req, n_new)                # next chunks / decode steps
    kv.free(req)                                      # finished, aborted or preempted
Preemption by recompute is free(req) + num_computed_tokens = 0; the request keeps its
block_hashes, which stay valid and are never recomputed.

A hit handle is valid until the next allocate_slots/free/reset call: allocate_slots checks it
(cheaply, via the pool's eviction epoch) and raises StaleHitError if its blocks were reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from loomserve.kv.coordinator import KVCacheCoordinator, KVHit, StaleHitError
from loomserve.kv.events import EventHook
from loomserve.kv.hashing import BlockHasher
from loomserve.kv.pool import BlockPool
from loomserve.kv.spec import KVCacheConfig

__all__ = ["KVCacheManager", "KVCacheStats", "KVHit", "KVRequest", "StaleHitError"]


class KVRequest(Protocol):
    request_id: str
    all_token_ids: list[int]  # prompt + generated so far; append-only
    num_prompt_tokens: int
    num_computed_tokens: int
    cache_salt: str | None
    session_id: str | None
    block_hashes: list[bytes]  # starts []; only the KV manager appends to it


@dataclass
class KVCacheStats:
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, config: KVCacheConfig, enable_caching: bool = True,
                 event_hook: EventHook | list[EventHook] | None = None,
                 max_sessions: int = 1024) -> None:
        hooks = [] if event_hook is None else (
            list(event_hook) if isinstance(event_hook, (list, tuple)) else [event_hook])
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.enable_caching = enable_caching
        self.pool = BlockPool(config.num_blocks, len(config.groups), enable_caching, hooks)
        self.coordinator = KVCacheCoordinator(config, self.pool)
        self.hasher = BlockHasher(self.block_size, max_sessions)
        self.stats = KVCacheStats()
        self._empty = self.coordinator.empty_hit

    def subscribe(self, fn: EventHook) -> None:
        self.pool.subscribe(fn)

    # -- prefix hits ----------------------------------------------------------------------
    def get_computed_blocks(self, req: KVRequest) -> tuple[KVHit, int]:
        """Longest cached prefix of req.all_token_ids, capped at len-1, block aligned.
        Returns (hit handle for allocate_slots, number of hit tokens); takes no references."""
        if not self.enable_caching:
            return self._empty, 0
        n = len(req.all_token_ids)
        bs = self.block_size
        hashes = self.hasher.ensure(req, n // bs)
        self.hasher.remember(req)
        hit = self.coordinator.find_longest_hit(hashes, (n - 1) // bs)
        num_hit = hit.num_blocks * bs
        self.stats.prefix_queried_tokens += n
        self.stats.prefix_hit_tokens += num_hit
        return hit, num_hit

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(self, req: KVRequest, num_new_tokens: int, hit: KVHit | None = None,
                       num_hit_tokens: int = 0) -> bool:
        """Cover num_computed_tokens + num_hit_tokens + num_new_tokens positions, claiming the
        hit first; all or nothing (False changes nothing). Blocks full once these tokens are
        computed are cached under their hashes."""
        bs = self.block_size
        if num_hit_tokens % bs:
            raise ValueError("num_hit_tokens must be block aligned")
        total = req.num_computed_tokens + num_hit_tokens + num_new_tokens
        rid = req.request_id
        if not self.coordinator.allocate(rid, total, hit, num_hit_tokens // bs, req.block_hashes):
            return False
        if self.enable_caching:
            tokens = req.all_token_ids
            num_full = min(total, len(tokens)) // bs
            if num_full > self.coordinator.num_cached_blocks(rid):
                hashes = self.hasher.ensure(req, num_full)
                self.coordinator.cache_full_blocks(rid, min(num_full, len(hashes)), hashes,
                                                   tokens)
        return True

    def free(self, req: KVRequest) -> None:
        """Release all of req's blocks, tail first; no-op if it holds none."""
        self.coordinator.free(req.request_id)
        if self.enable_caching:
            self.hasher.remember(req)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """Per-group block ids; the same list objects on every call until free."""
        ids = self.coordinator.block_ids(request_id)
        if ids is None:
            return [[] for _ in self.coordinator.managers]
        return ids

    # -- state ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; only when no block is in use. Session hash memos stay (they
        hold content hashes, not blocks)."""
        return self.pool.reset_prefix_cache()

    def end_session(self, session_id: str) -> None:
        self.hasher.end_session(session_id)
