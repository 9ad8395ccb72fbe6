"""Sliding window: only the last window of blocks is read; older blocks return to the pool."""

from __future__ import annotations

from loomserve.kv.managers.base import SingleTypeKVManager, _block_id, count_free
from loomserve.kv.pool import Block, BlockPool


class SlidingWindowManager(SingleTypeKVManager):
    """Attention over the last `sliding_window` positions.

    The block table has an entry per block like full attention, but blocks wholly before the
    window of the next token to compute go back to the pool (they keep their hash, so they stay
    hittable) and their entry becomes the pool's null block. A hit at boundary L blocks needs
    the blocks covering [L*bs - window + 1, L*bs) cached; the ones before are null in the hit.
    Invariants: req_blocks[rid][i] is the null block iff i < removed[rid]; the null block never
    takes a reference; non-null entries hold one reference each.

    Async scheduling (`keep_in_flight_window`): the next step is allocated while the one
    before still runs and reads this list, so a block leaves only once neither needs it: the
    window of the earlier of this call's and the previous call's first token (the step in
    flight's). Else that step could read a null entry for a block its first queries attend to
    (entries are nulled in place) and the freed block could be rewritten by a later step."""

    kind = "sliding_window"
    needs_null_block = True
    stepped = True

    def __init__(self, spec, group_id: int, pool: BlockPool) -> None:
        super().__init__(spec, group_id, pool)
        if pool.null_block is None:
            raise ValueError("sliding window groups need a pool with a null block")
        self.window = spec.sliding_window
        self.null = pool.null_block
        self.removed: dict[str, int] = {}
        self.keep_in_flight_window = False  # async scheduling: KVCacheManager sets it
        self._last_start: dict[str, int] = {}  # request id -> num_computed at its last step

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _first_needed(self, num_tokens: int) -> int:
        """First block the token at position num_tokens attends to."""
        return max(0, num_tokens - self.window + 1) // self.block_size

    def find_longest_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[Block]:
        cached = self.pool.cached[self.group_id]
        n = min(max_blocks, len(block_hashes))
        run = 0
        end = n
        for i in range(n - 1, -1, -1):
            if block_hashes[i] in cached:
                if run == 0:
                    end = i + 1
                run += 1
                first = self._first_needed(end * self.block_size)
                if end - first <= run:
                    get = cached.get
                    return [self.null] * first + [get(h) for h in block_hashes[first:end]]
            else:
                run = 0
        return []

    def validate_hit(self, hit_blocks, block_hashes) -> bool:
        cached = self.pool.cached[self.group_id]
        null = self.null
        return all(b is null or cached.get(h) is b for b, h in zip(hit_blocks, block_hashes))

    def hit_positions(self, num_blocks: int) -> range:
        return range(self._first_needed(num_blocks * self.block_size), num_blocks)

    def blocks_for_hit_at(self, block_hashes, num_blocks):
        get = self.pool.cached[self.group_id].get
        first = self._first_needed(num_blocks * self.block_size)
        out = list(map(get, block_hashes[first:num_blocks]))
        return None if None in out else out

    def num_blocks_to_allocate(self, request_id, num_tokens, hit_blocks, exact=True) -> int:
        have = len(self.req_blocks.get(request_id, ())) + len(hit_blocks)
        new = max(0, self.num_blocks_needed(num_tokens) - have)
        if not hit_blocks:
            return new
        real = [b for b in hit_blocks if b is not self.null]
        return new + (count_free(real) if exact else len(real))

    def claim_hit(self, request_id, hit_blocks) -> None:
        blocks = self.req_blocks.setdefault(request_id, [])
        ids = self.req_block_ids.setdefault(request_id, [])
        if not hit_blocks:
            self.num_cached.setdefault(request_id, 0)
            return
        if blocks:
            raise ValueError(f"prefix hit for request {request_id} that already holds blocks")
        null = self.null
        first = 0
        while first < len(hit_blocks) and hit_blocks[first] is null:
            first += 1
        self.pool.touch(hit_blocks[first:])
        blocks.extend(hit_blocks)
        ids.extend(map(_block_id, hit_blocks))
        self.num_cached[request_id] = len(hit_blocks)
        self.removed[request_id] = first

    def begin_step(self, request_id: str, num_computed: int) -> None:
        """Free the blocks the next token to compute no longer attends to (under async
        scheduling: nor the first token of the step before, which may be in flight)."""
        if self.keep_in_flight_window:
            last = self._last_start.get(request_id, num_computed)
            self._last_start[request_id] = num_computed
            num_computed = min(num_computed, last)
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        lo = self.removed.get(request_id, 0)
        hi = min(self._first_needed(num_computed), len(blocks))
        if hi <= lo:
            return
        ids = self.req_block_ids[request_id]
        null = self.null
        out = blocks[lo:hi]
        blocks[lo:hi] = [null] * (hi - lo)
        ids[lo:hi] = [null.block_id] * (hi - lo)
        self.removed[request_id] = hi
        self.pool.free(reversed(out))

    def cache_full_blocks(self, request_id, num_full_blocks, block_hashes, token_ids) -> None:
        # Null entries only lie below num_cached (a block leaves the window after it was
        # computed, and blocks are cached when scheduled), so the base method never sees one.
        super().cache_full_blocks(request_id, num_full_blocks, block_hashes, token_ids)

    def free(self, request_id: str) -> None:
        self._last_start.pop(request_id, None)
        blocks = self.req_blocks.pop(request_id, None)
        self.req_block_ids.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        lo = self.removed.pop(request_id, 0)
        if blocks:
            self.pool.free(reversed(blocks[lo:]))
