"""Reconciles the KV groups: one hit length for all of them, one allocation transaction.

Each group serves a prefix hit its own way (full attention the leading cached blocks, sliding
window the window before the boundary, linear/SSM state a checkpoint exactly at it); the
coordinator iterates them to a fixed point, the longest length every group can serve, and
allocates every group's blocks together. The fixed point, the Marconi signal (`attn_blocks`)
and the allocation order: docs/design/kv-cache.md.

Invariants:
- Allocation is all or nothing: every group's hits are claimed and new blocks allocated, or
  none are.
- The per-step bookkeeping before it (window frees, the previous step's checkpoints) runs
  whatever the outcome; pure-attention configs skip it.
"""

from __future__ import annotations

from loomserve.kv.managers import SingleTypeKVManager, manager_for
from loomserve.kv.pool import Block, BlockPool
from loomserve.kv.spec import KVCacheConfig


class StaleHitError(RuntimeError):
    """A hit handle whose blocks were reused between lookup and allocation."""


class KVHit:
    """Opaque handle from get_computed_blocks: per-group hit blocks and the lookup epoch.

    blocks[g] has num_blocks entries; for sliding groups the ones before the window are the
    null block, for state groups only the last (the checkpoint) is a block, the rest None."""

    __slots__ = ("blocks", "num_blocks", "epoch", "attn_blocks")

    def __init__(self, blocks: tuple[list[Block], ...], num_blocks: int, epoch: int,
                 attn_blocks: int = 0) -> None:
        self.blocks = blocks
        self.num_blocks = num_blocks
        self.epoch = epoch
        self.attn_blocks = max(attn_blocks, num_blocks)

    def __len__(self) -> int:
        return self.num_blocks

    def block_ids(self) -> list[list[int]]:
        return [[b.block_id if b is not None else -1 for b in g] for g in self.blocks]


