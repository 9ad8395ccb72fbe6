"""Engine configuration: one dataclass, shared by the CLI, the Python API and the server."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Without a flag the CPU gets a fixed KV budget (a fraction of RAM would be greedy on a shared
# host); a GPU gets a fraction of the memory left after the weights, as vLLM does.
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_KV_FRACTION = 0.85


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None = built-in SmolLM2-135M-Instruct
    served_model_name: str | None = None
    dtype: str = "float32"
    device: str = "auto"  # "auto" picks cuda when present
    seed: int = 0
    max_model_len: int | None = None  # None = the model's own limit
    block_size: int = 16
    kv_cache_memory: str | None = None  # bytes ("2GiB", "500000000") or a fraction ("0.5")
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_threshold: int = 512  # per-request prefill cap per step; 0 disables it
    cache_dir: str | None = None  # converted-weight cache; default ~/.cache/loomserve
    # Hybrid models (linear/SSM-state layers): which state checkpoints to keep besides the one
    # at each sequence's end. "interval" = at the end of every turn's prompt (+ every N tokens
    # with checkpoint_every); "marconi" = where a prefix is reused without a checkpoint.
    retention: str = "interval,marconi"
    checkpoint_every: int = 0
    max_checkpoints_per_path: int = 4
    eviction: str = "lru"  # or "flop_aware": recency + FLOPs saved per byte held
    # Session pinning through tool pauses: off unless both are set.
    session_pin_ttl: float = 0.0  # seconds
    session_pin_budget: str | None = None  # bytes, e.g. 512MiB
    # KV tiers below the device pool (loomserve.kv.tiers), all off by default.
    host_cache_memory: str | None = None  # bytes of host memory for KV pages, e.g. 8GiB
    disk_cache_dir: str | None = None  # local disk tier directory
    disk_cache_size: str = "16GiB"  # bytes the disk tier may use
    remote_cache: str | None = None  # mooncake://HOST:PORT (master) or redis://HOST:PORT[/DB]
    tier_write_after_seen: int = 1  # store a block once computed/hit this many times
    tier_max_inflight: int = 8  # most requests with a tier lookup or load in flight

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.long_prefill_threshold < 0:
            raise ValueError("long_prefill_threshold must be >= 0")
        if self.kv_cache_memory is not None:
            parse_memory(str(self.kv_cache_memory))  # fail early on a bad value
        unknown = set(self.retention_policies) - {"interval", "marconi"}
        if unknown:
            raise ValueError(f"retention must list interval and/or marconi, got {self.retention!r}")
        if self.eviction not in ("lru", "flop_aware"):
            raise ValueError(f"eviction must be lru or flop_aware, got {self.eviction!r}")
        if self.session_pin_budget is not None and \
                parse_memory(str(self.session_pin_budget))[0] != "bytes":
            raise ValueError("session-pin-budget must be a size in bytes, e.g. 512MiB")
        for name in ("host_cache_memory", "disk_cache_size"):
            v = getattr(self, name)
            if v is not None and parse_memory(str(v))[0] != "bytes":
                raise ValueError(f"{name.replace('_', '-')} must be a size in bytes, e.g. 8GiB")
        if self.remote_cache is not None and \
                not self.remote_cache.startswith(("mooncake://", "redis://")):
            raise ValueError("remote-cache must be mooncake://HOST:PORT or redis://HOST:PORT, "
                             f"got {self.remote_cache!r}")
        if self.tier_write_after_seen < 1 or self.tier_max_inflight < 1:
            raise ValueError("tier-write-after-seen and tier-max-inflight must be >= 1")

    @property
    def tiers_enabled(self) -> bool:
        return bool(self.host_cache_memory or self.disk_cache_dir or self.remote_cache)

    @property
    def retention_policies(self) -> list[str]:
        return [p.strip() for p in self.retention.split(",") if p.strip() and p.strip() != "none"]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def resolved_cache_dir(self) -> str:
        return self.cache_dir or os.environ.get(
            "LOOMSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "loomserve"))


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_memory(value: str) -> tuple[str, float]:
    """'0.5' -> ('fraction', 0.5); '2GiB' or '2000000' -> ('bytes', n)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv-cache-memory must be bytes (e.g. 2GiB) or a fraction, got {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if not unit and number <= 1.0:
        if number <= 0:
            raise ValueError("kv-cache-memory fraction must be in (0, 1]")
        return "fraction", number
    return "bytes", number * _UNITS[unit]
