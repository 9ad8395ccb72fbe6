"""KV tiers below the device pool (loomserve.kv.tiers), all off by default."""

from __future__ import annotations

from dataclasses import dataclass

from loomserve.config.units import parse_bytes

REMOTE_SCHEMES = ("mooncake", "redis")


@dataclass
class TierConfig:
    """Sizes are parsed to bytes at construction ("8GiB" is accepted)."""

    host_cache_memory: int = 0  # bytes of host memory for KV pages; 0 = no host tier
    disk_cache_dir: str | None = None  # local disk tier directory
    disk_cache_size: int = 16 << 30  # bytes the disk tier may use
    remote_cache: str | None = None  # mooncake://HOST:PORT (master) or redis://HOST:PORT[/DB]
    tier_write_after_seen: int = 1  # store a block once computed/hit this many times
    tier_max_inflight: int = 8  # most requests with a tier lookup or load in flight

    def __post_init__(self) -> None:
        self.host_cache_memory = (parse_bytes(self.host_cache_memory, "host-cache-memory")
                                  if self.host_cache_memory else 0)
        self.disk_cache_size = parse_bytes(self.disk_cache_size, "disk-cache-size")
        if self.remote_cache is not None and self.remote_scheme not in REMOTE_SCHEMES:
            raise ValueError("remote-cache must be mooncake://HOST:PORT or redis://HOST:PORT, "
                             f"got {self.remote_cache!r}")
        if self.tier_write_after_seen < 1 or self.tier_max_inflight < 1:
            raise ValueError("tier-write-after-seen and tier-max-inflight must be >= 1")

    @property
    def enabled(self) -> bool:
        return bool(self.host_cache_memory or self.disk_cache_dir or self.remote_cache)

    @property
    def remote_scheme(self) -> str | None:
        if not self.remote_cache:
            return None
        return self.remote_cache.split("://", 1)[0] if "://" in self.remote_cache else ""

    @property
    def remote_address(self) -> str | None:
        """HOST:PORT of a mooncake master (the part after the scheme), None without one."""
        if not self.remote_cache:
            return None
        return self.remote_cache.split("://", 1)[1].rstrip("/")