class KVCacheCoordinator:
    def __init__(self, config: KVCacheConfig, pool: BlockPool, retention=None,
                 flop_model=None) -> None:
        self.config = config
        self.pool = pool
        self.block_size = config.block_size
        for g in config.groups:
            if g.spec.block_size != self.block_size:
                raise ValueError("all KV groups must share one block size")
        self.managers: list[SingleTypeKVManager] = [
            manager_for(g.spec, i, pool) for i, g in enumerate(config.groups)]
        self.token_managers = [m for m in self.managers if m.token_blocks]
        self.window_managers = [m for m in self.managers if m.stepped and m.token_blocks]
        self.state_managers = [m for m in self.managers if not m.token_blocks]
        self.stepped = bool(self.window_managers or self.state_managers)
        for m in self.state_managers:
            if retention is not None:
                m.retention = retention
        if flop_model is not None:
            for m in self.managers:
                m.flop_model = flop_model
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
        attn = -1
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
                if attn < 0 and mgr.prefix_closed_hits:
                    attn = len(hit)  # first answer: asked for the full cap
                hits[g] = hit
                length = len(hit)  # never more than the length asked for
                agreed[g] = length
            if length == 0 or all(a == length for a in agreed):
                break
        for hit in hits:
            del hit[length:]
        return KVHit(tuple(hits), length, self.pool.eviction_epoch, attn)

    def _validate(self, hit: KVHit, num_hit_blocks: int, block_hashes: list[bytes]) -> None:
        """A cached block can only lose its hash by eviction or a reset, both of which bump the
        pool's epoch; with an unchanged epoch the hit is still exact."""
        if hit.epoch == self.pool.eviction_epoch:
            return
        for mgr, blocks in zip(self.managers, hit.blocks):
            if not mgr.validate_hit(blocks[:num_hit_blocks], block_hashes):
                raise StaleHitError("prefix hit blocks were reused before allocate_slots; "
                                    "call get_computed_blocks again")

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int, hit: KVHit | None,
                 num_hit_blocks: int, block_hashes: list[bytes], num_computed: int = 0,
                 num_prompt_tokens: int = 0, num_draft: int = 0) -> bool:
        """Cover num_tokens positions for the request. num_computed: tokens computed before
        this call (the hit excluded); needed only by stepped (sliding/state) groups.
        num_draft: the last positions are that many drafts (state groups keep their states)."""
        managers = self.managers
        if hit is not None and num_hit_blocks > 0:
            if num_hit_blocks > hit.num_blocks:
                raise ValueError("num_hit_tokens exceeds the hit")
            if request_id in self._ids:
                raise ValueError(f"prefix hit for request {request_id} that already holds blocks")
            self._validate(hit, num_hit_blocks, block_hashes)
            hit_blocks = [blocks[:num_hit_blocks] for blocks in hit.blocks]
        else:
            hit_blocks = None
        if self.stepped:
            for mgr in self.window_managers:
                mgr.begin_step(request_id, num_computed)
            if self.state_managers:
                start = num_computed + num_hit_blocks * self.block_size if hit_blocks else \
                    num_computed
                marconi = 0
                if hit is not None and request_id not in self._ids and \
                        hit.attn_blocks > num_hit_blocks:
                    marconi = hit.attn_blocks
                for mgr in self.state_managers:
                    mgr.begin_step(request_id, block_hashes)
                    mgr.prepare(request_id, start, num_tokens, num_prompt_tokens, block_hashes,
                                marconi, num_draft)
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
                return self._refuse(request_id)
        else:
            return self._refuse(request_id)
        if hit_blocks is not None:
            for g, mgr in enumerate(managers):
                mgr.claim_hit(request_id, hit_blocks[g])
        for mgr in managers:
            mgr.allocate_new(request_id, num_tokens)
        if request_id not in self._ids:
            self._ids[request_id] = [mgr.req_block_ids[request_id] for mgr in managers]
        return True

    def _refuse(self, request_id: str) -> bool:
        for mgr in self.state_managers:
            mgr.abort_prepare(request_id)
        return False

    def cache_full_blocks(self, request_id: str, num_full_blocks: int,
                          block_hashes: list[bytes], token_ids: list[int]) -> None:
        for mgr in self.token_managers:
            mgr.cache_full_blocks(request_id, num_full_blocks, block_hashes, token_ids)

    def num_cached_blocks(self, request_id: str) -> int:
        return min(mgr.num_cached.get(request_id, 0) for mgr in self.token_managers)

    # -- release --------------------------------------------------------------------------
    def finish(self, request_id: str, block_hashes: list[bytes], num_computed: int = 0) -> None:
        """Before free: the request's last step has run (num_computed tokens of it accepted);
        state groups hash what it saved."""
        for mgr in self.state_managers:
            mgr.finish(request_id, block_hashes, num_computed)

    def hit_boundary(self, request_id: str) -> int:
        """The longest boundary (blocks) a later request could hit from what this request
        leaves behind: its latest checkpoint with state groups, else its cached blocks."""
        if self.state_managers:
            return min(m.end_position(request_id) for m in self.state_managers)
        return self.num_cached_blocks(request_id)

    def blocks_for_hit_at(self, block_hashes: list[bytes], num_blocks: int) -> list[Block] | None:
        out: list[Block] = []
        for mgr in self.managers:
            blocks = mgr.blocks_for_hit_at(block_hashes, num_blocks)
            if blocks is None:
                return None
            out.extend(blocks)
        return out

    # -- pages loaded from a tier ---------------------------------------------------------
    def hit_positions(self, num_blocks: int) -> list[range]:
        """Per group, the block positions whose pages a hit of exactly num_blocks reads: all
        of them (full attention), the last window (sliding), the boundary (state)."""
        return [mgr.hit_positions(num_blocks) for mgr in self.managers]

    def cache_loaded(self, group_id: int, blocks: list[Block], positions: list[int],
                     block_hashes: list[bytes], token_ids: list[int]) -> None:
        """Make pages filled by a tier load hittable under their hashes (see the managers)."""
        self.managers[group_id].cache_loaded(blocks, positions, block_hashes, token_ids)

    def free(self, request_id: str) -> None:
        self._ids.pop(request_id, None)
        for mgr in self.managers:
            mgr.free(request_id)

    def block_ids(self, request_id: str) -> list[list[int]] | None:
        return self._ids.get(request_id)

    def request_blocks(self, request_id: str) -> list[list[Block]] | None:
        if request_id not in self._ids:
            return None
        out = []
        for mgr in self.managers:
            if mgr.token_blocks:
                out.append(mgr.req_blocks[request_id])
            else:
                out.append(mgr.held_blocks(request_id))
        return out
