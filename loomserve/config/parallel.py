"""How the engine spreads over devices and processes. One device, one rank so far: the fields
exist so that the CLI, the config and the executor seam have their place when workers arrive."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            n = getattr(self, name)
            if n < 1:
                raise ValueError(f"{name} must be >= 1, got {n}")
            if n > 1:
                raise ValueError(f"{name}={n}: only one device per engine is supported so far")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size
