"""The write path under TieredStore: queues and threads that carry stores down the tiers.

One ingest thread snapshots the source rows of a store, puts them into the host tier, completes
the store's future (the caller may reuse its rows from then on) and hands the snapshot to one
writer thread per lower tier. Every queue is bounded and `enqueue` never blocks: a full queue
drops the store (this is a cache, the pages can be recomputed).

Invariants:
- `recent[tier]` holds keys known to be in that tier; a writer skips them (a key names its
  content). Callers discard keys a tier turned out to lack and clear a tier that failed.
- A worker thread survives any one bad item (logged).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, Sequence

import torch

from loomserve.kv.tiers.base import Tier, copy_page, page_bytes_of
from loomserve.kv.tiers.guard import TierGuard
from loomserve.kv.tiers.handles import StoreResult
from loomserve.kv.tiers.host import HostTier

log = logging.getLogger(__name__)


class RecentKeys:
    """Bounded LRU set of keys known to be written to a tier."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._d: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, k: bytes) -> bool:
        with self._lock:
            return k in self._d

    def add_all(self, keys) -> None:
        with self._lock:
            d = self._d
            for k in keys:
                d[k] = None
                d.move_to_end(k)
            while len(d) > self.capacity:
                d.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def discard_all(self, keys) -> None:
        with self._lock:
            for k in keys:
                self._d.pop(k, None)


class QueueWorker(threading.Thread):
    """One thread draining a bounded queue; `offer` never blocks."""

    def __init__(self, name: str, depth: int, handle: Callable) -> None:
        super().__init__(name=name, daemon=True)
        self.q: queue.Queue = queue.Queue(depth)
        self._handle = handle

    def offer(self, item) -> bool:
        try:
            self.q.put_nowait(item)
            return True
        except queue.Full:
            return False

    def run(self) -> None:
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                self._handle(item)
            except Exception:  # a worker never dies of one bad item
                log.exception("%s: item failed", self.name)
            finally:
                self.q.task_done()

    def stop(self, timeout: float = 2.0) -> None:
        try:
            self.q.put(None, timeout=timeout)
        except queue.Full:
            pass
        self.join(timeout)


class WritePath:
    def __init__(self, tiers: Sequence[Tier], host: HostTier | None, guard: TierGuard,
                 queue_depth: int = 64, recent_keys: int = 1 << 16) -> None:
        self.host = host
        self.lower = [t for t in tiers if t is not host and not t.readonly]
        self.guard = guard
        self.recent = {t.name: RecentKeys(recent_keys) for t in tiers}
        self._ingest = QueueWorker("tiers-ingest", queue_depth, self._ingest_item)
        self._writers = {t.name: QueueWorker(f"tier-{t.name}-writer", queue_depth,
                                             lambda item, t=t: self._write_item(t, item))
                         for t in self.lower}
        self._ingest.start()
        for w in self._writers.values():
            w.start()

    def enqueue(self, keys: list[bytes], src: torch.Tensor, rows: list[int]) -> Future | None:
        """Queue src[rows[i]] for every tier under keys[i]; the future's StoreResult comes once
        the rows were copied. None: the ingest queue is full and the store is dropped."""
        fut: Future = Future()
        return fut if self._ingest.offer((keys, src, rows, fut)) else None

    def _ingest_item(self, item) -> None:
        keys, src, rows, fut = item
        if not fut.set_running_or_notify_cancel():
            return
        try:
            if src.device.type == "cpu":
                pages = torch.empty((len(rows), page_bytes_of(src)), dtype=src.dtype)
                for j, r in enumerate(rows):
                    copy_page(pages[j], src[r])
            else:
                idx = torch.tensor(rows, dtype=torch.long, device=src.device)
                pages = src.index_select(0, idx).cpu().view(len(rows), -1)
        except Exception as e:
            fut.set_exception(e)
            return
        if self.host is not None:
            self.host.put(keys, pages)
            self.recent[self.host.name].add_all(keys)
        fut.set_result(StoreResult(queued=len(keys)))
        for t in self.lower:
            if not self._writers[t.name].offer((keys, pages)):
                t.stats.add(store_drops=len(keys))

    def _write_item(self, tier: Tier, item) -> None:
        keys, pages = item
        recent = self.recent[tier.name]
        pick = [i for i, k in enumerate(keys) if k not in recent]
        if not pick:
            return
        if not tier.health.available():
            tier.stats.add(store_drops=len(pick), skipped_unhealthy=1)
            return
        ks = [keys[i] for i in pick]
        try:
            ok = tier.put(ks, pages, pick)
        except Exception as e:
            self.guard.fail(tier, f"{type(e).__name__}: {e}")
            tier.stats.add(store_drops=len(pick))
            return
        self.guard.ok(tier)
        recent.add_all(k for k, o in zip(ks, ok) if o)

    def queue_sizes(self) -> dict[str, int]:
        return {"ingest": self._ingest.q.qsize(),
                **{n: w.q.qsize() for n, w in self._writers.items()}}

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued store reached its tiers."""
        deadline = time.monotonic() + timeout
        for w in [self._ingest, *self._writers.values()]:
            while w.q.unfinished_tasks:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.002)
        return True

    def close(self, timeout: float = 2.0) -> None:
        self._ingest.stop(timeout)
        for w in self._writers.values():
            w.stop(timeout)
