"""KV tiers below the device pool: host memory, local disk, a shared pool (Mooncake Store or
Redis), composed top-down by TieredStore with background stores, loads and prefetches.

Backends import lazily: `mooncake` and `redis` are needed only by the tiers that use them
(`pip install 'loomserve[tiers]'`).
"""

from loomserve.kv.tiers.base import (
    Health,
    PagesRemoved,
    PagesStored,
    Tier,
    TierEvent,
    TierUnavailable,
)
from loomserve.kv.tiers.disk import DiskTier
from loomserve.kv.tiers.handles import (
    LoadResult,
    LookupResult,
    PrefetchResult,
    StoreResult,
    TierHandle,
)
from loomserve.kv.tiers.host import HostTier
from loomserve.kv.tiers.keys import KeySpace, fingerprint_for, layout_fingerprint
from loomserve.kv.tiers.prefetch import SessionPrefetcher, ThinkTimePredictor
from loomserve.kv.tiers.stats import TierStats, prometheus_collector
from loomserve.kv.tiers.tiered_store import TieredStore


def __getattr__(name):
    # The backend tiers import their clients on construction only, but keep even their
    # modules out of `import loomserve.kv.tiers`.
    if name == "MooncakeTier":
        from loomserve.kv.tiers.mooncake_tier import MooncakeTier
        return MooncakeTier
    if name == "RedisTier":
        from loomserve.kv.tiers.redis_tier import RedisTier
        return RedisTier
    raise AttributeError(name)


__all__ = ["DiskTier", "Health", "HostTier", "KeySpace", "LoadResult", "LookupResult",
           "MooncakeTier", "PagesRemoved", "PagesStored", "PrefetchResult", "RedisTier",
           "SessionPrefetcher", "StoreResult", "ThinkTimePredictor", "Tier", "TierEvent",
           "TierHandle", "TierStats", "TierUnavailable", "TieredStore", "fingerprint_for",
           "layout_fingerprint", "prometheus_collector"]
