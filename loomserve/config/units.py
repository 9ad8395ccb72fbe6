"""Sizes as users write them ("2GiB", "500MB", "0.3") parsed once into typed values."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


@dataclass(frozen=True)
class MemoryBudget:
    """A number of bytes, or a fraction (0, 1] of some memory the user of it names."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, total: int) -> int:
        """Bytes, with a fraction taken of `total`."""
        return self.bytes if self.bytes is not None else int(total * self.fraction)

    def __str__(self) -> str:
        return f"{self.bytes} bytes" if self.bytes is not None else f"{self.fraction:g} of memory"


def parse_memory(value: str | int | float | MemoryBudget, name: str = "size") -> MemoryBudget:
    """'0.5' -> a fraction; '2GiB', '2000000' or 2000000 -> bytes. ValueError names `name`."""
    if isinstance(value, MemoryBudget):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name} must be bytes (e.g. 2GiB) or a fraction, got {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if not unit and number <= 1.0:
        if number <= 0:
            raise ValueError(f"{name} fraction must be in (0, 1]")
        return MemoryBudget(fraction=number)
    return MemoryBudget(bytes=int(number * _UNITS[unit]))


def parse_bytes(value: str | int | MemoryBudget, name: str) -> int:
    """A size that must be absolute: bytes, never a fraction (an int is taken as bytes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        return value
    budget = parse_memory(value, name)
    if budget.bytes is None:
        raise ValueError(f"{name} must be a size in bytes, e.g. 8GiB, got {value!r}")
    return budget.bytes
