"""TierConnector: the device pool's link to the tiers below it (loomserve.kv.tiers.TieredStore).

The scheduler asks, the data plane answers. The scheduler calls `prepare(req)` before admitting
a waiting request, `on_admit` when it admits one and `on_finish` before releasing one; the
engine calls `after_execute()` after each forward pass and `poll()` once per step (and while
idle). The connector never waits on tier I/O inside a step: it starts background operations
(TierHandles) and looks at them again on a later call.

A page is one block's row of the runner's packed buffer, keyed per group (the layout
fingerprint of the group, then the block's chained hash): K/V of a full-attention or
sliding-window block, or a linear/SSM state checkpoint (keyed by the hash of the block it ends
at). Every group kind with a manager that says which pages a hit reads is tiered
(`tiers_supported`: full attention, sliding window, linear state).

Store path. The pool emits BlockStored when pages are cached: attention blocks at allocation,
before the step that computes them; state checkpoints once the step that saved them has run
(at the request's next allocation, or when it is freed). The connector only collects those
events; after the step ran (and, for checkpoints hashed by a free between steps, at the next
poll) it offers the pages to the store and, while the store's handle is pending (the rows are
not snapshotted yet), holds one reference on each block so its row cannot be handed out again.
`poll()` drops the references of finished handles. When a request of a session finishes, the
pages a hit at its end reads (every attention block, the last window, the state checkpoint) go
to `on_session_pause`: written down whatever their seen count, and remembered for a prefetch
before the session's predicted return.

Load path, per waiting request (no state -> lookup -> load -> no state). A hit of b blocks
needs, per group, the pages the device coordinator would read (KVCacheManager.hit_positions):
full attention all of [0, b), a sliding window the blocks of the last window before b, a state
group the checkpoint at b. The connector serves the largest b <= cap (prompt length - 1, in
blocks) for which every such page is on the device or in a tier.
- prepare, no state: probe the device (n blocks hit). If more could hit, lookup_async the
  pages not on the device that any b in (n, cap] reads and WAIT: the scheduler skips the
  request this step and goes on with the others.
- lookup done: probe the device again (n'), pick the largest b > n' whose pages are all on the
  device or found, take one reference on the device pages of that hit and allocate a fresh
  block for each missing page (KVCacheManager.claim_pages, all or nothing), and load_async
  the pages into their rows; WAIT. A pool too full for that answers FULL (the scheduler stops
  admitting, as for any allocation failure) and the load is tried again next step.
- load done (noticed by `poll()`, whatever the request's place in the queue, so a full pool
  never waits on a loader the scheduler does not reach): the largest b the loaded pages still
  complete (a page may have failed its checks) decides which loaded pages get cached under
  their hashes in their group's manager (KVCacheManager.cache_loaded_pages); then every block
  the load held is released. The cached pages stay in the pool as ordinary cached blocks; the
  others are unhashed and reused first. GO: the scheduler's normal admission hits them on the
  device, so a short or failed load only means more recompute. A short load first starts one
  more round (MAX_ROUNDS permitting): a tier drops a page that fails its checks, so the next
  lookup finds the longest boundary left (e.g. an earlier state checkpoint).

Invariants:
- A block is hashed (hittable) only once its row holds the data of its hash: computed by a step
  that ran, or loaded and checked by a tier.
- Rows being loaded belong to the connector until their handle is done, whatever happens to
  the request meanwhile (an aborted request's rows are held until then, and nothing of its
  load is cached).
- A row being stored is not reused before the store's handle is done.
- At most max_inflight requests have a lookup or load in flight; each request gets at most
  MAX_ROUNDS tier rounds per life (a pool that keeps evicting what was just loaded must not
  loop).
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from collections import defaultdict
from itertools import accumulate

import torch
import xxhash

from loomserve.config import TierConfig
from loomserve.kv.events import BlockStored
from loomserve.kv.pool import Block
from loomserve.kv.spec import KVCacheConfig

log = logging.getLogger(__name__)

GO, WAIT, FULL = "go", "wait", "full"
MAX_ROUNDS = 2
PREFETCH_POLL_S = 0.02  # the prefetch predictor's due() scans every paused session
# A load is issued in chunks of this many blocks: each tier call is bounded by the store's
# op_timeout_s, and a long prefix in one call could exceed it and mark a healthy tier down.
LOAD_CHUNK_BLOCKS = 64


# Layer kinds whose managers say which pages a hit reads (hit_positions) and how loaded pages
# become hittable (cache_loaded). A new kind is tiered once its manager does both.
TIERED_KINDS = frozenset({"full_attention", "sliding_window", "linear_state"})


def tiers_supported(kv_config: KVCacheConfig) -> bool:
    """Whether every group's layer kind can be tiered."""
    return all(g.spec.kind in TIERED_KINDS for g in kv_config.groups)


