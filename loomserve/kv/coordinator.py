"""Reconciles the KV groups: one hit length for all of them, one allocation transaction.

Hit length is a fixed point: start from the cap (prompt length - 1, in whole blocks), let each
group find its longest hit no longer than the current length (each may lower it), and repeat
until a full pass over the groups lowers nothing. Full attention alone converges in one pass;
groups whose hits are not prefix-closed (sliding window, state checkpoints) need the loop.

Allocation is all or nothing: count the free-queue blocks every group needs (new blocks plus
hit blocks that are free, since claiming those takes them out of the free queue), compare with
the free count, then claim every group's hits, then allocate new blocks.
"""

from __future__ import annotations

from loomserve.kv.managers import SingleTypeKVManager, manager_for
from loomserve.kv.pool import Block, BlockPool
from loomserve.kv.spec import KVCacheConfig


class StaleHitError(RuntimeError):
    """A hit handle whose blocks were reused between lookup and allocation."""


class KVHit:
    """Opaque handle from get_computed_blocks: per-group hit blocks and the lookup epoch."""

    __slots__ = ("blocks", "num_blocks", "epoch")

    def __init__(self, blocks: tuple[list[Block], ...], num_blocks: int, epoch: int) -> None:
        self.blocks = blocks
        self.num_blocks = num_blocks
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_blocks

    def block_ids(self) -> list[list[int]]:
        return [[b.block_id for b in g] for g in self.blocks]


class KVCacheCoordinator:
    def __init__(self, config: KVCacheConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.block_size = config.block_size
        for g in config.groups:
            if g.spec.block_size != self.block_size:
                raise ValueError("all KV groups must share one block size")
        self.managers: list[SingleTypeKVManager] = [
            manager_for(g.spec, i, pool) for i, g in enumerate(config.groups)]
        self.empty_hit = KVHit(tuple([] for _ in self.managers), 0, 0)
        # request id -> per-group block id lists (the managers' own list objects).
        self._ids: dict[str, list[list[int]]] = {}

    # -- hits -----------------------------------------------------------------------------
    def find_longest_hit(self, block_hashes: list[bytes], max_blocks: int) -> KVHit:
        managers = self.managers
        length = min(max_blocks, len(block_hashes))
        hits: list[list[Block]] = [[] for _ in managers]
        if length <= 0:
            return KVHit(tuple(hits), 0, self.pool.eviction_epoch)
        # agreed[g]: the length group g's current hit was found for (-1: not asked yet).
        agreed = [-1] * len(managers)
        while True:
            for g, mgr in enumerate(managers):
                if agreed[g] == length:
                    continue
                if agreed[g] > length and mgr.prefix_closed_hits:
                    del hits[g][length:]  # a truncated hit is still a hit for this kind
                    agreed[g] = length
                    continue
                hit = mgr.find_longest_hit(block_hashes, length)
                hits[g] = hit
                length = len(hit)  # never more than the length asked for
                agreed[g] = length
            if length == 0 or all(a == length for a in agreed):
                break
        for hit in hits:
            del hit[length:]
        return KVHit(tuple(hits), length, self.pool.eviction_epoch)

    def _validate(self, hit: KVHit, block_hashes: list[bytes]) -> None:
        """A cached block can only lose its hash by eviction or a reset, both of which bump the
        pool's epoch; with an unchanged epoch the hit is still exact."""
        if hit.epoch == self.pool.eviction_epoch:
            return
        for g, blocks in enumerate(hit.blocks):
            cached = self.pool.cached[g]
            for b, h in zip(blocks, block_hashes):
                if cached.get(h) is not b:
                    raise StaleHitError("prefix hit blocks were reused before allocate_slots; "
                                        "call get_computed_blocks again")

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, hit: KVHit | None,
                 num_hit_blocks: int, block_hashes: list[bytes]) -> bool:
        managers = self.managers
        if hit is not None and num_hit_blocks > 0:
            if num_hit_blocks > hit.num_blocks:
                raise ValueError("num_hit_tokens exceeds the hit")
            if request_id in self._ids:
                raise ValueError(f"prefix hit for request {request_id} that already holds blocks")
            self._validate(hit, block_hashes)
            hit_blocks = [blocks[:num_hit_blocks] for blocks in hit.blocks]
        else:
            hit_blocks = None
        free = self.pool.num_free_blocks
        # Cheap upper bound first (every hit block counted as free); scan hits only if needed.
        for exact in (False, True):
            need = 0
            for g, mgr in enumerate(managers):
                need += mgr.num_blocks_to_allocate(request_id, num_tokens,
                                                   hit_blocks[g] if hit_blocks else [], exact)
            if need <= free:
                break
            if hit_blocks is None:
                return False
        else:
            return False
        if hit_blocks is not None:
            for g, mgr in enumerate(managers):
                mgr.claim_hit(request_id, hit_blocks[g])
        for mgr in managers:
            mgr.allocate_new(request_id, num_tokens)
        if request_id not in self._ids:
            self._ids[request_id] = [mgr.req_block_ids[request_id] for mgr in managers]
        return True

    def cache_full_blocks(self, request_id: str, num_full_blocks: int,
                          block_hashes: list[bytes], token_ids: list[int]) -> None:
        for mgr in self.managers:
            mgr.cache_full_blocks(request_id, num_full_blocks, block_hashes, token_ids)

    def num_cached_blocks(self, request_id: str) -> int:
        return min(mgr.num_cached.get(request_id, 0) for mgr in self.managers)

    def free(self, request_id: str) -> None:
        self._ids.pop(request_id, None)
        for mgr in self.managers:
            mgr.free(request_id)

    def block_ids(self, request_id: str) -> list[list[int]] | None:
        return self._ids.get(request_id)

    def request_blocks(self, request_id: str) -> list[list[Block]] | None:
        if request_id not in self._ids:
            return None
        return [mgr.req_blocks[request_id] for mgr in self.managers]
