"""Full attention: every block of the prefix is read; a hit is the longest chain of cached blocks."""

from __future__ import annotations

from loomserve.kv.managers.base import SingleTypeKVManager
from loomserve.kv.pool import Block


class FullAttentionManager(SingleTypeKVManager):
    """Every token keeps its KV: blocks = ceil(tokens / bs); hits match left to right."""

    kind = "full_attention"
    prefix_closed_hits = True

    def find_longest_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[Block]:
        return self.pool.lookup_prefix(self.group_id, block_hashes, max_blocks)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
