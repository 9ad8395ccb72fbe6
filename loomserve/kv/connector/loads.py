"""The scheduler side: per waiting request, lookup -> load -> device hit (GO / WAIT / FULL).

`prepare` probes the device; if the tiers could extend its hit, it looks the missing pages up
in the background, then claims rows and loads the pages of the largest boundary every group
can serve (`best_boundary`); once the load is done it caches what loaded, and the scheduler's
normal admission hits those pages on the device. The state machine step by step:
docs/design/tiers.md.

Invariants:
- A block is hashed (hittable) only once its row holds the data of its hash.
- Rows being loaded belong to the connector until their handle is done, whatever happens to
  the request meanwhile (an aborted request's rows pass to StoreSide.keep; nothing is cached).
- A load writes its rows only after every step that ran while they were claimed (async
  scheduling: the step in flight at the claim) is done.
- At most max_inflight requests have tier I/O in flight; each gets at most MAX_ROUNDS tier
  rounds per life (a pool that keeps evicting what was just loaded must not loop).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable

from loomserve.kv.connector.hits import HitAccounting
from loomserve.kv.connector.stores import StoreSide
from loomserve.kv.pool import Block

GO, WAIT, FULL = "go", "wait", "full"
MAX_ROUNDS = 2
# A load is issued in chunks of this many blocks: each tier call is bounded by the store's
# op_timeout_s, and a long prefix in one call could exceed it and mark a healthy tier down.
LOAD_CHUNK_BLOCKS = 64


class _AllOf:
    """A load's chunks, issued by start() (at once, or under async scheduling once the step in
    flight at the claim has run), seen as one handle: done when started and every chunk is; its
    tiers are the chunks' tiers in order (a failed chunk counts as not loaded)."""

    __slots__ = ("calls", "handles", "sizes")

    def __init__(self, calls: list[tuple[list[bytes], list[int]]]) -> None:
        self.calls: list | None = calls  # (keys, rows) per chunk; None once started
        self.handles: list = []
        self.sizes = [len(keys) for keys, _ in calls]

    @property
    def started(self) -> bool:
        return self.calls is None

    def start(self, store, buffer, wake) -> None:
        for keys, rows in self.calls:
            h = store.load_async(keys, buffer, rows)
            h.add_done_callback(wake)
            self.handles.append(h)
        self.calls = None

    def done(self) -> bool:
        return self.calls is None and all(h.done() for h in self.handles)

    def ready(self) -> bool:
        return self.done()

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    def tiers(self) -> list[str | None]:
        out: list[str | None] = []
        for h, n in zip(self.handles, self.sizes):
            out += h.result().tiers if h.ready() else [None] * n
        return out


class _Pending:
    """A request's tier I/O in flight. Phase 'lookup': which tiers hold the pages `want`
    ((group, block position) pairs a hit past the device hit of `start` blocks could read).
    Phase 'load': the pages `want` being loaded into the fresh blocks `pages` (same order),
    toward a hit of `end` blocks; `kept` are the (position, block) device pages of that hit,
    referenced until the load ends."""

    __slots__ = ("req", "phase", "handle", "start", "end", "want", "pages", "kept")

    def __init__(self, req, phase: str, handle, start: int, want: list[tuple[int, int]],
                 end: int = 0, pages: list[Block] | None = None,
                 kept: list[tuple[int, Block]] | None = None) -> None:
        self.req = req
        self.phase = phase
        self.handle = handle
        self.start = start
        self.end = end
        self.want = want
        self.pages = pages or []
        self.kept = kept or []

    def blocks(self) -> list[Block]:
        """Every block the load references, in chain order (position ascending)."""
        out = [(p, b) for (_, p), b in zip(self.want, self.pages)] + self.kept
        out.sort(key=lambda pb: pb[0])
        return [b for _, b in out]


