"""TieredStore: the tiers below the device pool, top-down (host -> disk -> remote), in the
background. The facade the connector talks to; its parts (handles.py, write_path.py, guard.py,
prefetch.py) live beside it.

Stores are queued; lookups, loads and prefetches run on a small pool of I/O threads and return
a TierHandle at once. Reads walk the tiers top-down, and a page found in a lower tier is also
put into the host tier. The parts, the read path and the write policy: docs/design/tiers.md.

Invariants:
- Nothing here blocks the engine loop: a request waits only for its own handle.
- A lower tier's pages reach the destination only through per-call staging, once the call
  finished in time and the pages passed their checks.
- Keys recently written to a tier are not written again (a key names its content).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Sequence

import torch

from loomserve.kv.tiers.base import Tier, TierEvent, copy_page, rows_list
from loomserve.kv.tiers.guard import TierGuard
from loomserve.kv.tiers.handles import (
    LoadResult,
    LookupResult,
    PrefetchResult,
    StoreResult,
    TierHandle,
)
from loomserve.kv.tiers.host import HostTier
from loomserve.kv.tiers.io_priority import io_pool
from loomserve.kv.tiers.prefetch import SessionPrefetcher
from loomserve.kv.tiers.write_path import RecentKeys, WritePath

# A tier's answer for the keys still missing: one bool per key, or None for no answer.
Probe = Callable[[Tier, list[int]], "list[bool] | None"]


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
        self._writable = any(not t.readonly for t in self.tiers)
        self.write_after_seen = max(1, write_after_seen)
        self.promote = promote
        self.counters = {"offered": 0, "store_calls": 0, "ingest_drops": 0, "lookups": 0,
                         "loads": 0, "prefetches": 0}
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._seen_capacity = seen_capacity
        self._seen_lock = threading.Lock()
        self._guard = TierGuard(self.lower, op_timeout_s, backoff_s, on_fail=self._forget_tier)
        self._writes = WritePath(self.tiers, self.host, self._guard, queue_depth, recent_keys)
        self._recent = self._writes.recent
        self._io = io_pool(io_threads, "tiers-io")
        self._prefetches: dict[str, TierHandle] = {}
        self.sessions = prefetcher or SessionPrefetcher(self.page_bytes,
                                                        bandwidth_fn=self.load_bandwidth)
        self._closed = False

    @property
    def op_timeout_s(self) -> float:
        return self._guard.op_timeout_s

    @op_timeout_s.setter
    def op_timeout_s(self, value: float) -> None:
        self._guard.op_timeout_s = value

    def _forget_tier(self, tier: Tier) -> None:
        # A backend that comes back may have lost everything (a restarted pool): forget what
        # was written to it so those keys are written again.
        self._recent[tier.name].clear()

    # -- write path ---------------------------------------------------------------------------
    def offer(self, keys: Sequence[bytes], src: torch.Tensor, rows=None) -> TierHandle:
        """Blocks computed or hit in the device pool: store those now seen write_after_seen
        times and not written recently. src[rows[i]] is keys[i]'s page; keep those rows
        unchanged until the handle is done."""
        rows = rows_list(rows, len(keys))
        self.counters["offered"] += len(keys)
        if not self._writable:  # e.g. only the read-only PeerTier: nothing to count or write
            return TierHandle.completed(StoreResult())
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

    def unwritten(self, keys: Sequence[bytes]) -> list[int]:
        """Indices of keys not known to be written to the top tier (a hint for callers that
        would otherwise snapshot pages again that are already there)."""
        recent = self._recent[self.tiers[0].name]
        return [i for i, k in enumerate(keys) if k not in recent]

    def store(self, keys: Sequence[bytes], src: torch.Tensor, rows=None) -> TierHandle:
        """Queue src[rows[i]] for every tier under keys[i]; never blocks. The handle is ready
        once the rows were copied (they may be reused then); a full queue drops the whole store
        (result.dropped)."""
        keys = list(keys)
        rows = rows_list(rows, len(keys))
        self.counters["store_calls"] += 1
        if not keys or not self._writable:
            return TierHandle.completed(StoreResult())
        fut = None if self._closed else self._writes.enqueue(keys, src, rows)
        if fut is None:
            self.counters["ingest_drops"] += len(keys)
            return TierHandle.completed(StoreResult(dropped=len(keys)))
        return TierHandle(fut)

    # -- read path ----------------------------------------------------------------------------
    def lookup_async(self, keys: Sequence[bytes]) -> TierHandle:
        """Which tier holds each key. Result: LookupResult."""
        self.counters["lookups"] += 1
        return TierHandle(self._io.submit(self._lookup, list(keys)))

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        return self._lookup(list(keys))

    def load_async(self, keys: Sequence[bytes], pages_dst: torch.Tensor, rows=None) -> TierHandle:
        """Load keys[i]'s page into pages_dst[rows[i]] (uint8 [*, page_bytes], CPU or CUDA, e.g.
        the device pool's buffer and the target block ids). Result: LoadResult; only rows it
        reports loaded hold data. Nothing else may use those rows until the handle is done."""
        self.counters["loads"] += 1
        rows = rows_list(rows, len(keys))
        return TierHandle(self._io.submit(self._load, list(keys), pages_dst, rows))

    def load(self, keys: Sequence[bytes], pages_dst: torch.Tensor, rows=None) -> LoadResult:
        return self._load(list(keys), pages_dst, rows_list(rows, len(keys)))

    def _walk(self, keys: list[bytes], probe: Probe) -> list[str | None]:
        """Ask the tiers top-down, each only about the keys no tier above it had:
        probe(tier, todo) answers for keys[i], i in todo. Returns the tier each key was found
        in (None: in none). A key a tier answers False for is forgotten as written there (lost
        or evicted), so the next store writes it again; a tier without an answer is skipped."""
        where: list[str | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for t in self.tiers:
            if not todo:
                break
            found = probe(t, todo)
            if found is None:
                continue
            rest = []
            for i, f in zip(todo, found):
                if f:
                    where[i] = t.name
                else:
                    rest.append(i)
            self._recent[t.name].discard_all(keys[i] for i in rest)
            todo = rest
        return where

    def _lookup(self, keys: list[bytes]) -> LookupResult:
        def probe(t: Tier, todo: list[int]):
            sub = [keys[i] for i in todo]
            return t.contains(sub) if t.local else self._guard.call(t, t.contains, sub)
        return LookupResult(self._walk(keys, probe))

    def _load(self, keys: list[bytes], dst: torch.Tensor, rows: list[int]) -> LoadResult:
        def probe(t: Tier, todo: list[int]):
            sub = [keys[i] for i in todo]
            if t.local:  # in-process memory: straight into the destination
                return t.get_into(sub, dst, [rows[i] for i in todo])
            got = self._fetch(t, sub, self.promote)
            if got is None:
                return None
            ok, staging = got
            for j, i in enumerate(todo):
                if ok[j]:
                    copy_page(dst[rows[i]], staging[j])
            return ok
        where = self._walk(keys, probe)
        if dst.device.type == "cuda":
            torch.cuda.current_stream(dst.device).synchronize()
        return LoadResult(where)

    def _fetch(self, tier: Tier, keys: list[bytes], promote: bool):
        """keys' pages from a lower tier into fresh staging, through the guard: (ok, staging),
        or None without an answer. With promote, the pages found go into the host tier too."""
        staging = torch.empty((len(keys), self.page_bytes), dtype=torch.uint8)
        ok = self._guard.call(tier, tier.get_into, keys, staging, None)
        if ok is None:
            return None
        hit_j = [j for j, o in enumerate(ok) if o]
        if hit_j and promote and self.host is not None:
            hk = [keys[j] for j in hit_j]
            self.host.put(hk, staging, hit_j)
            self._recent[self.host.name].add_all(hk)
        return ok, staging

    # -- sessions and prefetch ----------------------------------------------------------------
    def on_session_pause(self, keys: Sequence[bytes], src: torch.Tensor | None = None, rows=None,
                         session_id: str | None = None) -> TierHandle:
        """A session paused (tool call, end of turn): write its blocks down whatever their
        count, and remember them for a prefetch before its predicted return."""
        if session_id is not None:
            self.sessions.on_pause(session_id, list(keys))
        if src is None:
            return TierHandle.completed(StoreResult())
        return self.store(keys, src, rows)

    def on_session_resume(self, session_id: str) -> None:
        self.sessions.on_resume(session_id)

    def poll_prefetch(self, now: float | None = None) -> list[TierHandle]:
        """Start the prefetches the think-time predictors say are due (call every step or on
        a timer)."""
        return [self.prefetch(sid, keys) for sid, keys in self.sessions.due(now)]

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

        def probe(t: Tier, todo: list[int]):
            sub = [keys[i] for i in todo]
            if t is host:
                found = host.contains(sub)
                host.touch([k for k, f in zip(sub, found) if f])
                return found
            got = self._fetch(t, sub, promote=True)
            return None if got is None else got[0]
        where = self._walk(keys, probe)
        resident = sum(w == host.name for w in where)
        missing = sum(w is None for w in where)
        return PrefetchResult(len(keys) - resident - missing, resident, missing)

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
            else:
                self._guard.submit(t, t.touch, keys)

    def evict(self, keys: Sequence[bytes]) -> TierHandle:
        """Remove keys from every tier (e.g. a model reload); background, best effort."""
        keys = list(keys)

        def run():
            for t in self.tiers:
                self._recent[t.name].discard_all(keys)
                if t.local:
                    t.remove(keys)
                else:
                    self._guard.call(t, t.remove, keys)
            with self._seen_lock:
                for k in keys:
                    self._seen.pop(k, None)
        return TierHandle(self._io.submit(run))

    def subscribe(self, fn: Callable[[TierEvent], None]) -> None:
        """Tier events (PagesStored / PagesRemoved with the tier's name), from worker threads."""
        for t in self.tiers:
            t.subscribe(fn)

    def add_tier(self, tier: Tier) -> None:
        """Append a read-only tier below the others while the store runs (the PeerTier of
        prefill/decode disaggregation, added at an instance's first decode leg). The lists are
        replaced, not mutated, so a worker walking the old ones finishes undisturbed."""
        if not tier.readonly or tier.page_bytes != self.page_bytes:
            raise ValueError("only a read-only tier of the store's page size can be added")
        if any(t.name == tier.name for t in self.tiers):
            raise ValueError(f"the store already has a tier named {tier.name!r}")
        self._guard.add(tier)
        self._recent[tier.name] = RecentKeys(1024)  # never written: only misses discard here
        self.lower = [*self.lower, tier]
        self.tiers = [*self.tiers, tier]

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def stats(self) -> list:
        return [t.stats for t in self.tiers]

    def stats_snapshot(self) -> dict:
        return {"store": dict(self.counters), "queues": self._writes.queue_sizes(),
                "tiers": {t.name: t.stats.snapshot() for t in self.tiers}}

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued store reached its tiers (tests, shutdown)."""
        return self._writes.flush(timeout)

    def close(self, timeout: float = 2.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._writes.close(timeout)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._guard.shutdown()
        for t in self.tiers:
            t.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
