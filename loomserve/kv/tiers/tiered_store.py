"""TieredStore: the tiers below the device pool, top-down (host -> disk -> remote), in the
background.

Nothing here blocks the engine loop:
- Stores are queued (bounded). An ingest thread snapshots the source rows, puts them into the
  host tier, marks the store handle ready (the caller may reuse the rows from then on) and hands
  the snapshot to one writer thread per lower tier, each with its own bounded queue. A full
  queue drops the store: this is a cache, the pages can be recomputed.
- Lookups, loads and prefetches return a TierHandle at once (pending -> ready | failed); the
  scheduler polls `done()` and keeps scheduling other work; a request waits only for its own
  handles. They run on a small pool of I/O threads. Host-tier work runs inline there; every
  lower tier gets its own single thread and each call to it is bounded by `op_timeout_s`.
- A tier that raises or times out degrades the call to misses and is marked unhealthy; it is
  skipped (misses, dropped stores) until its backoff expires, then probed by the next call
  (exponential backoff). A slow call that returns after its timeout writes only into a buffer
  nobody reads any more: lower tiers load into per-call staging, copied to the destination
  only when the call finished in time and the pages passed their checks.

Write policy: `offer()` stores a block once it has been offered `write_after_seen` times (default
1: the first time); `on_session_pause()` stores a session's blocks regardless. Keys recently
written to a tier are not written again (a key names its content).

Loads promote: a page found in a lower tier is also put into the host tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from loomserve.kv.tiers.base import Tier, TierEvent, TierUnavailable, copy_page, rows_list
from loomserve.kv.tiers.host import HostTier
from loomserve.kv.tiers.prefetch import SessionPrefetcher

log = logging.getLogger(__name__)


# -- handles and results ----------------------------------------------------------------------
class TierHandle:
    """A background tier operation: state is 'pending', then 'ready' or 'failed'. Tier faults
    are misses, so 'failed' means a bug or bad arguments, not an unavailable tier."""

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


# -- workers ----------------------------------------------------------------------------------
class _RecentKeys:
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


class _Worker(threading.Thread):
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


# -- the store --------------------------------------------------------------------------------
class TieredStore:
    def __init__(self, tiers: Sequence[Tier], write_after_seen: int = 1, queue_depth: int = 64,
                 io_threads: int = 2, op_timeout_s: float = 2.0, promote: bool = True,
                 backoff_s: tuple[float, float] = (0.5, 30.0), recent_keys: int = 1 << 16,
                 seen_capacity: int = 1 << 20, prefetcher: SessionPrefetcher | None = None) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier")
        self.tiers = list(tiers)
        pbs = {t.page_bytes for t in self.tiers}
        if len(pbs) != 1:
            raise ValueError(f"tiers disagree on page_bytes: {sorted(pbs)}")
        self.page_bytes = pbs.pop()
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique: {names}")
        self.host: HostTier | None = self.tiers[0] if isinstance(self.tiers[0], HostTier) else None
        self.lower = [t for t in self.tiers if t is not self.host]
        for t in self.tiers:
            t.health.base_s, t.health.max_s = backoff_s
        self.write_after_seen = max(1, write_after_seen)
        self.op_timeout_s = op_timeout_s
        self.promote = promote
        self.counters = {"offered": 0, "store_calls": 0, "ingest_drops": 0, "lookups": 0,
                         "loads": 0, "prefetches": 0}
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._seen_capacity = seen_capacity
        self._seen_lock = threading.Lock()
        self._recent = {t.name: _RecentKeys(recent_keys) for t in self.tiers}
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="tiers-io")
        self._tier_io = {t.name: ThreadPoolExecutor(1, thread_name_prefix=f"tier-{t.name}")
                         for t in self.lower}
        self._ingest = _Worker("tiers-ingest", queue_depth, self._ingest_item)
        self._writers = {t.name: _Worker(f"tier-{t.name}-writer", queue_depth,
                                         lambda item, t=t: self._write_item(t, item))
                         for t in self.lower}
        self._prefetches: dict[str, TierHandle] = {}
        self.sessions = prefetcher or SessionPrefetcher(self.page_bytes,
                                                        bandwidth_fn=self.load_bandwidth)
        self._closed = False
        self._ingest.start()
        for w in self._writers.values():
            w.start()

    # -- health -------------------------------------------------------------------------------
    @staticmethod
    def _ok(tier: Tier) -> None:
        tier.health.ok()
        tier.stats.healthy = True

    def _fail(self, tier: Tier, err: str) -> None:
        if tier.health.healthy:
            log.warning("tier %s unavailable: %s", tier.name, err)
        tier.health.fail(err)
        tier.stats.healthy = False
        # A backend that comes back may have lost everything (a restarted pool): forget what
        # was written to it so those keys are written again.
        self._recent[tier.name].clear()

    def _call(self, tier: Tier, fn, *args):
        """fn(*args) on the tier's own thread, bounded by op_timeout_s; None on any fault."""
        if not tier.health.available():
            tier.stats.add(skipped_unhealthy=1)
            return None
        fut = self._tier_io[tier.name].submit(fn, *args)
        try:
            res = fut.result(timeout=self.op_timeout_s)
        except FutureTimeout:
            tier.stats.add(timeouts=1)
            self._fail(tier, f"timed out after {self.op_timeout_s}s")
            return None
        except TierUnavailable as e:
            self._fail(tier, str(e))
            return None
        except Exception as e:  # a backend raising anything else is a fault too
            self._fail(tier, f"{type(e).__name__}: {e}")
            return None
        self._ok(tier)
        return res

    # -- write path ---------------------------------------------------------------------------
    def offer(self, keys: Sequence[bytes], src: torch.Tensor, rows=None) -> TierHandle:
        """Blocks computed or hit in the device pool: store those now seen write_after_seen
        times and not written recently. src[rows[i]] is keys[i]'s page; keep those rows
        unchanged until the handle is done."""
        rows = rows_list(rows, len(keys))
        self.counters["offered"] += len(keys)
        n = self.write_after_seen
        pick = []
        recent = self._recent[self.tiers[0].name]
        with self._seen_lock:
            seen = self._seen
            for i, k in enumerate(keys):
                c = seen.get(k, 0) + 1
                seen[k] = c
                seen.move_to_end(k)
                if c >= n and k not in recent:
                    pick.append(i)
            while len(seen) > self._seen_capacity:
                seen.popitem(last=False)
        if not pick:
            return TierHandle.completed(StoreResult())
        return self.store([keys[i] for i in pick], src, [rows[i] for i in pick])

    def on_session_pause(self, keys: Sequence[bytes], src: torch.Tensor | None = None, rows=None,
                         session_id: str | None = None) -> TierHandle:
        """A session paused (tool call, end of turn): write its blocks down whatever their
        count, and remember them for a prefetch before its predicted return."""
        if session_id is not None:
            self.sessions.on_pause(session_id, list(keys))
        if src is None:
            return TierHandle.completed(StoreResult())
        return self.store(keys, src, rows)

    def unwritten(self, keys: Sequence[bytes]) -> list[int]:
        """Indices of keys not known to be written to the top tier (a hint for callers that
        would otherwise snapshot pages again that are already there)."""
        recent = self._recent[self.tiers[0].name]
        return [i for i, k in enumerate(keys) if k not in recent]

    def on_session_resume(self, session_id: str) -> None:
        self.sessions.on_resume(session_id)

    def store(self, keys: Sequence[bytes], src: torch.Tensor, rows=None) -> TierHandle:
        """Queue src[rows[i]] for every tier under keys[i]; never blocks. The handle is ready
        once the rows were copied (they may be reused then); a full queue drops the whole store
        (result.dropped)."""
        keys = list(keys)
        rows = rows_list(rows, len(keys))
        self.counters["store_calls"] += 1
        fut: Future = Future()
        if not keys:
            fut.set_result(StoreResult())
        elif self._closed or not self._ingest.offer((keys, src, rows, fut)):
            self.counters["ingest_drops"] += len(keys)
            fut.set_result(StoreResult(dropped=len(keys)))
        return TierHandle(fut)

    def _ingest_item(self, item) -> None:
        keys, src, rows, fut = item
        if not fut.set_running_or_notify_cancel():
            return
        try:
            if src.device.type == "cpu":
                pages = torch.empty((len(rows), src.shape[1]), dtype=src.dtype)
                for j, r in enumerate(rows):
                    copy_page(pages[j], src[r])
            else:
                idx = torch.tensor(rows, dtype=torch.long, device=src.device)
                pages = src.index_select(0, idx).cpu()
        except Exception as e:
            fut.set_exception(e)
            return
        if self.host is not None:
            self.host.put(keys, pages)
            self._recent[self.host.name].add_all(keys)
        fut.set_result(StoreResult(queued=len(keys)))
        for t in self.lower:
            if not self._writers[t.name].offer((keys, pages)):
                t.stats.add(store_drops=len(keys))

    def _write_item(self, tier: Tier, item) -> None:
        keys, pages = item
        recent = self._recent[tier.name]
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
            self._fail(tier, f"{type(e).__name__}: {e}")
            tier.stats.add(store_drops=len(pick))
            return
        self._ok(tier)
        recent.add_all(k for k, o in zip(ks, ok) if o)

    # -- read path ----------------------------------------------------------------------------
    def lookup_async(self, keys: Sequence[bytes]) -> TierHandle:
        """Which tier holds each key. Result: LookupResult."""
        self.counters["lookups"] += 1
        return TierHandle(self._io.submit(self._lookup, list(keys)))

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        return self._lookup(list(keys))

    def _lookup(self, keys: list[bytes]) -> LookupResult:
        where: list[str | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for t in self.tiers:
            if not todo:
                break
            sub = [keys[i] for i in todo]
            if t.local:
                found = t.contains(sub)
            else:
                found = self._call(t, t.contains, sub)
                if found is None:
                    continue
            rest = []
            for i, f in zip(todo, found):
                if f:
                    where[i] = t.name
                else:
                    rest.append(i)
            self._recent[t.name].discard_all(keys[i] for i in rest)  # lost or evicted there
            todo = rest
        return LookupResult(where)

    def load_async(self, keys: Sequence[bytes], pages_dst: torch.Tensor, rows=None) -> TierHandle:
        """Load keys[i]'s page into pages_dst[rows[i]] (uint8 [*, page_bytes], CPU or CUDA, e.g.
        the device pool's buffer and the target block ids). Result: LoadResult; only rows it
        reports loaded hold data. Nothing else may use those rows until the handle is done."""
        self.counters["loads"] += 1
        rows = rows_list(rows, len(keys))
        return TierHandle(self._io.submit(self._load, list(keys), pages_dst, rows))

    def load(self, keys: Sequence[bytes], pages_dst: torch.Tensor, rows=None) -> LoadResult:
        return self._load(list(keys), pages_dst, rows_list(rows, len(keys)))

    def _load(self, keys: list[bytes], dst: torch.Tensor, rows: list[int]) -> LoadResult:
        where: list[str | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for t in self.tiers:
            if not todo:
                break
            sub = [keys[i] for i in todo]
            if t.local:
                ok = t.get_into(sub, dst, [rows[i] for i in todo])
                rest = []
                for i, o in zip(todo, ok):
                    if o:
                        where[i] = t.name
                    else:
                        rest.append(i)
                self._recent[t.name].discard_all(keys[i] for i in rest)
                todo = rest
                continue
            staging = torch.empty((len(sub), self.page_bytes), dtype=torch.uint8)
            ok = self._call(t, t.get_into, sub, staging, None)
            if ok is None:
                continue
            rest, hit_j = [], []
            for j, (i, o) in enumerate(zip(todo, ok)):
                if o:
                    copy_page(dst[rows[i]], staging[j])
                    where[i] = t.name
                    hit_j.append(j)
                else:
                    rest.append(i)
            self._recent[t.name].discard_all(keys[i] for i in rest)  # lost or evicted there
            if hit_j and self.promote and self.host is not None:
                hk = [sub[j] for j in hit_j]
                self.host.put(hk, staging, hit_j)
                self._recent[self.host.name].add_all(hk)
            todo = rest
        if dst.device.type == "cuda":
            torch.cuda.current_stream(dst.device).synchronize()
        return LoadResult(where)

    # -- prefetch -----------------------------------------------------------------------------
    def prefetch(self, session_id: str, keys: Sequence[bytes]) -> TierHandle:
        """Bring a session's pages up into the host tier in the background (before its next
        turn). A newer prefetch for the same session replaces one not started yet."""
        self.counters["prefetches"] += 1
        old = self._prefetches.get(session_id)
        if old is not None and not old.done():
            old.cancel()
        if self.host is None:
            h = TierHandle.completed(PrefetchResult(missing=len(keys)))
        else:
            h = TierHandle(self._io.submit(self._prefetch, list(keys)))
        self._prefetches[session_id] = h

        def forget(done: TierHandle) -> None:
            if self._prefetches.get(session_id) is done:
                self._prefetches.pop(session_id, None)
        h.add_done_callback(forget)
        return h

    def _prefetch(self, keys: list[bytes]) -> PrefetchResult:
        host = self.host
        resident = host.contains(keys)
        todo = [k for k, r in zip(keys, resident) if not r]
        host.touch([k for k, r in zip(keys, resident) if r])
        promoted = 0
        for t in self.lower:
            if not todo:
                break
            staging = torch.empty((len(todo), self.page_bytes), dtype=torch.uint8)
            ok = self._call(t, t.get_into, todo, staging, None)
            if ok is None:
                continue
            hit_j = [j for j, o in enumerate(ok) if o]
            if hit_j:
                hk = [todo[j] for j in hit_j]
                host.put(hk, staging, hit_j)
                self._recent[host.name].add_all(hk)
                promoted += len(hit_j)
            todo = [k for k, o in zip(todo, ok) if not o]
        return PrefetchResult(promoted, sum(resident), len(todo))

    def poll_prefetch(self, now: float | None = None) -> list[TierHandle]:
        """Start the prefetches the think-time predictors say are due (call every step or on
        a timer)."""
        return [self.prefetch(sid, keys) for sid, keys in self.sessions.due(now)]

    def load_bandwidth(self) -> float | None:
        """Observed load bytes/s of the slowest lower tier that has loaded anything."""
        bws = [b for b in (t.stats.bandwidth("get") for t in self.lower) if b]
        return min(bws) if bws else None

    # -- maintenance --------------------------------------------------------------------------
    def touch(self, keys: Sequence[bytes]) -> None:
        keys = list(keys)
        for t in self.tiers:
            if t.local:
                t.touch(keys)
            elif t.health.healthy:
                self._tier_io[t.name].submit(t.touch, keys)

    def evict(self, keys: Sequence[bytes]) -> TierHandle:
        """Remove keys from every tier (e.g. a model reload); background, best effort."""
        keys = list(keys)

        def run():
            for t in self.tiers:
                self._recent[t.name].discard_all(keys)
                if t.local:
                    t.remove(keys)
                else:
                    self._call(t, t.remove, keys)
            with self._seen_lock:
                for k in keys:
                    self._seen.pop(k, None)
        return TierHandle(self._io.submit(run))

    def subscribe(self, fn: Callable[[TierEvent], None]) -> None:
        """Tier events (PagesStored / PagesRemoved with the tier's name), from worker threads."""
        for t in self.tiers:
            t.subscribe(fn)

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def stats(self) -> list:
        return [t.stats for t in self.tiers]

    def stats_snapshot(self) -> dict:
        return {"store": dict(self.counters),
                "queues": {"ingest": self._ingest.q.qsize(),
                           **{n: w.q.qsize() for n, w in self._writers.items()}},
                "tiers": {t.name: t.stats.snapshot() for t in self.tiers}}

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued store reached its tiers (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        for w in [self._ingest, *self._writers.values()]:
            while w.q.unfinished_tasks:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.002)
        return True

    def close(self, timeout: float = 2.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._ingest.stop(timeout)
        for w in self._writers.values():
            w.stop(timeout)
        self._io.shutdown(wait=False, cancel_futures=True)
        for ex in self._tier_io.values():
            ex.shutdown(wait=False, cancel_futures=True)
        for t in self.tiers:
            t.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
