"""Handles and results of TieredStore's background operations.

A TierHandle wraps one background call (a store, lookup, load, prefetch or evict) and is
polled from the engine loop: 'pending', then 'ready' (result() holds one of the results below)
or 'failed'. Tier faults are misses inside the results, so 'failed' means a bug or bad
arguments, never an unavailable tier.

Invariant: a chained prefix is usable only up to its first miss, so every result that reports
per-key tiers also reports `num_prefix`, the count of leading keys found.
"""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable


class TierHandle:
    """A background tier operation: state is 'pending', then 'ready' or 'failed'."""

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    @classmethod
    def completed(cls, result) -> "TierHandle":
        f: Future = Future()
        f.set_result(result)
        return cls(f)

    @property
    def state(self) -> str:
        f = self._future
        if not f.done():
            return "pending"
        if f.cancelled() or f.exception() is not None:
            return "failed"
        return "ready"

    def done(self) -> bool:
        return self._future.done()

    def ready(self) -> bool:
        return self.state == "ready"

    def failed(self) -> bool:
        return self.state == "failed"

    def result(self, timeout: float | None = None):
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None):
        return self._future.exception(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._future.exception(timeout)
        except FutureTimeout:
            return False
        except Exception:
            pass
        return True

    def cancel(self) -> bool:
        return self._future.cancel()

    def add_done_callback(self, fn: Callable[["TierHandle"], None]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        return f"TierHandle({self.state})"


def _prefix_len(flags) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


@dataclass
class LookupResult:
    tiers: list[str | None]  # the highest tier holding each key, None when none does

    @property
    def found(self) -> list[bool]:
        return [t is not None for t in self.tiers]

    @property
    def num_prefix(self) -> int:
        """Leading keys found (a chained prefix is usable only up to its first miss)."""
        return _prefix_len(self.tiers)


@dataclass
class LoadResult:
    tiers: list[str | None]  # where each page came from; None: not loaded (its row is garbage)

    @property
    def loaded(self) -> list[bool]:
        return [t is not None for t in self.tiers]

    @property
    def num_loaded(self) -> int:
        return sum(t is not None for t in self.tiers)

    @property
    def num_prefix(self) -> int:
        return _prefix_len(self.tiers)


@dataclass
class StoreResult:
    queued: int = 0  # keys accepted (snapshotted, on their way down)
    dropped: int = 0  # keys dropped because a queue was full or the store closed


@dataclass
class PrefetchResult:
    promoted: int = 0  # pages brought up into the host tier
    resident: int = 0  # already there
    missing: int = 0  # in no tier
