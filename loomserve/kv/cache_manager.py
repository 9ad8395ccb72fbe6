"""KVCacheManager: the facade the scheduler uses (pool + hasher + coordinator + managers).

Per request: get_computed_blocks (only while it holds no blocks), allocate_slots right after
and for each later chunk or decode step (False: the pool is too small, nothing changed), free
when it finishes, aborts or is preempted. state_directives says what the runner does with a
hybrid model's recurrent states in the step just allocated; the "packed pages and tiers"
methods are the tier connector's only way into the pool. The call pattern, the packed layout
and subagents: docs/design/kv-cache.md.

Invariants:
- A hit handle is valid until the next allocate_slots/free/reset call; allocate_slots raises
  StaleHitError if its blocks were reused.
- The step allocated by allocate_slots has run before the request's next allocate_slots or free.
- A preempted request keeps its block_hashes: they stay valid and are never recomputed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from loomserve.kv.coordinator import KVCacheCoordinator, KVHit, StaleHitError
from loomserve.kv.directives import StateDirective
from loomserve.kv.events import EventHook
from loomserve.kv.eviction import FlopAwareEvictor, FlopModel
from loomserve.kv.hashing import BlockHasher
from loomserve.kv.managers import count_free, manager_class
from loomserve.kv.managers.sliding_window import SlidingWindowManager
from loomserve.kv.miss_causes import RELEASE_PREEMPTED, DropRecord, MissAttribution, MissAttributor
from loomserve.kv.pool import Block, BlockPool
from loomserve.kv.retention import RetentionConfig, SessionPins
from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig

__all__ = ["RELEASE_PREEMPTED", "KVCacheManager", "KVCacheStats", "KVHit", "KVRequest", "StaleHitError",
           "RetentionConfig", "FlopModel", "EVICTION_POLICIES"]

EVICTION_POLICIES = ("lru", "flop_aware")
_NO_STATES: dict[int, StateDirective] = {}


class KVRequest(Protocol):
    request_id: str
    all_token_ids: list[int]  # prompt + generated so far; append-only
    num_prompt_tokens: int
    num_computed_tokens: int
    cache_salt: str | None
    session_id: str | None
    block_hashes: list[bytes]  # starts []; only the KV manager appends to it
    # Optional (read with getattr): parent_session_id, a subagent's parent session.


@dataclass
class KVCacheStats:
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


def default_flop_model(config: KVCacheConfig) -> FlopModel:
    """A rough FLOP model from the specs alone (hidden size guessed as 8x the KV width of the
    attention layers, ~12 hidden^2 parameters per layer); pass a real one when known."""
    layers = sum(len(g.layer_ids) for g in config.groups)
    attn = [g for g in config.groups if isinstance(g.spec, FullAttentionSpec)]
    width = max((g.spec.num_kv_heads * g.spec.head_dim for g in attn), default=512)
    hidden = 8 * width
    attn_layers = sum(len(g.layer_ids) for g in attn)
    return FlopModel(2.0 * 12 * hidden * hidden * layers, 4.0 * attn_layers * hidden)


class KVCacheManager:
    """The data plane facade.

    retention: which state checkpoints to keep and session pinning (RetentionConfig; default:
    only the state at each request's end). eviction: "lru" (the free queue order) or
    "flop_aware" (recency + eviction_alpha * FLOPs saved per byte, see kv.eviction), with
    flop_model (default: a rough one from the specs). clock: for pin TTLs (tests inject one).
    """

    def __init__(self, config: KVCacheConfig, enable_caching: bool = True,
                 event_hook: EventHook | list[EventHook] | None = None,
                 max_sessions: int = 1024, retention: RetentionConfig | None = None,
                 eviction: str = "lru", flop_model: FlopModel | None = None,
                 eviction_alpha: float = 1.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        hooks = [] if event_hook is None else (
            list(event_hook) if isinstance(event_hook, (list, tuple)) else [event_hook])
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {eviction!r}")
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.enable_caching = enable_caching
        self.retention = retention or RetentionConfig()
        null = any(manager_class(g.spec).needs_null_block for g in config.groups)
        usable = config.num_blocks - null
        evictor = None
        if eviction == "flop_aware":
            flop_model = flop_model or default_flop_model(config)
            evictor = FlopAwareEvictor(usable, flop_model, eviction_alpha)
        else:
            flop_model = None
        self.eviction = eviction
        self.pool = BlockPool(config.num_blocks, len(config.groups), enable_caching, hooks,
                              reserve_null_block=null, evictor=evictor)
        self.coordinator = KVCacheCoordinator(config, self.pool, self.retention, flop_model)
        self.hasher = BlockHasher(self.block_size, max_sessions)
        self.stats = KVCacheStats()
        self._empty = self.coordinator.empty_hit
        self.state_groups = [m.group_id for m in self.coordinator.state_managers]
        managers = self.coordinator.managers
        # Per group: pages grow with tokens (attention, one page per block) rather than being
        # state checkpoints; a hit of b blocks reads all of [0, b) (full attention).
        self.token_block_groups = [m.token_blocks for m in managers]
        self.prefix_closed_groups = [m.prefix_closed_hits for m in managers]
        self.has_state_groups = bool(self.state_groups)
        # Miss attribution (kv.miss_causes): the pool notes every hash it drops.
        self.misses: MissAttributor | None = None
        # Attribution reads one group whose pages grow with tokens; a model of state layers
        # only has none (its misses go unexplained: the usage carries no causes).
        self._live_group = next((m.group_id for m in managers if m.token_blocks), None)
        if enable_caching and self._live_group is not None:
            self.pool.drops = DropRecord(clock=clock)
            live = self.pool.cached[self._live_group]
            self.misses = MissAttributor(self.block_size, live, self.has_state_groups,
                                         eviction, self.pool.drops, clock=clock)
        self.pins: SessionPins | None = None
        if self.retention.pinning and enable_caching:
            page = config.page_bytes
            self.pins = SessionPins(self.pool, self.retention.pin_ttl_s,
                                    self.retention.pin_budget_bytes // max(1, page), clock)

    def subscribe(self, fn: EventHook) -> None:
        self.pool.subscribe(fn)

    # -- prefix hits ----------------------------------------------------------------------
    def get_computed_blocks(self, req: KVRequest, record_stats: bool = True
                            ) -> tuple[KVHit, int]:
        """Longest cached prefix of req.all_token_ids, capped at len-1, block aligned.
        Returns (hit handle for allocate_slots, number of hit tokens); takes no references.
        record_stats=False: a probe (e.g. before a tier lookup) that the hit-rate counters
        must not count."""
        if not self.enable_caching:
            return self._empty, 0
        if self.pins is not None:
            self._parent_active(req)
        n = len(req.all_token_ids)
        bs = self.block_size
        hashes = self.hasher.ensure(req, n // bs)
        self.hasher.remember(req)
        hit = self.coordinator.find_longest_hit(hashes, (n - 1) // bs)
        num_hit = hit.num_blocks * bs
        if record_stats:
            self.stats.prefix_queried_tokens += n
            self.stats.prefix_hit_tokens += num_hit
        return hit, num_hit

    def refresh_prefix(self, req: KVRequest) -> int:
        """A request arrived that will hit its cached prefix: make those blocks the most
        recently used (tail first, so chain heads stay longest), as if used now. Its wait in
        the queue then evicts what no waiting request needs before its own prefix (LRU from
        the last use alone evicts first the session back from the longest tool call, the one
        about to run). Takes no reference; returns the blocks refreshed."""
        if not self.enable_caching:
            return 0
        hit, _ = self.get_computed_blocks(req, record_stats=False)
        null = self.pool.null_block
        blocks = [b for group in hit.blocks for b in group if b is not None and b is not null]
        if blocks:
            self.pool.touch(blocks)
            self.pool.free(reversed(blocks))
        return len(blocks)

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(self, req: KVRequest, num_new_tokens: int, hit: KVHit | None = None,
                       num_hit_tokens: int = 0, cache: bool = True, num_draft: int = 0) -> bool:
        """Cover num_computed_tokens + num_hit_tokens + num_new_tokens positions, claiming the
        hit first; all or nothing (False changes no block). Blocks full once these tokens are
        computed are cached under their hashes. Session pins past their time-to-live are
        released first, whatever the outcome (housekeeping). cache=False allocates without caching the new
        blocks (their content arrives later, e.g. a tier load); a later allocate_slots caches
        them once num_computed_tokens covers them. num_draft: the last num_draft of the new
        tokens are drafts (speculative decoding), whose states state groups keep for rollback."""
        bs = self.block_size
        if num_hit_tokens % bs:
            raise ValueError("num_hit_tokens must be block aligned")
        total = req.num_computed_tokens + num_hit_tokens + num_new_tokens
        rid = req.request_id
        coord = self.coordinator
        if self.pins is not None:
            self._parent_active(req)  # first: a subagent's step keeps its parent's pin
            self.pins.expire()
        if coord.stepped:
            if self.enable_caching and self.has_state_groups:
                self.hasher.ensure(req, min(total, len(req.all_token_ids)) // bs)
            ok = coord.allocate(rid, total, hit, num_hit_tokens // bs, req.block_hashes,
                                req.num_computed_tokens, req.num_prompt_tokens, num_draft)
        else:
            ok = coord.allocate(rid, total, hit, num_hit_tokens // bs, req.block_hashes)
        if not ok:
            return False
        if self.enable_caching and cache:
            tokens = req.all_token_ids
            num_full = min(total, len(tokens)) // bs
            if num_full > self.coordinator.num_cached_blocks(rid):
                hashes = self.hasher.ensure(req, num_full)
                self.coordinator.cache_full_blocks(rid, min(num_full, len(hashes)), hashes,
                                                   tokens)
        return True

    def cache_computed_blocks(self, req: KVRequest) -> None:
        """Cache the blocks req's computed tokens fill that allocate_slots left uncached: under
        async scheduling a block's last token may have been a placeholder (not yet in
        all_token_ids, so not hashable) when its step was allocated."""
        rid = req.request_id
        if not self.enable_caching or self.coordinator.block_ids(rid) is None:
            return
        tokens = req.all_token_ids
        num_full = min(req.num_computed_tokens, len(tokens)) // self.block_size
        if num_full > self.coordinator.num_cached_blocks(rid):
            hashes = self.hasher.ensure(req, num_full)
            self.coordinator.cache_full_blocks(rid, min(num_full, len(hashes)), hashes, tokens)

    def explain_miss(self, req: KVRequest, num_cached: int, tiers: bool = False
                     ) -> MissAttribution | None:
        """Split req's uncached prompt tokens (num_prompt_tokens - num_cached) by cause (see
        kv.miss_causes); call once, at its first admission. None without prefix caching."""
        if self.misses is None:
            return None
        n = req.num_prompt_tokens
        hashes = self.hasher.ensure(req, max(0, n - 1) // self.block_size)
        blocks = self.coordinator.request_blocks(req.request_id)
        own = blocks[self._live_group] if blocks is not None else ()
        return self.misses.attribute(req.all_token_ids, n, hashes, num_cached, req.cache_salt,
                                     self.hasher.previous(req), tiers, own)

    def free(self, req: KVRequest, release: str | None = None) -> None:
        """Release all of req's blocks, tail first; no-op if it holds none. release (e.g.
        "preempted"): why, marked on the blocks it held last (kv.miss_causes). With state groups,
        the checkpoints of its last step become hittable (that step has run), and the state at
        the last boundary it crossed is kept. With pinning, the session's latest hit boundary
        (checkpoint + prefix blocks) is pinned first."""
        coord = self.coordinator
        rid = req.request_id
        if self.pins is not None:
            self._parent_active(req)  # the parent's pin TTL runs from its subagent's end
        if self.enable_caching and (coord.state_managers or self.pins is not None) and \
                coord.block_ids(rid) is not None:
            hashes = self.hasher.ensure(req)
            coord.finish(rid, hashes, req.num_computed_tokens)
            if self.pins is not None and req.session_id is not None:
                n = coord.hit_boundary(rid)
                blocks = coord.blocks_for_hit_at(hashes, n) if n > 0 else None
                if blocks:
                    self.pins.pin(req.session_id, blocks)
        if release is not None:
            self._mark_release(rid, release)
        coord.free(rid)
        if self.enable_caching:
            self.hasher.remember(req)
            self.hasher.drop_previous(req)

    def _mark_release(self, request_id: str, release: str) -> None:
        blocks = self.coordinator.request_blocks(request_id)
        for group in blocks or ():
            for b in group:
                if b is not None and b.ref_cnt == 1 and b.block_hash is not None:
                    b.release = release

    def _parent_active(self, req: KVRequest) -> None:
        """A subagent request is in the engine: its parent session counts as active, so the
        parent's pin (the prefix its next turn hits) does not expire while its subagents run.
        Lazy like expiry: refreshed whenever the request is probed, allocated or freed."""
        parent = getattr(req, "parent_session_id", None)
        if parent is not None and parent != req.session_id:
            self.pins.refresh(parent)

    def state_directives(self, req: KVRequest) -> dict[int, StateDirective]:
        """Per state group index, what the runner does with req's state in the step just
        allocated by allocate_slots. Empty (a shared dict: do not mutate) without state
        groups."""
        if not self.has_state_groups:
            return _NO_STATES
        rid = req.request_id
        out = {}
        for mgr in self.coordinator.state_managers:
            d = mgr.directive(rid)
            if d is not None:
                out[mgr.group_id] = d
        return out

    # -- packed pages and tiers ---------------------------------------------------------
    def pages_for_hashes(self, block_hashes: list[bytes]) -> list[tuple[int, int]]:
        """(group, block id) of every cached page keyed by one of block_hashes: a KV block of
        an attention group or a state checkpoint ending at that block. Each page is one row
        [page_bytes] of the runner's packed buffer, so it is copied out and back as a unit."""
        out = []
        for g, cached in enumerate(self.pool.cached):
            get = cached.get
            for h in block_hashes:
                b = get(h)
                if b is not None:
                    out.append((g, b.block_id))
        return out

    def request_pages(self, req: KVRequest) -> list[tuple[int, int]]:
        """(group, block id) of every page req holds (null entries excluded)."""
        blocks = self.coordinator.request_blocks(req.request_id)
        if blocks is None:
            return []
        null = self.pool.null_block
        return [(g, b.block_id) for g, bs in enumerate(blocks) for b in bs if b is not null]

    def hit_positions(self, num_blocks: int) -> list[range]:
        """Per group, the block positions whose pages a prefix hit of exactly num_blocks blocks
        reads (the pages a tier must supply where the device lacks them)."""
        return self.coordinator.hit_positions(num_blocks)

    def claim_pages(self, keep: list[Block], num_new: int) -> list[Block] | None:
        """For a tier load: one reference on each cached block of keep (device pages the load
        completes, so they stay until it ends) and num_new fresh unhashed pages to load into;
        all or nothing (None: the pool has too few free blocks now). Release with
        release_pages."""
        pool = self.pool
        if num_new + count_free(keep) > pool.num_free_blocks:
            return None
        pool.touch(keep)  # first: allocating must not evict them
        return pool.allocate(num_new) if num_new else []

    def cache_loaded_pages(self, req: KVRequest, pages: list[tuple[int, int, Block]]) -> None:
        """Cache pages a tier load filled and checked: (group, block position, block), the
        block holding that group's page of req's block at that position (for a state group:
        the checkpoint after position + 1 blocks). The caller still holds their references."""
        by_group: dict[int, list[tuple[int, Block]]] = {}
        for g, pos, blk in pages:
            by_group.setdefault(g, []).append((pos, blk))
        hashes = req.block_hashes
        for g, items in by_group.items():
            items.sort(key=lambda x: x[0])
            self.coordinator.cache_loaded(g, [b for _, b in items], [p for p, _ in items],
                                          hashes, req.all_token_ids)

    def release_pages(self, blocks: Iterable[Block]) -> None:
        """Drop the references claim_pages or hold_blocks took, in the given order (pass tail
        first: chain heads then live longest)."""
        self.pool.free(blocks)

    def cached_blocks(self, group_id: int, block_hashes: Iterable[bytes]) -> list[Block | None]:
        """Per hash, the block whose row holds the group's page of it on the device (cached
        under that hash), else None. Takes no reference: valid until the next allocation."""
        return list(map(self.pool.cached[group_id].get, block_hashes))

    def hold_blocks(self, blocks: list[Block]) -> None:
        """One more reference on each block (e.g. while a tier copies its row): a free one
        leaves the free queue, so its row is not handed out again and it keeps its hash. Drop
        them with release_pages."""
        self.pool.touch(blocks)

    def hit_boundary(self, request_id: str) -> int | None:
        """The longest boundary (blocks) a later request could hit from what the request
        leaves behind if freed now (its latest state checkpoint with state groups, else its
        cached blocks); None when it holds no blocks."""
        coord = self.coordinator
        if coord.block_ids(request_id) is None:
            return None
        return coord.hit_boundary(request_id)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever hold at once (all but the null block)."""
        return self.pool.num_usable

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
        if self.pins is not None and not self.coordinator._ids:
            for sid in list(self.pins._pins):
                self.pins.release(sid)
        return self.pool.reset_prefix_cache()

    def keep_in_flight_windows(self) -> None:
        """Async scheduling: sliding-window groups keep the blocks the step in flight still
        attends to (kv/managers/sliding_window.py)."""
        for m in self.coordinator.managers:
            if isinstance(m, SlidingWindowManager):
                m.keep_in_flight_window = True

    def end_session(self, session_id: str) -> None:
        """The session ended: drop its hash memo and release its pinned blocks."""
        self.hasher.end_session(session_id)
        if self.pins is not None:
            self.pins.release(session_id)
