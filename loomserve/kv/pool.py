"""The block pool: uniform blocks, reference counts, one free/evictable queue, the hash map.

Mechanism only: the pool knows nothing of attention types; group ids only tag cached hashes
(one hash -> block dict per group), and which blocks a request needs, hits and frees is
decided by the managers. Free and evictable are one intrusive queue: freed unhashed blocks go
to the front (reused first), hashed ones to the back (LRU), unless an evictor
(loomserve.kv.eviction) ranks the hashed ones. Queue mechanics, eviction and the null block:
docs/design/kv-cache.md.

Invariants:
- A freed block keeps its hash and stays hittable until it is popped for reuse; then its hash
  is dropped (BlockRemoved) and eviction_epoch is bumped.
- The queue is the single source of truth for what is free: an evictor only ranks.
- The null block (reserve_null_block=True: block 0) is never free, hashed or counted.
"""

from __future__ import annotations

from itertools import takewhile
from typing import Iterable, Iterator

from loomserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventHook
from loomserve.kv.miss_causes import RELEASE_RESET


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "prev_free", "next_free",
                 "saved_flops", "evict_ver", "release")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group_id = -1  # group whose hash map holds block_hash; -1 when unhashed
        self.prev_free: Block | None = None
        self.next_free: Block | None = None
        # Set by managers when they cache the block, read by a FLOP-aware evictor only.
        self.saved_flops = 0.0
        self.evict_ver = 0  # bumped each time the block enters the evictor (lazy invalidation)
        # Why a hashed block was last freed when that was not a request ending (a pin dropped,
        # a preemption: kv.miss_causes); None once a request takes it again.
        self.release: str | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


