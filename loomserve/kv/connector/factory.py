"""What the engine needs to set tiers up: whether a model can be tiered, the store the tier
config asks for, and the content identity of the weights that goes into every page key.

Invariants:
- Every group kind of a tiered model has a manager that says which pages a hit reads
  (hit_positions) and how loaded pages become hittable (cache_loaded): TIERED_KINDS.
- Pages of different weights never hit each other, even in a shared pool (model_identity).
"""

from __future__ import annotations

import glob
import os

import xxhash

from loomserve.config import TierConfig
from loomserve.kv.spec import KVCacheConfig

# Layer kinds whose managers say which pages a hit reads (hit_positions) and how loaded pages
# become hittable (cache_loaded). A new kind is tiered once its manager does both.
TIERED_KINDS = frozenset({"full_attention", "sliding_window", "linear_state"})


def tiers_supported(kv_config: KVCacheConfig) -> bool:
    """Whether every group's layer kind can be tiered."""
    return all(g.spec.kind in TIERED_KINDS for g in kv_config.groups)


def build_tiered_store(config: TierConfig, page_bytes: int):
    """A TieredStore from the tier config (host -> disk -> remote), or None."""
    from loomserve.kv.tiers import DiskTier, HostTier, TieredStore
    tiers = []
    if config.host_cache_memory:
        tiers.append(HostTier(config.host_cache_memory, page_bytes))
    if config.disk_cache_dir:
        tiers.append(DiskTier(config.disk_cache_dir, config.disk_cache_size, page_bytes))
    if config.remote_scheme == "mooncake":
        from loomserve.kv.tiers.mooncake_tier import MooncakeTier
        tiers.append(MooncakeTier(config.remote_address, page_bytes))
    elif config.remote_scheme == "redis":
        from loomserve.kv.tiers.redis_tier import RedisTier
        tiers.append(RedisTier(page_bytes, url=config.remote_cache))
    if not tiers:
        return None
    return TieredStore(tiers, write_after_seen=config.tier_write_after_seen)


def model_identity(name: str, folder: str | None) -> str:
    """A cheap content identity of the weights for the tier fingerprint: the model name plus,
    per weight file, its name, size and digests of its first and last MiB (a safetensors header
    lists every tensor's offsets, so two checkpoints of one architecture differ there or in the
    data). Pages of different weights must never hit each other, even in a shared pool."""
    h = xxhash.xxh3_128()
    h.update(name.encode())
    files = []
    if folder and os.path.isdir(folder):
        for pat in ("*.safetensors", "*.gguf", "*.bin"):
            files += sorted(glob.glob(os.path.join(folder, pat)))
    elif folder and os.path.isfile(folder):
        files = [folder]
    for f in files:
        size = os.path.getsize(f)
        h.update(f"{os.path.basename(f)}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
    return f"{name}@{h.hexdigest()}"
