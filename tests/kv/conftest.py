from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup


@dataclass
class Req:
    """Satisfies loomserve.kv.cache_manager.KVRequest."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int = -1
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    session_id: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.all_token_ids)


def make_config(num_blocks: int, block_size: int = 4, num_groups: int = 1) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_dim=8, dtype=torch.float16)
    groups = tuple(KVCacheGroup(spec, (g,)) for g in range(num_groups))
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


@pytest.fixture
def config():
    return make_config(16)


def make_hybrid_config(num_blocks: int, block_size: int = 4, window: int = 0,
                       state: bool = True, full: bool = True) -> KVCacheConfig:
    """Full attention + (sliding window if window) + (linear state if state) in one pool."""
    from loomserve.kv.spec import LinearStateSpec, SlidingWindowSpec
    groups = []
    if full:
        groups.append(KVCacheGroup(FullAttentionSpec(block_size=block_size, num_kv_heads=1,
                                                     head_dim=8, dtype=torch.float16), (0,)))
    if window:
        groups.append(KVCacheGroup(SlidingWindowSpec(block_size=block_size, num_kv_heads=1,
                                                     head_dim=8, dtype=torch.float16,
                                                     sliding_window=window), (1,)))
    if state:
        groups.append(KVCacheGroup(LinearStateSpec(block_size=block_size,
                                                   state_shapes=((2, 4), (4, 4))), (2, 3)))
    return KVCacheConfig(num_blocks=num_blocks, groups=tuple(groups))