def model_identity(name: str, folder: str | None) -> str:
    """A cheap content identity of the weights for the tier fingerprint: the model name plus,
    per weight file, its name, size and digests of its first and last MiB (a safetensors header
    lists every tensor's offsets, so two checkpoints of one architecture differ there or in the
    data). Pages of different weights must never hit each other, even in a shared pool."""
    h = xxhash.xxh3_128()
    h.update(name.encode())
    files = []
    if folder and os.path.isdir(folder):
        for pat in ("*.safetensors", "*.gguf", "*.bin"):
            files += sorted(glob.glob(os.path.join(folder, pat)))
    elif folder and os.path.isfile(folder):
        files = [folder]
    for f in files:
        size = os.path.getsize(f)
        h.update(f"{os.path.basename(f)}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
    return f"{name}@{h.hexdigest()}"


def build_tiered_store(config: TierConfig, page_bytes: int):
    """A TieredStore from the tier config (host -> disk -> remote), or None."""
    from loomserve.kv.tiers import DiskTier, HostTier, TieredStore
    tiers = []
    if config.host_cache_memory:
        tiers.append(HostTier(config.host_cache_memory, page_bytes))
    if config.disk_cache_dir:
        tiers.append(DiskTier(config.disk_cache_dir, config.disk_cache_size, page_bytes))
    if config.remote_scheme == "mooncake":
        from loomserve.kv.tiers.mooncake_tier import MooncakeTier
        tiers.append(MooncakeTier(config.remote_address, page_bytes))
    elif config.remote_scheme == "redis":
        from loomserve.kv.tiers.redis_tier import RedisTier
        tiers.append(RedisTier(page_bytes, url=config.remote_cache))
    if not tiers:
        return None
    return TieredStore(tiers, write_after_seen=config.tier_write_after_seen)


class _AllOf:
    """Several load handles seen as one: done when all are; its tiers are the chunks' tiers
    in order (a failed chunk counts as not loaded)."""

    __slots__ = ("handles", "sizes")

    def __init__(self, handles: list, sizes: list[int]) -> None:
        self.handles = handles
        self.sizes = sizes

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

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


class TierConnector:
    def __init__(self, kv, store, kv_buffer: torch.Tensor, model_id: str,
                 max_inflight: int = 8) -> None:
        from loomserve.kv.tiers import KeySpace, fingerprint_for
        if not tiers_supported(kv.config):
            kinds = sorted({g.spec.kind for g in kv.config.groups} - TIERED_KINDS)
            raise ValueError(f"no tier support for layer kinds {kinds}")
        self.kv = kv
        self.pool = kv.pool
        self.store = store
        self.buffer = kv_buffer
        self.block_size = kv.block_size
        self.max_inflight = max_inflight
        self.keyspaces = [KeySpace(fingerprint_for(kv.config, model_id, g))
                          for g in range(len(kv.config.groups))]
        self.num_groups = len(self.keyspaces)
        # Groups whose pages grow with tokens (attention): their page at the first position
        # past the device hit is what the in-memory "surely missing" check looks at.
        self._token_groups = [m.token_blocks for m in kv.coordinator.managers]
        self._prefix_closed = [m.prefix_closed_hits for m in kv.coordinator.managers]
        self._all_indexed = all(t.index_in_memory for t in store.tiers)
        self._reqs: dict[str, _Pending] = {}
        self._rounds: dict[str, int] = {}
        # request id -> (first loaded block, tier of each loaded block), until admitted
        self._loaded: dict[str, tuple[int, list[str]]] = {}
        # requests whose last load came up short (a page missing or failing its checks): their
        # next prepare starts another round (MAX_ROUNDS permitting) instead of admitting
        self._short: set[str] = set()
        # hash of the first block of each load in flight -> the loading request: a second
        # request for the same prefix waits for that load instead of loading it again
        self._loading: dict[bytes, str] = {}
        self._stored: list[tuple[int, list[bytes]]] = []  # BlockStored since the last offer
        # (group, hash) of pages a pausing session needs that get hashed only when its request
        # is freed (state checkpoints): stored whatever their seen count once they are.
        self._pause_pending: set[tuple[int, bytes]] = set()
        self._collect = True
        self._held: list[tuple[object, list[Block]]] = []  # (handle, blocks referenced)
        self._io_done = threading.Event()
        # Prefetch brings pages up into host memory: only useful with a host tier above others.
        self._prefetching = store.host is not None and bool(store.lower)
        self._next_prefetch = 0.0
        # Served prefix tokens by source, "device" or a tier's name, counted once per admission
        # (the KV manager's own counters also count probes whose allocation failed).
        self.hit_tokens: dict[str, int] = defaultdict(int)
        self.counters = {"lookups": 0, "loads": 0, "loaded_blocks": 0, "short_loads": 0,
                         "offered_blocks": 0, "session_pauses": 0}
        kv.subscribe(self._on_event)

    # -- events (engine thread, inside allocate_slots) ---------------------------------------
    def _on_event(self, event) -> None:
        if self._collect and isinstance(event, BlockStored):
            self._stored.append((event.group_id, event.block_hashes))

    # -- scheduler side ----------------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        return len(self._reqs)

    def on_add(self, req) -> None:
        if req.session_id is not None:
            self.store.on_session_resume(req.session_id)

    def prepare(self, req) -> str:
        """GO: admit req normally (its device probe now sees whatever the tiers gave);
        WAIT: skip it this step; FULL: the pool cannot take its tier blocks now."""
        rid = req.request_id
        st = self._reqs.get(rid)
        if st is None:
            if rid in self._loaded and rid not in self._short:
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

    def _probe(self, req) -> tuple[int, int]:
        """(device hit, cap) in blocks; the cap is prompt length - 1."""
        _, n = self.kv.get_computed_blocks(req, record_stats=False)
        return n // self.block_size, (len(req.all_token_ids) - 1) // self.block_size

    def _wanted(self, hashes: list[bytes], n: int, cap: int) -> list[tuple[int, int]]:
        """(group, position) of every page not on the device that a hit of b blocks, n < b <=
        cap, could read. Each group's pages for b form a range ending at b whose start grows
        with b, so b = n + 1 gives the lowest position."""
        cached = self.pool.cached
        out = []
        for g, r in enumerate(self.kv.hit_positions(n + 1)):
            have = cached[g]
            out += [(g, p) for p in range(r.start, cap) if hashes[p] not in have]
        return out

    def _best_boundary(self, hashes: list[bytes], n: int, cap: int,
                       extra: set | dict) -> int:
        """The largest b, n < b <= cap, such that every group's pages for a hit of b blocks are
        cached on the device or in extra ((group, position) pairs): the coordinator's fixed
        point over device + tier pages. n when there is none."""
        kv = self.kv
        cached = self.pool.cached
        lows = [r.start for r in kv.hit_positions(n + 1)]
        avail = []  # per group: is the page at position lows[g] + i on the device or in extra
        upper = cap
        for g, lo in enumerate(lows):
            have = cached[g]
            a = [hashes[p] in have or (g, p) in extra for p in range(lo, cap)]
            avail.append(a)
            if self._prefix_closed[g] and False in a:  # a hit of b reads all of [0, b)
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

    def _start_lookup(self, req) -> str:
        rid = req.request_id
        if self._rounds.get(rid, 0) >= MAX_ROUNDS:
            return GO
        n, cap = self._probe(req)
        if cap <= n:
            return GO
        hashes = req.block_hashes
        want = self._wanted(hashes, n, cap)
        if not want or self._surely_missing(hashes, n, want):
            return GO
        if len(self._reqs) >= self.max_inflight:
            return WAIT
        keys = [self.keyspaces[g].key(hashes[p]) for g, p in want]
        handle = self.store.lookup_async(keys)
        handle.add_done_callback(self._wake)
        self._reqs[rid] = _Pending(req, "lookup", handle, n, want)
        self._rounds[rid] = self._rounds.get(rid, 0) + 1
        self.counters["lookups"] += 1
        return WAIT

    def _surely_missing(self, hashes: list[bytes], n: int, want: list[tuple[int, int]]) -> bool:
        """Whether no tier can extend the device hit, known without I/O (every tier indexes
        its keys in memory): an attention group's page at the first position past the device
        hit is in no tier. A new turn's first uncached block is usually new content, so this
        saves most requests a background lookup and a step of waiting. Exact for full
        attention (every longer hit reads that page); for a sliding window a longer hit could
        skip it, which only costs a recompute. Without such a page (the device holds the
        attention blocks, a state checkpoint is missing) the tiers are asked."""
        if not self._all_indexed:
            return False
        first = [self.keyspaces[g].key(hashes[p]) for g, p in want
                 if p == n and self._token_groups[g]]
        if not first:
            return False
        found = [False] * len(first)
        for t in self.store.tiers:
            found = [f or c for f, c in zip(found, t.contains(first))]
        return not all(found)

    def _start_load(self, req, st: _Pending) -> str:
        rid = req.request_id
        found = set()
        if st.handle.ready():
            found = {gp for gp, t in zip(st.want, st.handle.result().tiers) if t is not None}
        n, cap = self._probe(req)
        hashes = req.block_hashes
        end = self._best_boundary(hashes, n, cap, found) if found else n
        if end <= n:
            del self._reqs[rid]
            return GO
        first = hashes[n]
        if self._loading.get(first, rid) != rid:
            return WAIT  # the same prefix is being loaded for another request
        want, kept = [], []
        cached = self.pool.cached
        for g, r in enumerate(self.kv.hit_positions(end)):
            get = cached[g].get
            for p in r:
                b = get(hashes[p])
                if b is None:
                    want.append((g, p))  # in found: _best_boundary checked
                else:
                    kept.append((p, b))
        want.sort(key=lambda gp: (gp[1], gp[0]))
        kept_blocks = [b for _, b in kept]
        pages = self.kv.claim_pages(kept_blocks, len(want))
        if pages is None:
            if len(want) + len(kept) > self.pool.num_usable:
                del self._reqs[rid]  # could never fit: recompute instead
                return GO
            return FULL  # keep the lookup result; try again next step
        handles, sizes = [], []
        chunk = LOAD_CHUNK_BLOCKS * self.num_groups
        for lo in range(0, len(want), chunk):
            part = want[lo:lo + chunk]
            keys = [self.keyspaces[g].key(hashes[p]) for g, p in part]
            rows = [b.block_id for b in pages[lo:lo + chunk]]
            h = self.store.load_async(keys, self.buffer, rows)
            h.add_done_callback(self._wake)
            handles.append(h)
            sizes.append(len(part))
        self._reqs[rid] = _Pending(req, "load", _AllOf(handles, sizes), n, want, end, pages,
                                   kept)
        self._loading[first] = rid
        self.counters["loads"] += 1
        return WAIT

    def _finish_load(self, req, st: _Pending) -> None:
        """The load ended: cache the loaded pages the longest hit they complete reads, then
        release every block the load held (the cached ones stay hittable)."""
        rid = req.request_id
        del self._reqs[rid]
        self._loading.pop(req.block_hashes[st.start], None)
        got = {gp: t for gp, t in zip(st.want, st.handle.tiers()) if t is not None}
        hashes = req.block_hashes
        end = self._best_boundary(hashes, st.start, st.end, got) if got else st.start
        if end < st.end:
            self.counters["short_loads"] += 1
            self._short.add(rid)
        tiers: list[str] = []
        if end > st.start:
            need = self.kv.hit_positions(end)
            pages = [(g, p, b) for (g, p), b in zip(st.want, st.pages)
                     if (g, p) in got and p in need[g]]
            self._collect = False  # these pages came from a tier: nothing to write back
            try:
                self.kv.cache_loaded_pages(req, pages)
            finally:
                self._collect = True
            self.counters["loaded_blocks"] += len(pages)
            if pages:
                by_pos: dict[int, str] = {}
                for g, p, _ in pages:
                    by_pos.setdefault(p, got[(g, p)])
                # Positions whose pages were all on the device count for the tier that
                # completed the hit (e.g. a state checkpoint at the boundary).
                last = got[(pages[-1][0], pages[-1][1])]
                tiers = [by_pos.get(p, last) for p in range(st.start, end)]
        prev = self._loaded.get(rid)
        if prev is not None and st.start <= prev[0] + len(prev[1]):  # an earlier round's load
            tiers = prev[1][:max(0, st.start - prev[0])] + tiers
            self._loaded[rid] = (min(prev[0], st.start), tiers)
        else:
            self._loaded[rid] = (st.start, tiers)
        self.kv.release_pages(list(reversed(st.blocks())))  # chain heads last: live longest

    def on_admit(self, req, num_hit_tokens: int, count: bool = True) -> int:
        """req was admitted with a device hit of num_hit_tokens; returns how many of them its
        tier loads supplied (the rest were already on the device). count=False: a re-admission
        (after a preemption), left out of the hit counters."""
        entry = self._loaded.pop(req.request_id, None)
        self._short.discard(req.request_id)
        tier_tokens = self._count_tier_tokens(entry, num_hit_tokens, count)
        if count:
            self.hit_tokens["device"] += num_hit_tokens - tier_tokens
        if self.store.write_after_seen > 1 and num_hit_tokens:
            # A hit counts as seen again: offer the hit blocks after this step too.
            n = num_hit_tokens // self.block_size
            for g in range(self.num_groups):
                self._stored.append((g, req.block_hashes[:n]))
        return tier_tokens

    def _count_tier_tokens(self, entry, num_hit_tokens: int, count: bool = True) -> int:
        if entry is None:
            return 0
        start, tiers = entry
        bs = self.block_size
        usable = max(0, min(len(tiers), num_hit_tokens // bs - start))
        if count:
            for t in tiers[:usable]:
                self.hit_tokens[t] += bs
        return usable * bs

    def on_finish(self, req, aborted: bool) -> None:
        """Before the KV manager frees req (finished or aborted)."""
        rid = req.request_id
        self._rounds.pop(rid, None)
        self._loaded.pop(rid, None)
        self._short.discard(rid)
        st = self._reqs.pop(rid, None)
        if st is not None:
            if st.phase == "load":
                self._loading.pop(req.block_hashes[st.start], None)
                if st.handle.done():
                    self.kv.release_pages(list(reversed(st.blocks())))
                else:  # the rows are still being written: hold them until the load ends
                    self._held.append((st.handle, st.blocks()))
            else:
                st.handle.cancel()
        if aborted or req.session_id is None:
            return
        coord = self.kv.coordinator
        if coord.block_ids(rid) is None:
            return
        # The pages a hit at the end of this turn reads (attention blocks, the last window,
        # the state checkpoint at the boundary).
        end = coord.hit_boundary(rid)
        hashes = req.block_hashes
        cached = self.pool.cached
        all_keys, keys, rows, refs = [], [], [], []
        for g, r in enumerate(self.kv.hit_positions(end)):
            ks, get = self.keyspaces[g], cached[g].get
            for p in r:
                k = ks.key(hashes[p])
                all_keys.append(k)
                b = get(hashes[p])
                if b is None:  # a checkpoint hashed when req is freed, right after this
                    self._pause_pending.add((g, hashes[p]))
                else:
                    keys.append(k)
                    rows.append(b.block_id)
                    refs.append(b)
        if not all_keys:
            return
        self.counters["session_pauses"] += 1
        store = self.store
        store.on_session_pause(all_keys, None, session_id=req.session_id)  # prefetch registry
        new = store.unwritten(keys)  # the rest is in the top tier or on its way down
        if new:
            self._hold(store.store([keys[i] for i in new], self.buffer, [rows[i] for i in new]),
                       [refs[i] for i in new])

    # -- engine side --------------------------------------------------------------------------
    def after_execute(self) -> None:
        """The step's blocks hold their data now: offer them to the store."""
        self._offer_stored()

    def _offer_stored(self) -> None:
        """Offer the pages of the BlockStored events collected since the last call. Called
        after each forward pass (attention blocks are hashed when allocated, before the step
        that computes them) and at the start of poll() (events of frees between steps: state
        checkpoints hashed when their request ends, whose step has run)."""
        pending, self._pause_pending = self._pause_pending, set()
        if not self._stored:
            return
        stored, self._stored = self._stored, []
        keys, rows, refs = [], [], []
        must = ([], [], [])  # a pausing session's pages: stored whatever their seen count
        cached = self.pool.cached
        for g, hashes in stored:
            ks = self.keyspaces[g]
            get = cached[g].get
            for h in hashes:
                b = get(h)
                if b is not None:
                    out = must if pending and (g, h) in pending else (keys, rows, refs)
                    out[0].append(ks.key(h))
                    out[1].append(b.block_id)
                    out[2].append(b)
        if keys:
            self.counters["offered_blocks"] += len(keys)
            self._hold(self.store.offer(keys, self.buffer, rows), refs)
        if must[0]:
            new = self.store.unwritten(must[0])
            if new:
                self._hold(self.store.store([must[0][i] for i in new], self.buffer,
                                            [must[1][i] for i in new]),
                           [must[2][i] for i in new])

    def _hold(self, handle, blocks: list[Block]) -> None:
        if handle.done() or not blocks:
            return
        self.pool.touch(blocks)
        self._held.append((handle, blocks))

    def poll(self) -> None:
        """Once per step: offer pages hashed since the last step, finish the loads that are
        done (their pages become cached and the connector holds none, whatever the request's
        place in the queue: a full pool must not wait on a request the scheduler does not
        reach), release rows whose store/load finished, start due prefetches."""
        self._offer_stored()
        for st in [st for st in self._reqs.values() if st.phase == "load" and st.handle.done()]:
            self._finish_load(st.req, st)
        if self._held:
            keep = []
            for handle, blocks in self._held:
                if handle.done():
                    self.pool.free(reversed(blocks))  # chain heads last: they live longest
                else:
                    keep.append((handle, blocks))
            self._held = keep
        if self._prefetching:
            now = time.monotonic()
            if now >= self._next_prefetch:
                self._next_prefetch = now + PREFETCH_POLL_S
                self.store.poll_prefetch()

    def _wake(self, _handle) -> None:
        self._io_done.set()

    def wait_io(self, timeout: float) -> None:
        """Nothing else to do this step: sleep until some tier I/O finishes (or timeout)."""
        if self._reqs:
            self._io_done.wait(timeout)
        self._io_done.clear()

    @property
    def num_held_blocks(self) -> int:
        return sum(len(b) for _, b in self._held)

    def hit_tokens_by_source(self) -> dict[str, int]:
        return {"device": 0, **self.hit_tokens}

    def stats(self) -> dict:
        """Connector counters and each tier's counters and health (cheap: no histograms)."""
        return {"connector": {**self.counters, "inflight": len(self._reqs),
                              "held_blocks": self.num_held_blocks},
                "store": dict(self.store.counters),
                "tiers": {t.name: {"healthy": t.stats.healthy, **t.stats.counters}
                          for t in self.store.tiers}}

    def close(self) -> None:
        self.store.close()