class LoadSide:
    def __init__(self, kv, store, buffer, keyspaces: list, hits: HitAccounting,
                 stores: StoreSide, wake, max_inflight: int = 8) -> None:
        self.kv = kv
        self.store = store
        self.buffer = buffer
        self.keyspaces = keyspaces
        self.hits = hits
        self.counters = hits.counters
        self.stores = stores
        self.wake = wake  # done callback of every lookup/load handle
        self.max_inflight = max_inflight
        self.block_size = kv.block_size
        self.num_groups = len(keyspaces)
        self._all_indexed = all(t.index_in_memory for t in store.tiers)
        self.pending: dict[str, _Pending] = {}  # request id -> its I/O in flight
        self._rounds: dict[str, int] = {}
        # requests whose last load came up short (a page missing or failing its checks): their
        # next prepare starts another round (MAX_ROUNDS permitting) instead of admitting
        self._short: set[str] = set()
        # hash of the first block of each load in flight -> the loading request: a second
        # request for the same prefix waits for that load instead of loading it again
        self._loading: dict[bytes, str] = {}
        # Async scheduling (TierConnector.pace): whether a step is in flight; rows claimed
        # meanwhile may be rows it still writes (freed by a finish, an abort, a preemption),
        # so a load claimed then starts in start_deferred, once that step has run.
        self.in_flight: Callable[[], bool] | None = None

    def prepare(self, req) -> str:
        """GO: admit req normally (its device probe now sees whatever the tiers gave);
        WAIT: skip it this step; FULL: the pool cannot take its tier blocks now."""
        rid = req.request_id
        st = self.pending.get(rid)
        if st is None:
            if self.hits.has_load(rid) and rid not in self._short:
                return GO  # its load finished (in poll): the device probe sees the pages
            self._short.discard(rid)
            return self._start_lookup(req)
        if not st.handle.done():
            return WAIT
        if st.phase == "lookup":
            return self._start_load(req, st)
        self._finish_load(req, st)
        if rid in self._short:  # a page failed: one more round may find an earlier boundary
            self._short.discard(rid)
            return self._start_lookup(req)
        return GO

    def on_admit(self, request_id: str) -> None:
        self._short.discard(request_id)

    def on_finish(self, req) -> None:
        """Before the KV manager frees req: forget it; an unfinished load's rows are kept
        (by StoreSide) until the load ends, a lookup is cancelled."""
        rid = req.request_id
        self._rounds.pop(rid, None)
        self._short.discard(rid)
        st = self.pending.pop(rid, None)
        if st is None:
            return
        if st.phase == "load":
            self._loading.pop(req.block_hashes[st.start], None)
            if st.handle.done() or not st.handle.started:  # no tier writes the rows
                self.kv.release_pages(list(reversed(st.blocks())))
            else:  # the rows are still being written: hold them until the load ends
                self.stores.keep(st.handle, st.blocks())
        else:
            st.handle.cancel()

    def start_deferred(self) -> None:
        """Async scheduling, after a swap: start the loads claimed while the step it returned
        was in flight (the step in flight now was scheduled after their claims and does not
        touch their rows)."""
        for st in self.pending.values():
            if st.phase == "load" and not st.handle.started:
                st.handle.start(self.store, self.buffer, self.wake)

    def finish_done(self) -> None:
        """Finish every load that is done, so the connector holds none of its rows whatever
        the request's place in the queue (a full pool must not wait on a request the
        scheduler does not reach)."""
        for st in [st for st in self.pending.values()
                   if st.phase == "load" and st.handle.done()]:
            self._finish_load(st.req, st)

    # -- boundaries ---------------------------------------------------------------------------
    def _probe(self, req) -> tuple[int, int]:
        """(device hit, cap) in blocks; the cap is prompt length - 1."""
        _, n = self.kv.get_computed_blocks(req, record_stats=False)
        return n // self.block_size, (len(req.all_token_ids) - 1) // self.block_size

    def wanted(self, hashes: list[bytes], n: int, cap: int) -> list[tuple[int, int]]:
        """(group, position) of every page not on the device that a hit of b blocks, n < b <=
        cap, could read. Each group's pages for b form a range ending at b whose start grows
        with b, so b = n + 1 gives the lowest position."""
        kv = self.kv
        out = []
        for g, r in enumerate(kv.hit_positions(n + 1)):
            lo = r.start
            out += [(g, lo + i) for i, b in enumerate(kv.cached_blocks(g, hashes[lo:cap]))
                    if b is None]
        return out

    def best_boundary(self, hashes: list[bytes], n: int, cap: int, extra: set | dict) -> int:
        """The largest b, n < b <= cap, such that every group's pages for a hit of b blocks are
        cached on the device or in extra ((group, position) pairs): the coordinator's fixed
        point over device + tier pages. n when there is none."""
        kv = self.kv
        lows = [r.start for r in kv.hit_positions(n + 1)]
        avail = []  # per group: is the page at position lows[g] + i on the device or in extra
        upper = cap
        for g, lo in enumerate(lows):
            a = [b is not None or (g, lo + i) in extra
                 for i, b in enumerate(kv.cached_blocks(g, hashes[lo:cap]))]
            avail.append(a)
            if kv.prefix_closed_groups[g] and False in a:  # a hit of b reads all of [0, b)
                upper = min(upper, lo + a.index(False))
        sums: list[list[int]] | None = None
        groups = range(len(lows))
        for b in range(upper, n, -1):
            # every group reads its page at b - 1: a cheap filter before the whole ranges
            if not all(avail[g][b - 1 - lows[g]] for g in groups):
                continue
            if sums is None:
                sums = [[0, *accumulate(a)] for a in avail]
            for g, r in enumerate(kv.hit_positions(b)):
                lo, hi = r.start - lows[g], r.stop - lows[g]
                if sums[g][hi] - sums[g][lo] != hi - lo:
                    break
            else:
                return b
        return n

    # -- the state machine --------------------------------------------------------------------
    def _start_lookup(self, req) -> str:
        rid = req.request_id
        if self._rounds.get(rid, 0) >= MAX_ROUNDS:
            return GO
        n, cap = self._probe(req)
        if cap <= n:
            return GO
        hashes = req.block_hashes
        want = self.wanted(hashes, n, cap)
        if not want or self._surely_missing(hashes, n, want):
            return GO
        if len(self.pending) >= self.max_inflight:
            return WAIT
        keys = [self.keyspaces[g].key(hashes[p]) for g, p in want]
        handle = self.store.lookup_async(keys)
        handle.add_done_callback(self.wake)
        self.pending[rid] = _Pending(req, "lookup", handle, n, want)
        self._rounds[rid] = self._rounds.get(rid, 0) + 1
        self.counters["lookups"] += 1
        return WAIT

    def _surely_missing(self, hashes: list[bytes], n: int, want: list[tuple[int, int]]) -> bool:
        """Whether no tier can extend the device hit, known without I/O (every tier indexes
        its keys in memory): an attention group's page at the first position past the device
        hit is in no tier. A new turn's first uncached block is usually new content, so this
        saves most requests a background lookup and a step of waiting. Exact for full
        attention (every longer hit reads that page). Without a prefix-closed attention group
        (sliding windows only: a longer hit skips early pages, e.g. a window handed over by a
        prefill instance) it is missing when no tier holds any wanted window page. Without
        such pages (a state checkpoint is missing) the tiers are asked."""
        if not self._all_indexed:
            return False
        kv = self.kv
        token_groups, closed = kv.token_block_groups, kv.prefix_closed_groups
        first = [self.keyspaces[g].key(hashes[p]) for g, p in want
                 if p == n and token_groups[g] and closed[g]]
        if first:
            return not all(self._held_somewhere(first))
        window = [self.keyspaces[g].key(hashes[p]) for g, p in want if token_groups[g]]
        return bool(window) and not any(self._held_somewhere(window))

    def _held_somewhere(self, keys: list[bytes]) -> list[bool]:
        found = [False] * len(keys)
        for t in self.store.tiers:
            found = [f or c for f, c in zip(found, t.contains(keys))]
        return found

    def _start_load(self, req, st: _Pending) -> str:
        rid = req.request_id
        found = set()
        if st.handle.ready():
            found = {gp for gp, t in zip(st.want, st.handle.result().tiers) if t is not None}
        n, cap = self._probe(req)
        hashes = req.block_hashes
        end = self.best_boundary(hashes, n, cap, found) if found else n
        if end <= n:
            del self.pending[rid]
            return GO
        first = hashes[n]
        if self._loading.get(first, rid) != rid:
            return WAIT  # the same prefix is being loaded for another request
        kv = self.kv
        want, kept = [], []
        for g, r in enumerate(kv.hit_positions(end)):
            for p, b in zip(r, kv.cached_blocks(g, hashes[r.start:r.stop])):
                if b is None:
                    want.append((g, p))  # in found: best_boundary checked
                else:
                    kept.append((p, b))
        want.sort(key=lambda gp: (gp[1], gp[0]))
        pages = kv.claim_pages([b for _, b in kept], len(want))
        if pages is None:
            if len(want) + len(kept) > kv.num_usable_blocks:
                del self.pending[rid]  # could never fit: recompute instead
                return GO
            return FULL  # keep the lookup result; try again next step
        calls = []
        chunk = LOAD_CHUNK_BLOCKS * self.num_groups
        for lo in range(0, len(want), chunk):
            keys = [self.keyspaces[g].key(hashes[p]) for g, p in want[lo:lo + chunk]]
            calls.append((keys, [b.block_id for b in pages[lo:lo + chunk]]))
        handle = _AllOf(calls)
        if self.in_flight is None or not self.in_flight():
            handle.start(self.store, self.buffer, self.wake)
        self.pending[rid] = _Pending(req, "load", handle, n, want, end, pages, kept)
        self._loading[first] = rid
        self.counters["loads"] += 1
        return WAIT

    def _finish_load(self, req, st: _Pending) -> None:
        """The load ended: cache the loaded pages the longest hit they complete reads, then
        release every block the load held (the cached ones stay hittable)."""
        rid = req.request_id
        del self.pending[rid]
        self._loading.pop(req.block_hashes[st.start], None)
        got = {gp: t for gp, t in zip(st.want, st.handle.tiers()) if t is not None}
        hashes = req.block_hashes
        end = self.best_boundary(hashes, st.start, st.end, got) if got else st.start
        if end < st.end:
            self.counters["short_loads"] += 1
            self._short.add(rid)
        tiers: list[str] = []
        if end > st.start:
            need = self.kv.hit_positions(end)
            pages = [(g, p, b) for (g, p), b in zip(st.want, st.pages)
                     if (g, p) in got and p in need[g]]
            with self.stores.quiet():  # these pages came from a tier: nothing to write back
                self.kv.cache_loaded_pages(req, pages)
            self.counters["loaded_blocks"] += len(pages)
            if pages:
                by_pos: dict[int, str] = {}
                for g, p, _ in pages:
                    by_pos.setdefault(p, got[(g, p)])
                # Positions whose pages were all on the device count for the tier that
                # completed the hit (e.g. a state checkpoint at the boundary).
                last = got[(pages[-1][0], pages[-1][1])]
                tiers = [by_pos.get(p, last) for p in range(st.start, end)]
        self.hits.record_load(rid, st.start, tiers)
        self.kv.release_pages(list(reversed(st.blocks())))  # chain heads last: live longest
