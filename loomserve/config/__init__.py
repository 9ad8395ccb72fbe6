"""Engine configuration: model, cache, scheduler, tier, parallel and control parts.

Users (the CLI, `LLM(**kwargs)`, tests) speak flat option names, the same as the command-line
flags; `EngineConfig.from_kwargs` routes each name to the part that owns it, and each part
parses its sizes and policy strings once, at construction, into typed values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from loomserve.config.cache import (
    DEFAULT_CPU_KV_BYTES,
    DEFAULT_GPU_KV_FRACTION,
    EVICTION_POLICIES,
    KV_CACHE_DTYPES,
    CacheConfig,
)
from loomserve.config.control import ROLES, ControlConfig
from loomserve.config.model import ATTENTION_BACKENDS, DTYPES, QUANTIZATIONS, ModelConfig
from loomserve.config.parallel import ParallelConfig
from loomserve.config.scheduler import SchedulerConfig
from loomserve.config.speculative import SpeculativeConfig, SpeculativeOptions
from loomserve.config.tier import TierConfig
from loomserve.config.units import MemoryBudget, parse_bytes, parse_memory

PARTS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
         "tier": TierConfig, "parallel": ParallelConfig, "control": ControlConfig,
         "speculative": SpeculativeOptions}


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tier: TierConfig = field(default_factory=TierConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Flat option names (as the CLI flags: block_size, host_cache_memory, ...) -> parts.
        An unknown name is a TypeError, as for any bad keyword argument."""
        owner = flat_fields()
        per_part: dict[str, dict[str, Any]] = {name: {} for name in PARTS}
        for key, value in kwargs.items():
            if key not in owner:
                raise TypeError(f"unknown engine option {key!r}")
            per_part[owner[key]][key] = value
        return cls(**{name: part(**per_part[name]) for name, part in PARTS.items()})

    def replace(self, **kwargs: Any) -> "EngineConfig":
        """A copy with some flat options changed."""
        owner = flat_fields()
        parts = {name: getattr(self, name) for name in PARTS}
        for key, value in kwargs.items():
            if key not in owner:
                raise TypeError(f"unknown engine option {key!r}")
            parts[owner[key]] = dataclasses.replace(parts[owner[key]], **{key: value})
        return EngineConfig(**parts)


def flat_fields() -> dict[str, str]:
    """Flat option name -> the part that owns it."""
    return {f.name: part for part, cls in PARTS.items() for f in dataclasses.fields(cls)}


def flat_defaults() -> dict[str, Any]:
    """Flat option name -> its default (what the CLI shows)."""
    out = {}
    for cls in PARTS.values():
        for f in dataclasses.fields(cls):
            out[f.name] = f.default if f.default_factory is dataclasses.MISSING \
                else f.default_factory()
    return out


__all__ = ["ATTENTION_BACKENDS", "QUANTIZATIONS", "DEFAULT_CPU_KV_BYTES", "DEFAULT_GPU_KV_FRACTION",
           "DTYPES", "EVICTION_POLICIES", "KV_CACHE_DTYPES", "CacheConfig", "ControlConfig",
           "EngineConfig", "MemoryBudget", "ModelConfig", "ParallelConfig", "ROLES",
           "SchedulerConfig", "SpeculativeConfig", "TierConfig", "flat_defaults", "flat_fields",
           "parse_bytes",
           "parse_memory"]
