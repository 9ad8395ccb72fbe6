"""Which instance holds which KV block: an index built from the instances' KV events.

The router asks one question of it per request: for the request's block-hash chain, how many
leading blocks does each instance hold? (Its longest cached prefix, in blocks.) One walk over
the chain answers it for every instance at once, because a chain's blocks are only hittable as
a prefix: the walk stops when no instance holds the next block.

Groups: a hybrid model publishes one event per KV group (group_idx); the index follows group
0 (the full-attention group whose chain decides a prefix hit), others are ignored.

Media: only the engine's own pool (medium "GPU", or no medium) counts as cached. Copies in the
host/disk tiers still save a recompute but cost a load; they are counted in stats() only, so a
router never prefers an instance for a prefix it would have to page back in.

Eviction pressure: each instance's BlockRemoved blocks (device medium), exponentially weighted
with a PRESSURE_HALF_LIFE_S half-life: how fast its pool is turning over now. The default
policy sends a session whose context its home lost to the instance where this is lowest.

Invariants:
- `_where[h]` is the set of instances holding block h; `_held[i]` the set of blocks instance i
  holds; each mirrors the other exactly (every write updates both under `_lock`).
- A cleared instance (AllBlocksCleared, a subscriber reset, the instance going down) holds
  nothing until its next BlockStored.
Thread-safety: subscriber threads write, the event loop reads; one lock guards both maps. A
query holds it for one walk over a chain (microseconds), so readers never wait on a batch for
long either.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence

from loomserve.kv.event_wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

_COUNTED_MEDIA = (MEDIUM_GPU, None)
PRESSURE_HALF_LIFE_S = 30.0


class KVIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._where: dict[Hashable, set[str]] = {}
        self._held: dict[str, set[Hashable]] = {}
        self._other_media = 0  # events about host/disk tiers seen (not indexed)
        self._clock = clock
        self._evicted: dict[str, tuple[float, float]] = {}  # instance -> (weighted blocks, at)

    def apply(self, instance: str, batch: KVEventBatch) -> None:
        """Apply one batch of `instance`'s events, in order."""
        with self._lock:
            for ev in batch.events:
                if getattr(ev, "group_idx", None) not in (None, 0):
                    continue
                if isinstance(ev, BlockStored):
                    if ev.medium in _COUNTED_MEDIA:
                        self._store(instance, ev.block_hashes)
                    else:
                        self._other_media += 1
                elif isinstance(ev, BlockRemoved):
                    if ev.medium in _COUNTED_MEDIA:
                        self._remove(instance, ev.block_hashes)
                    else:
                        self._other_media += 1
                elif isinstance(ev, AllBlocksCleared):
                    self._clear(instance)

    def store(self, instance: str, hashes: Sequence[Hashable]) -> None:
        """Record that `instance` holds these blocks (tests and benchmarks seed it this way)."""
        with self._lock:
            self._store(instance, hashes)

    def clear(self, instance: str) -> None:
        """Forget everything about `instance` (it restarted, went down, or lost events)."""
        with self._lock:
            self._clear(instance)

    def overlaps(self, hashes: Sequence[Hashable]) -> dict[str, int]:
        """Longest cached prefix, in blocks, of the chain `hashes` on each instance holding at
        least its first block (instances absent from the result hold 0 blocks of it)."""
        result: dict[str, int] = {}
        with self._lock:
            where = self._where
            active: set[str] | None = None
            for i, h in enumerate(hashes):
                holders = where.get(h)
                if not holders:
                    break
                if active is None:
                    active = set(holders)
                elif not active <= holders:
                    for gone in active - holders:
                        result[gone] = i
                    active &= holders
                    if not active:
                        return result
            else:
                i = len(hashes)
            for inst in active or ():
                result[inst] = i
        return result

    def tracks(self, instance: str) -> bool:
        """Whether the index knows what `instance` holds (it has stored a block since its last
        clear): only then does a zero overlap there mean the prefix is not cached."""
        with self._lock:
            return instance in self._held

    def pressure(self, instance: str) -> float:
        """Blocks `instance` evicted, weighted by age (half-life PRESSURE_HALF_LIFE_S)."""
        with self._lock:
            return self._decayed(instance, self._clock())

    def pressures(self) -> dict[str, float]:
        """pressure() of every instance the index tracks."""
        with self._lock:
            now = self._clock()
            return {i: self._decayed(i, now) for i in self._held}

    def _decayed(self, instance: str, now: float) -> float:
        count, at = self._evicted.get(instance, (0.0, now))
        return count * 0.5 ** ((now - at) / PRESSURE_HALF_LIFE_S)

    def blocks_of(self, instance: str) -> int:
        with self._lock:
            return len(self._held.get(instance, ()))

    def stats(self) -> dict:
        with self._lock:
            now = self._clock()
            return {"blocks": len(self._where), "instances": {
                i: len(h) for i, h in self._held.items()}, "other_media_events": self._other_media,
                "pressure": {i: round(self._decayed(i, now), 1) for i in self._evicted}}

    def _store(self, instance: str, hashes: Sequence[Hashable]) -> None:
        held = self._held.setdefault(instance, set())
        where = self._where
        for h in hashes:
            s = where.get(h)
            if s is None:
                where[h] = {instance}
            else:
                s.add(instance)
            held.add(h)

    def _remove(self, instance: str, hashes: Sequence[Hashable]) -> None:
        held = self._held.get(instance)
        if not held:
            return
        n = 0
        for h in hashes:
            if h in held:
                held.discard(h)
                self._drop(h, instance)
                n += 1
        if n:
            now = self._clock()
            self._evicted[instance] = (self._decayed(instance, now) + n, now)

    def _clear(self, instance: str) -> None:
        for h in self._held.pop(instance, ()):
            self._drop(h, instance)
        self._evicted.pop(instance, None)  # an emptied pool has room: no pressure left

    def _drop(self, h: Hashable, instance: str) -> None:
        s = self._where.get(h)
        if s is not None:
            s.discard(instance)
            if not s:
                del self._where[h]
