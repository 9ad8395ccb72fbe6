"""The device KV cache: block size, pool size, prefix caching, retention, eviction, pinning."""

from __future__ import annotations

from dataclasses import dataclass

from loomserve.config.units import MemoryBudget, parse_bytes, parse_memory

RETENTION_POLICIES = ("interval", "marconi")
EVICTION_POLICIES = ("lru", "flop_aware")
# Without a flag the CPU gets a fixed KV budget (a fraction of RAM would be greedy on a shared
# host); a GPU gets a fraction of the memory left after the weights, as vLLM does.
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_KV_FRACTION = 0.85
DEFAULT_HYBRID_MAX_BLOCK = 512  # max_hybrid_block_size when block_size is left at 16
# The dtype K/V rows are stored in. auto: the model's dtype. A narrower one than the model's
# (bfloat16 KV beside float32 weights on CPU) halves the KV bytes each decode step reads and
# doubles the tokens a --kv-cache-memory holds; attention still computes in the model's dtype.
# fp8_e4m3 / fp8_e5m2 (8-bit floats, no scale, saturating: attention/kv_dtype.py) quarter the
# bytes of an fp32 KV at a larger rounding error (3 / 2 mantissa bits).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
_KV_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
               "fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


@dataclass
class CacheConfig:
    """`kv_cache_memory` and `session_pin_budget` are parsed at construction (strings such as
    "2GiB" or "0.3" are accepted); `retention` becomes a tuple of policy names."""

    block_size: int = 16
    # Hybrid models (attention + linear-state layers): the largest block size the engine may
    # raise block_size to (a multiple of it) so that one attention page and one state page hold
    # about the same bytes (kv/planning.py size_pages); 0 keeps block_size, every page then
    # padded to a whole state (Qwen3-Next-80B: 0.5% of an attention page in use). None: 512
    # when block_size is left at 16, else 0 (a block size asked for is kept).
    max_hybrid_block_size: int | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_memory: MemoryBudget | None = None  # None: the device's default (see above)
    enable_prefix_caching: bool = True
    # Hybrid models (linear/SSM-state layers): which state checkpoints to keep besides the one
    # at each sequence's end. "interval" = at the end of every turn's prompt (+ every N tokens
    # with checkpoint_every); "marconi" = where a prefix is reused without a checkpoint.
    retention: tuple[str, ...] = RETENTION_POLICIES
    checkpoint_every: int = 0
    max_checkpoints_per_path: int = 4
    eviction: str = "lru"  # or "flop_aware": recency + FLOPs saved per byte held
    # Session pinning through tool pauses: off unless both are set.
    session_pin_ttl: float = 0.0  # seconds
    session_pin_budget: int = 0  # bytes

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_hybrid_block_size is not None and self.max_hybrid_block_size < 0:
            raise ValueError("max-hybrid-block-size must be >= 0")
        self.kv_cache_dtype = _KV_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} (or fp32, "
                             f"bf16, fp16, fp8), got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory(self.kv_cache_memory, "kv-cache-memory")
        self.retention = _parse_retention(self.retention)
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be lru or flop_aware, got {self.eviction!r}")
        if self.checkpoint_every < 0 or self.max_checkpoints_per_path < 0:
            raise ValueError("checkpoint-every and max-checkpoints-per-path must be >= 0")
        self.session_pin_budget = (parse_bytes(self.session_pin_budget, "session-pin-budget")
                                   if self.session_pin_budget else 0)
        if self.session_pin_ttl < 0:
            raise ValueError("session-pin-ttl must be >= 0")

    @property
    def hybrid_block_limit(self) -> int:
        """max_hybrid_block_size resolved: as given, else 512 when block_size is 16, else 0."""
        if self.max_hybrid_block_size is not None:
            return self.max_hybrid_block_size
        return DEFAULT_HYBRID_MAX_BLOCK if self.block_size == 16 else 0


def _parse_retention(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    names = value.split(",") if isinstance(value, str) else list(value)
    policies = tuple(p.strip() for p in names if p.strip() and p.strip() != "none")
    unknown = set(policies) - set(RETENTION_POLICIES)
    if unknown:
        raise ValueError(f"retention must list interval and/or marconi (or none), got {value!r}")
    return policies
