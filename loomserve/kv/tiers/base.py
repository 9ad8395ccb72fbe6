"""The tier interface, tier events and health with exponential backoff.

A tier stores whole pages (one contiguous uint8 row of page_bytes, the packed layout of a pool
block or a state checkpoint: the tier does not look inside) under opaque byte keys. Methods are
synchronous and thread-safe; TieredStore calls them from its worker threads, never from the
engine loop.

Contract of every tier:
- `get_into` writes only rows it reports True, and only with bytes that passed the tier's checks
  (an xxh3 checksum in every tier, host memory included; length and key digest too outside
  process memory): a corrupt or torn record is a miss (and is dropped), never data.
- A backend that is down or failing raises TierUnavailable; a key that is simply absent, a put
  refused for lack of space, and a corrupt record are per-key False, not exceptions.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from loomserve.kv.tiers.stats import TierStats


class TierUnavailable(RuntimeError):
    """The tier's backend is down, unreachable or failing; every key of the call is a miss."""


@dataclass
class PagesStored:
    """Pages became readable from `tier` under `keys`."""

    tier: str
    keys: list[bytes]


@dataclass
class PagesRemoved:
    """Pages left `tier` (evicted, removed, or found corrupt). Remote tiers report only removals
    they make themselves; the shared pool's own eviction is not visible to them."""

    tier: str
    keys: list[bytes]
    reason: str = "evicted"


TierEvent = PagesStored | PagesRemoved


class Health:
    """Healthy until a failure; then usable again only after a backoff that doubles with each
    consecutive failure (capped). When the backoff expires one caller gets to probe (half-open):
    its success makes the tier healthy, its failure doubles the backoff."""

    def __init__(self, base_s: float = 0.5, max_s: float = 30.0, clock=time.monotonic) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.clock = clock
        self._lock = threading.Lock()
        self.healthy = True
        self.failures = 0
        self.retry_at = 0.0
        self.last_error = ""

    def available(self) -> bool:
        if self.healthy:
            return True
        with self._lock:
            now = self.clock()
            if now < self.retry_at:
                return False
            # This caller probes; others wait out one more backoff period meanwhile.
            self.retry_at = now + self.backoff()
            return True

    def backoff(self) -> float:
        return min(self.max_s, self.base_s * (2 ** max(0, self.failures - 1)))

    def ok(self) -> None:
        if not self.healthy or self.failures:
            with self._lock:
                self.healthy = True
                self.failures = 0

    def fail(self, error: str = "") -> None:
        with self._lock:
            self.healthy = False
            self.failures += 1
            self.last_error = error
            self.retry_at = self.clock() + self.backoff()


def rows_list(rows, n: int) -> list[int]:
    return list(range(n)) if rows is None else [int(r) for r in rows]


class Tier(ABC):
    """A store of pages of `page_bytes` under byte keys. See the module docstring."""

    name: str = "tier"
    local = False  # in-process memory: fast, never hangs, called inline by TieredStore
    # contains() answers from an index in process memory (no I/O, never hangs), so a caller
    # may ask it inline, e.g. to skip a background lookup that could only miss.
    index_in_memory = False
    # put() always refuses (e.g. loomserve.kv.transfer.PeerTier): the write path skips it
    readonly = False

    def __init__(self, page_bytes: int, name: str | None = None) -> None:
        if page_bytes <= 0:
            raise ValueError("page_bytes must be positive")
        self.page_bytes = page_bytes
        if name is not None:
            self.name = name
        self.stats = TierStats(self.name)
        self.health = Health()
        self._hooks: list[Callable[[TierEvent], None]] = []

    # -- events ---------------------------------------------------------------------------
    def subscribe(self, fn: Callable[[TierEvent], None]) -> None:
        self._hooks.append(fn)

    def _account_put(self, keys: Sequence[bytes], ok: list[bool], refused: int, faults: int,
                     t0: float) -> list[bytes]:
        """Stats and the PagesStored event of one put; returns the keys stored. refused: pages
        the backend declined (full); faults: pages lost to errors."""
        stored = [k for k, o in zip(keys, ok) if o]
        self.stats.add(stores=len(stored), store_fails=refused + faults, errors=faults,
                       bytes_written=len(stored) * self.page_bytes)
        self.stats.observe("put", time.perf_counter() - t0)
        if stored:
            self._emit(PagesStored(self.name, stored))
        return stored

    def _emit(self, event: TierEvent) -> None:
        for fn in self._hooks:
            fn(event)

    # -- the interface ----------------------------------------------------------------------
    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the tier holds now (a hint: a later get may still miss)."""

    @abstractmethod
    def get_into(self, keys: Sequence[bytes], out: torch.Tensor, rows=None) -> list[bool]:
        """Copy page of keys[i] into out[rows[i]] (out: uint8 [*, page_bytes]); True per key
        loaded."""

    @abstractmethod
    def put(self, keys: Sequence[bytes], src: torch.Tensor, rows=None) -> list[bool]:
        """Store src[rows[i]] under keys[i]; True per key the tier now holds. A key already
        held counts as stored (and is not rewritten: the same key is the same content)."""

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark keys recently used (LRU tiers move them to the back)."""

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> None:
        """Drop keys (evict)."""

    def clear(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _check_page(self, t: torch.Tensor) -> None:
        if t.dtype != torch.uint8 or t.dim() < 2 or page_bytes_of(t) != self.page_bytes:
            raise ValueError(f"{self.name}: pages must be uint8 [n, {self.page_bytes}] (or a "
                             f"layer-major pool's [n, slots, slot_bytes]), got {t.dtype} "
                             f"{tuple(t.shape)}")


def page_bytes_of(pages: torch.Tensor) -> int:
    """Bytes of one page of a page tensor: [n, page_bytes], or a layer-major pool's
    [n, slots, slot_bytes] (execution/kv_pool.py), whose pages are strided."""
    return int(np.prod(pages.shape[1:]))


def copy_page(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """dst.copy_(src) for one page; either may be a layer-major page ([slots, slot_bytes],
    strided), the other then flat and contiguous. Host-to-host copies go through numpy: torch's
    copy_ splits a 1 MB copy across its intra-op threads, which on a busy few-core host (the
    engine loop and tier threads share it) runs 10-20x slower than one plain memcpy."""
    if dst.shape != src.shape:
        if src.is_contiguous():
            src = src.view(dst.shape)
        else:
            dst = dst.view(src.shape)
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src, non_blocking=non_blocking)


def cpu_row(t: torch.Tensor, r: int) -> torch.Tensor:
    """Row r of a page tensor, on the CPU, flat and contiguous (copies only when it must)."""
    row = t[r]
    if row.device.type != "cpu":
        row = row.cpu()
    return (row if row.is_contiguous() else row.contiguous()).view(-1)
