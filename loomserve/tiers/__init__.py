"""KV tiers below the device pool: host memory, local disk, a shared pool (Mooncake Store or
Redis), composed top-down by TieredStore with background stores, loads and prefetches.

Backends import lazily: `mooncake` and `redis` are needed only by the tiers that use them
(`pip install 'loomserve[tiers]'`).
"""

from loomserve.tiers.base import (Health, PagesRemoved, PagesStored, Tier, TierEvent,
                                  TierUnavailable)
from loomserve.tiers.disk import DiskTier
from loomserve.tiers.host import HostTier
from loomserve.tiers.keys import KeySpace, fingerprint_for, layout_fingerprint
from loomserve.tiers.prefetch import SessionPrefetcher, ThinkTimePredictor
from loomserve.tiers.stats import TierStats, prometheus_collector
from loomserve.tiers.store import (LoadResult, LookupResult, PrefetchResult, StoreResult,
                                   TieredStore, TierHandle)


def __getattr__(name):
    # The backend tiers import their clients on construction only, but keep even their
    # modules out of `import loomserve.tiers`.
    if name == "MooncakeTier":
        from loomserve.tiers.mooncake_tier import MooncakeTier
        return MooncakeTier
    if name == "RedisTier":
        from loomserve.tiers.redis_tier import RedisTier
        return RedisTier
    raise AttributeError(name)


__all__ = ["DiskTier", "Health", "HostTier", "KeySpace", "LoadResult", "LookupResult",
           "MooncakeTier", "PagesRemoved", "PagesStored", "PrefetchResult", "RedisTier",
           "SessionPrefetcher", "StoreResult", "ThinkTimePredictor", "Tier", "TierEvent",
           "TierHandle", "TierStats", "TierUnavailable", "TieredStore", "fingerprint_for",
           "layout_fingerprint", "prometheus_collector"]
