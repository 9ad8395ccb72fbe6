"""A data-parallel rank's engine config: what each core of a DP deployment is given."""

from __future__ import annotations

import dataclasses
import os

from loomserve.config import EngineConfig


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of DP rank `rank`'s engine core. KV tiers: each core has its own host tier
    (--host-cache-memory is per core, as --kv-cache-memory) and its own disk tier directory
    (<disk-cache-dir>/dp<rank>: a disk tier indexes and evicts its files alone); a remote pool
    (Mooncake, Redis) is shared by every core, as it is by separate instances."""
    tier = config.tier
    if tier.disk_cache_dir:
        tier = dataclasses.replace(tier, disk_cache_dir=os.path.join(tier.disk_cache_dir,
                                                                     f"dp{rank}"))
    return dataclasses.replace(
        config, tier=tier,
        parallel=dataclasses.replace(config.parallel, data_parallel_rank=rank))
