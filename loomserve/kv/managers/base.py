"""SingleTypeKVManager: the policy of one KV group over the shared pool (the base class).

A manager owns, for one group, each request's block list; it decides how many blocks a request
needs for a number of tokens, which cached blocks can serve a prefix hit, which blocks can be
freed early and which get cached. Subclasses per layer kind live beside this module and are
registered by kind in loomserve.kv.managers.
"""

from __future__ import annotations

from operator import attrgetter

from loomserve.kv.pool import Block, BlockPool
from loomserve.kv.spec import KVCacheSpec

_ref_cnt = attrgetter("ref_cnt")
_block_id = attrgetter("block_id")


def count_free(blocks: list[Block]) -> int:
    """How many of blocks are unreferenced (in the free queue); the loop runs in C."""
    return list(map(_ref_cnt, blocks)).count(0)


class SingleTypeKVManager:
    """Blocks of one KV group, per request.

    Invariants (checked by the tests):
    - req_blocks[rid][i] holds the KV of token positions [i*bs, (i+1)*bs) of request rid for
      this group; req_block_ids[rid] is the list of their ids, same length, same order. Both
      lists only grow until free(rid), and are the same objects for the request's lifetime.
    - Every block in req_blocks[rid] holds exactly one reference for rid.
    - num_cached[rid] = n means req_blocks[rid][:n] are cached under (or hold tokens identical
      to the cached blocks of) req.block_hashes[:n], and no later block is cached by rid.
    - free(rid) releases blocks tail first, so shared heads of prefixes are evicted last.
    - A hit returned by find_longest_hit is a prefix of the request's blocks-to-be: hit[i]
      holds the tokens of block i.
    """

    kind: str = ""
    # True when any prefix of a hit is itself a hit (full attention), so the coordinator may
    # truncate instead of asking again when another group lowers the hit length.
    prefix_closed_hits: bool = False
    # True when the group's blocks grow with tokens (attention); False for a fixed-size state.
    token_blocks: bool = True
    # True when the manager needs begin_step()/prepare() around each allocation (per-step
    # bookkeeping); the coordinator skips those calls entirely for the others.
    stepped: bool = False
    # Sliding window and state groups need the pool's null block.
    needs_null_block: bool = False

    def __init__(self, spec: KVCacheSpec, group_id: int, pool: BlockPool) -> None:
        self.spec = spec
        self.group_id = group_id
        self.pool = pool
        self.block_size = spec.block_size
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_block_ids: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}
        self.flop_model = None  # set when the pool evicts by FLOPs saved

    def validate_hit(self, hit_blocks: list[Block], block_hashes: list[bytes]) -> bool:
        """Whether the hit's blocks still hold their hashes (called only after an eviction)."""
        cached = self.pool.cached[self.group_id]
        return all(cached.get(h) is b for b, h in zip(hit_blocks, block_hashes))

    def blocks_for_hit_at(self, block_hashes: list[bytes], num_blocks: int) -> list[Block] | None:
        """The cached blocks a hit of exactly num_blocks blocks needs from this group, or None
        if one is missing (used for pinning and for pages_for_hashes)."""
        get = self.pool.cached[self.group_id].get
        out = list(map(get, block_hashes[:num_blocks]))
        return None if None in out else out

    def hit_positions(self, num_blocks: int) -> range:
        """Block positions whose pages of this group a hit of exactly num_blocks blocks reads
        (what a tier must supply where the device lacks them). Full attention: all of them.
        For num_blocks > 0 the range ends at num_blocks, and its start never decreases as
        num_blocks grows (TierConnector relies on both)."""
        return range(num_blocks)

    # -- hits -----------------------------------------------------------------------------
    def find_longest_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[Block]:
        """Cached blocks serving the longest hit of at most max_blocks blocks."""
        raise NotImplementedError

    # -- allocation -----------------------------------------------------------------------
    def num_blocks_needed(self, num_tokens: int) -> int:
        raise NotImplementedError

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               hit_blocks: list[Block], exact: bool = True) -> int:
        """Free-queue blocks this group consumes to cover num_tokens positions after claiming
        hit_blocks: new blocks plus hit blocks that are free (cached but unreferenced).
        With exact=False, an upper bound that counts every hit block as free (no scan)."""
        have = len(self.req_blocks.get(request_id, ())) + len(hit_blocks)
        new = max(0, self.num_blocks_needed(num_tokens) - have)
        if not hit_blocks:
            return new
        return new + (count_free(hit_blocks) if exact else len(hit_blocks))

    def claim_hit(self, request_id: str, hit_blocks: list[Block]) -> None:
        """Append hit blocks (one reference each) to the request's list; they are cached."""
        blocks = self.req_blocks.setdefault(request_id, [])
        ids = self.req_block_ids.setdefault(request_id, [])
        if not hit_blocks:
            self.num_cached.setdefault(request_id, 0)
            return
        if blocks:
            raise ValueError(f"prefix hit for request {request_id} that already holds blocks")
        self.pool.touch(hit_blocks)
        blocks.extend(hit_blocks)
        ids.extend(map(_block_id, hit_blocks))
        self.num_cached[request_id] = len(hit_blocks)

    def allocate_new(self, request_id: str, num_tokens: int) -> None:
        blocks = self.req_blocks.setdefault(request_id, [])
        ids = self.req_block_ids.setdefault(request_id, [])
        self.num_cached.setdefault(request_id, 0)
        n = self.num_blocks_needed(num_tokens) - len(blocks)
        if n > 0:
            new = self.pool.allocate(n)
            blocks.extend(new)
            ids.extend(map(_block_id, new))

    # -- caching --------------------------------------------------------------------------
    def cache_full_blocks(self, request_id: str, num_full_blocks: int,
                          block_hashes: list[bytes], token_ids: list[int]) -> None:
        """Cache the request's blocks [num_cached, num_full_blocks) under their hashes."""
        start = self.num_cached.get(request_id, 0)
        blocks = self.req_blocks.get(request_id)
        if blocks is None:
            return
        end = min(num_full_blocks, len(blocks))
        if end <= start:
            return
        bs = self.block_size
        pool = self.pool
        self.num_cached[request_id] = end
        if self.flop_model is not None:
            fm = self.flop_model
            for i in range(start, end):
                blocks[i].saved_flops = fm.kv_block_flops(i, bs)
        if not pool.hooks:
            pool.cache_blocks(self.group_id, blocks[start:end], block_hashes[start:end])
        else:
            pool.cache_blocks(self.group_id, blocks[start:end], block_hashes[start:end],
                              block_hashes[start - 1] if start else None,
                              token_ids[start * bs:end * bs], bs)

    def cache_loaded(self, blocks: list[Block], positions: list[int], block_hashes: list[bytes],
                     token_ids: list[int]) -> None:
        """Cache pages filled outside a step (a tier load): blocks[j] holds this group's page of
        block position positions[j] (ascending) of the chain block_hashes. The blocks belong to
        no request; the caller keeps its references. A hash another block holds already keeps
        that block (this one stays unhashed)."""
        bs = self.block_size
        pool = self.pool
        j = 0
        while j < len(blocks):  # one cache_blocks call (one BlockStored) per run of positions
            k = j + 1
            while k < len(blocks) and positions[k] == positions[k - 1] + 1:
                k += 1
            lo, hi = positions[j], positions[k - 1] + 1
            run = blocks[j:k]
            if self.flop_model is not None:
                for i, b in zip(range(lo, hi), run):
                    b.saved_flops = self.flop_model.kv_block_flops(i, bs)
            pool.cache_blocks(self.group_id, run, block_hashes[lo:hi],
                              block_hashes[lo - 1] if lo else None, token_ids[lo * bs:hi * bs], bs)
            j = k

    # -- release --------------------------------------------------------------------------
    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        self.req_block_ids.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int] | None:
        return self.req_block_ids.get(request_id)