_is_block = bool  # blocks are always truthy, a dict miss (None) is not


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks, LRU order (front = reused first)."""

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self.head = Block(-1)  # sentinels
        self.tail = Block(-2)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> Block:
        b = self.head.next_free
        if b is self.tail:
            raise IndexError("no free block")
        n = b.next_free
        self.head.next_free = n
        n.prev_free = self.head
        b.prev_free = b.next_free = None
        self.num_free -= 1
        return b

    def append(self, b: Block) -> None:
        t = self.tail
        p = t.prev_free
        p.next_free = b
        b.prev_free = p
        b.next_free = t
        t.prev_free = b
        self.num_free += 1

    def appendleft(self, b: Block) -> None:
        h = self.head
        n = h.next_free
        h.next_free = b
        b.prev_free = h
        b.next_free = n
        n.prev_free = b
        self.num_free += 1

    def remove(self, b: Block) -> None:
        p = b.prev_free
        n = b.next_free
        if p is None or n is None:
            raise ValueError(f"{b} is not in the free queue")
        p.next_free = n
        n.prev_free = p
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def __iter__(self) -> Iterator[Block]:
        b = self.head.next_free
        while b is not self.tail:
            yield b
            b = b.next_free


class BlockPool:
    def __init__(self, num_blocks: int, num_groups: int = 1, enable_caching: bool = True,
                 event_hooks: Iterable[EventHook] = (), reserve_null_block: bool = False,
                 evictor=None) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError("pool needs at least one usable block")
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block: Block | None = None
        usable = self.blocks
        if reserve_null_block:
            self.null_block = self.blocks[0]
            usable = self.blocks[1:]
        self.num_usable = len(usable)
        self.free_queue = FreeBlockQueue(usable)
        # One hash -> block map per group: the group-tagged hash map.
        self.cached: list[dict[bytes, Block]] = [{} for _ in range(num_groups)]
        self.hooks: list[EventHook] = list(event_hooks)
        # Bumped whenever a cached hash is dropped, so a hit computed earlier can be trusted
        # without re-checking each block if nothing was dropped since.
        self.eviction_epoch = 0
        # None: LRU by queue order. Otherwise an object with push(block) (a hashed block became
        # free) and pop() (the next hashed free block to evict), see loomserve.kv.eviction.
        self.evictor = evictor
        # kv.miss_causes.DropRecord or None: every hash dropped is noted (why, when).
        self.drops = None

    # -- events ---------------------------------------------------------------------------
    def subscribe(self, fn: EventHook) -> None:
        self.hooks.append(fn)

    def _emit(self, event) -> None:
        for fn in self.hooks:
            fn(event)

    # -- queries --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable - self.free_queue.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable

    def get_cached_block(self, group_id: int, block_hash: bytes) -> Block | None:
        return self.cached[group_id].get(block_hash)

    def lookup_prefix(self, group_id: int, block_hashes: list[bytes], max_blocks: int) -> list[Block]:
        """Cached blocks for the longest run of block_hashes[:max_blocks] from the left."""
        if max_blocks <= 0:
            return []
        return list(takewhile(_is_block, map(self.cached[group_id].get, block_hashes[:max_blocks])))

    # -- reference counting -----------------------------------------------------------------
    def touch(self, blocks: list[Block]) -> None:
        """Take one reference on each block (cache hits); free ones leave the free queue."""
        q = self.free_queue
        removed = 0
        for b in blocks:
            if b.ref_cnt == 0:
                b.release = None
                p = b.prev_free
                n = b.next_free
                p.next_free = n
                n.prev_free = p
                b.prev_free = b.next_free = None
                removed += 1
            b.ref_cnt += 1
        q.num_free -= removed

    def allocate(self, n: int) -> list[Block]:
        """Pop n blocks from the front of the free queue, one reference each. Their old hashes
        are dropped (BlockRemoved). Raises ValueError, changing nothing, if fewer are free."""
        q = self.free_queue
        if n > q.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {q.num_free} free")
        if self.evictor is not None:
            return self._allocate_evicting(n)
        out = []
        append = out.append
        head = q.head
        b = head
        dropped: dict[int, list[bytes]] | None = None
        for _ in range(n):
            b = b.next_free
            b.ref_cnt = 1
            if b.block_hash is not None:
                dropped = self._forget_hash(b, dropped)
            append(b)
        # Unlink the run [first .. b] from the front in one step.
        nxt = b.next_free
        head.next_free = nxt
        nxt.prev_free = head
        for b in out:
            b.prev_free = b.next_free = None
        q.num_free -= n
        if dropped:
            for g, hs in dropped.items():
                self._emit(BlockRemoved(hs, g))
        return out

    def _forget_hash(self, b: Block, dropped: dict[int, list[bytes]] | None
                     ) -> dict[int, list[bytes]] | None:
        """A cached free block is being reused: it leaves the hash map (BlockRemoved is
        collected into `dropped`, emitted once per allocation)."""
        h, g = b.block_hash, b.group_id
        cached = self.cached[g]
        if cached.get(h) is b:
            del cached[h]
        b.block_hash = None
        b.group_id = -1
        self.eviction_epoch += 1
        if self.drops is not None:
            self.drops.note(h, b.release)
            b.release = None
        if self.hooks:
            dropped = dropped if dropped is not None else {}
            dropped.setdefault(g, []).append(h)
        return dropped

    def _allocate_evicting(self, n: int) -> list[Block]:
        """allocate() under an evictor: unhashed free blocks (always at the front) first, then
        the evictor's choice among the hashed ones."""
        q = self.free_queue
        ev = self.evictor
        out = []
        dropped: dict[int, list[bytes]] | None = None
        for _ in range(n):
            b = q.head.next_free
            if b.block_hash is not None:
                b = ev.pop() or b  # the evictor holds every hashed free block
            q.remove(b)
            b.ref_cnt = 1
            if b.block_hash is not None:
                dropped = self._forget_hash(b, dropped)
            out.append(b)
        if dropped:
            for g, hs in dropped.items():
                self._emit(BlockRemoved(hs, g))
        return out

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference per block, in the given order (pass a request's blocks reversed to
        free tail first). Blocks reaching zero join the free queue: hashed at the back,
        unhashed at the front. Freeing a block with no reference raises (double free)."""
        q = self.free_queue
        head = q.head
        tail = q.tail
        push = self.evictor.push if self.evictor is not None else None
        added = 0
        for b in blocks:
            c = b.ref_cnt - 1
            if c > 0:
                b.ref_cnt = c
                continue
            if c < 0:
                q.num_free += added
                raise AssertionError(f"double free of {b}")
            b.ref_cnt = 0
            if b.block_hash is None:
                n = head.next_free
                head.next_free = b
                b.prev_free = head
                b.next_free = n
                n.prev_free = b
            else:
                p = tail.prev_free
                p.next_free = b
                b.prev_free = p
                b.next_free = tail
                tail.prev_free = b
                if push is not None:
                    push(b)
            added += 1
        q.num_free += added

    # -- caching --------------------------------------------------------------------------
    def cache_blocks(self, group_id: int, blocks: list[Block], block_hashes: list[bytes],
                     parent_hash: bytes | None = None, token_ids: list[int] | None = None,
                     block_size: int = 0) -> None:
        """Make blocks hittable under block_hashes (same length, chain order). A hash that
        another block already holds keeps that block; this one stays unhashed (a duplicate,
        reused first once freed). token_ids/block_size only feed the BlockStored event."""
        if not self.enable_caching:
            return
        cached = self.cached[group_id]
        setdefault = cached.setdefault
        stored_all = True
        for b, h in zip(blocks, block_hashes):
            if b.block_hash is not None:
                raise AssertionError(f"{b} is already cached")
            if setdefault(h, b) is b:
                b.block_hash = h
                b.group_id = group_id
            else:
                stored_all = False
        if self.hooks and blocks:
            if stored_all:
                self._emit(BlockStored(list(block_hashes), parent_hash,
                                       list(token_ids) if token_ids is not None else [],
                                       block_size, group_id))
            else:
                # Report only the runs actually stored, each with its own parent.
                self._emit_stored_runs(group_id, blocks, block_hashes, parent_hash, token_ids,
                                       block_size)

    def _emit_stored_runs(self, group_id, blocks, block_hashes, parent_hash, token_ids,
                          block_size) -> None:
        run: list[int] = []
        run_parent = parent_hash
        prev = parent_hash
        for i, (b, h) in enumerate(zip(blocks, block_hashes)):
            if b.block_hash is h:
                if not run:
                    run_parent = prev
                run.append(i)
            elif run:
                self._emit_run(group_id, run, block_hashes, run_parent, token_ids, block_size)
                run = []
            prev = h
        if run:
            self._emit_run(group_id, run, block_hashes, run_parent, token_ids, block_size)

    def _emit_run(self, group_id, run, block_hashes, parent, token_ids, block_size) -> None:
        lo, hi = run[0], run[-1] + 1
        toks = list(token_ids[lo * block_size:hi * block_size]) if token_ids is not None else []
        self._emit(BlockStored(block_hashes[lo:hi], parent, toks, block_size, group_id))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only allowed when no block is in use. Each is noted as
        dropped by a reset (kv.miss_causes: a later miss on it is `evicted`)."""
        if self.num_used_blocks:
            return False
        drops = self.drops
        for cached in self.cached:
            for h, b in cached.items():
                if drops is not None:
                    drops.note(h, RELEASE_RESET)
                b.release = None
                b.block_hash = None
                b.group_id = -1
            cached.clear()
        self.eviction_epoch += 1
        if self.evictor is not None:
            self.evictor.clear()
        if self.hooks:
            self._emit(AllBlocksCleared())
        return True
