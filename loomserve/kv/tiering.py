"""TierConnector: the device pool's link to the tiers below it (loomserve.tiers.TieredStore).

The scheduler asks, the data plane answers. The scheduler calls `prepare(req)` before admitting
a waiting request, `on_admit` when it admits one and `on_finish` before releasing one; the
engine calls `after_execute()` after each forward pass and `poll()` once per step (and while
idle). The connector never waits on tier I/O inside a step: it starts background operations
(TierHandles) and looks at them again on a later call.

Only full-attention groups are tiered: a page is a block's K/V, keyed by the layout fingerprint
and the block's chained hash. Models with sliding-window or state groups get no connector
(`tiers_supported`); their state checkpoints are not written down yet.

Store path. The pool emits BlockStored when a request's blocks are cached, which happens at
allocation, before the step that computes them. The connector only collects those events;
after the step ran it offers the pages (rows of the runner's kv_buffer) to the store and, while
the store's handle is pending (the rows are not snapshotted yet), holds one reference on each
block so its row cannot be handed out again. `poll()` drops the references of finished handles.
When a request of a session finishes, its cached blocks go to `on_session_pause`: written down
whatever their seen count, and remembered for a prefetch before the session's predicted return.

Load path, per waiting request (no state -> lookup -> load -> no state):
- prepare, no state: probe the device (n blocks hit). If more blocks could hit (the cap is
  prompt length - 1), lookup_async the keys of blocks [n, cap) and WAIT: the scheduler skips
  the request this step and goes on with the others.
- lookup done, k leading blocks found: probe the device again (n'), allocate blocks for
  [n', n + k) in one transaction with the device hit, without caching them, and load_async the
  pages into their rows; WAIT. A pool too full for that answers FULL (the scheduler stops
  admitting, as for any allocation failure) and the load is tried again next step.
- load done, j leading blocks loaded (noticed by `poll()`, whatever the request's place in the
  queue, so a full pool never waits on a loader the scheduler does not reach): cache exactly
  those j blocks under their hashes, then free the request's blocks. The loaded blocks stay in the pool as ordinary cached blocks; the
  unloaded ones are unhashed and reused first. GO: the scheduler's normal admission hits them
  on the device, so a short or failed load only means more recompute.

Invariants:
- A block is hashed (hittable) only once its row holds the data of its hash: computed by a step
  that ran, or loaded and checked by a tier.
- A row being loaded belongs to the loading request until its handle is done; if the request
  is aborted meanwhile, the connector holds a reference on the block until then.
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

import torch
import xxhash

from loomserve.kv.events import BlockStored
from loomserve.kv.pool import Block
from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig

log = logging.getLogger(__name__)

GO, WAIT, FULL = "go", "wait", "full"
MAX_ROUNDS = 2
PREFETCH_POLL_S = 0.02  # the prefetch predictor's due() scans every paused session
# A load is issued in chunks of this many blocks: each tier call is bounded by the store's
# op_timeout_s, and a long prefix in one call could exceed it and mark a healthy tier down.
LOAD_CHUNK_BLOCKS = 64


def tiers_supported(kv_config: KVCacheConfig) -> bool:
    """Whether every group is plain full attention (the only kind tiered so far)."""
    return all(type(g.spec) is FullAttentionSpec for g in kv_config.groups)


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


def build_tiered_store(config, page_bytes: int):
    """A TieredStore from EngineConfig's tier options (host -> disk -> remote), or None."""
    from loomserve.config import parse_memory
    from loomserve.tiers import DiskTier, HostTier, TieredStore
    tiers = []
    if config.host_cache_memory:
        tiers.append(HostTier(int(parse_memory(str(config.host_cache_memory))[1]), page_bytes))
    if config.disk_cache_dir:
        size = int(parse_memory(str(config.disk_cache_size))[1])
        tiers.append(DiskTier(config.disk_cache_dir, size, page_bytes))
    remote = config.remote_cache
    if remote:
        if remote.startswith("mooncake://"):
            from loomserve.tiers.mooncake_tier import MooncakeTier
            tiers.append(MooncakeTier(remote[len("mooncake://"):].rstrip("/"), page_bytes))
        else:
            from loomserve.tiers.redis_tier import RedisTier
            tiers.append(RedisTier(page_bytes, url=remote))
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
    """A request's tier I/O in flight: phase 'lookup' (keys of blocks [start, ...)) or 'load'
    (num blocks from block start)."""

    __slots__ = ("req", "phase", "handle", "start", "num")

    def __init__(self, req, phase: str, handle, start: int, num: int = 0) -> None:
        self.req = req
        self.phase = phase
        self.handle = handle
        self.start = start
        self.num = num


class TierConnector:
    def __init__(self, kv, store, kv_buffer: torch.Tensor, model_id: str,
                 max_inflight: int = 8) -> None:
        from loomserve.tiers import KeySpace, fingerprint_for
        if not tiers_supported(kv.config):
            raise ValueError("tiers support full-attention groups only")
        self.kv = kv
        self.pool = kv.pool
        self.store = store
        self.buffer = kv_buffer
        self.block_size = kv.block_size
        self.max_inflight = max_inflight
        self.keyspaces = [KeySpace(fingerprint_for(kv.config, model_id, g))
                          for g in range(len(kv.config.groups))]
        self.num_groups = len(self.keyspaces)
        self._all_indexed = all(t.index_in_memory for t in store.tiers)
        self._reqs: dict[str, _Pending] = {}
        self._rounds: dict[str, int] = {}
        # request id -> (first loaded block, tier of each loaded block), until admitted
        self._loaded: dict[str, tuple[int, list[str]]] = {}
        # hash of the first block of each load in flight -> the loading request: a second
        # request for the same prefix waits for that load instead of loading it again
        self._loading: dict[bytes, str] = {}
        self._stored: list[tuple[int, list[bytes]]] = []  # BlockStored of this step
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
        st = self._reqs.get(req.request_id)
        if st is None:
            if req.request_id in self._loaded:
                return GO  # its load finished (in poll): the device probe sees the pages
            return self._start_lookup(req)
        if not st.handle.done():
            return WAIT
        if st.phase == "lookup":
            return self._start_load(req, st)
        self._finish_load(req, st)
        return GO

    def _keys(self, req, start: int, end: int) -> list[bytes]:
        """Position-major keys of blocks [start, end) of every group."""
        hashes = req.block_hashes
        if self.num_groups == 1:
            return self.keyspaces[0].keys(hashes[start:end])
        return [ks.key(hashes[i]) for i in range(start, end) for ks in self.keyspaces]

    def _leading(self, tiers: list[str | None]) -> list[str]:
        """Tier of each leading block whose pages (one per group) were all found."""
        g = self.num_groups
        out = []
        for i in range(0, len(tiers), g):
            part = tiers[i:i + g]
            if any(t is None for t in part):
                break
            out.append(part[0])
        return out

    def _start_lookup(self, req) -> str:
        rid = req.request_id
        if self._rounds.get(rid, 0) >= MAX_ROUNDS:
            return GO
        bs = self.block_size
        _, n = self.kv.get_computed_blocks(req, record_stats=False)
        start, cap = n // bs, (len(req.all_token_ids) - 1) // bs
        if cap <= start:
            return GO
        keys = self._keys(req, start, cap)
        if self._surely_missing(keys[:self.num_groups]):
            return GO
        if len(self._reqs) >= self.max_inflight:
            return WAIT
        handle = self.store.lookup_async(keys)
        handle.add_done_callback(self._wake)
        self._reqs[rid] = _Pending(req, "lookup", handle, start)
        self._rounds[rid] = self._rounds.get(rid, 0) + 1
        self.counters["lookups"] += 1
        return WAIT

    def _surely_missing(self, first: list[bytes]) -> bool:
        """Whether the first block past the device hit is in no tier, known without I/O (every
        tier indexes its keys in memory). A new turn's first uncached block is usually new
        content, so this saves most requests a background lookup and a step of waiting."""
        if not self._all_indexed:
            return False
        return not any(any(t.contains(first)) for t in self.store.tiers)

    def _start_load(self, req, st: _Pending) -> str:
        rid = req.request_id
        found = self._leading(st.handle.result().tiers) if st.handle.ready() else []
        end = st.start + len(found)
        bs = self.block_size
        hit, n = self.kv.get_computed_blocks(req, record_stats=False)
        start = n // bs
        if start >= end:
            del self._reqs[rid]
            return GO
        first = req.block_hashes[start]
        if self._loading.get(first, rid) != rid:
            return WAIT  # the same prefix is being loaded for another request
        if not self.kv.allocate_slots(req, (end - start) * bs, hit, n, cache=False):
            return FULL  # keep the lookup result; try again next step
        ids = self.kv.get_block_ids(rid)
        handles, sizes = [], []
        for lo in range(start, end, LOAD_CHUNK_BLOCKS):
            hi = min(end, lo + LOAD_CHUNK_BLOCKS)
            rows = [ids[g][i] for i in range(lo, hi) for g in range(self.num_groups)]
            h = self.store.load_async(self._keys(req, lo, hi), self.buffer, rows)
            h.add_done_callback(self._wake)
            handles.append(h)
            sizes.append(len(rows))
        self._reqs[rid] = _Pending(req, "load", _AllOf(handles, sizes), start, end - start)
        self._loading[first] = rid
        self.counters["loads"] += 1
        return WAIT

    def _finish_load(self, req, st: _Pending) -> None:
        rid = req.request_id
        del self._reqs[rid]
        self._loading.pop(req.block_hashes[st.start], None)
        loaded = self._leading(st.handle.tiers())
        if len(loaded) < st.num:
            self.counters["short_loads"] += 1
        if loaded:
            self.counters["loaded_blocks"] += len(loaded)
            req.num_computed_tokens = (st.start + len(loaded)) * self.block_size
            self._collect = False  # these pages came from a tier: nothing to write back
            try:
                self.kv.allocate_slots(req, 0)  # caches exactly the loaded blocks; needs none
            finally:
                self._collect = True
        self._loaded[rid] = (st.start, loaded)
        self.kv.free(req)
        req.num_computed_tokens = 0

    def on_admit(self, req, num_hit_tokens: int) -> int:
        """req was admitted with a device hit of num_hit_tokens; returns how many of them its
        tier loads supplied (the rest were already on the device)."""
        entry = self._loaded.pop(req.request_id, None)
        tier_tokens = self._count_tier_tokens(entry, num_hit_tokens)
        self.hit_tokens["device"] += num_hit_tokens - tier_tokens
        if self.store.write_after_seen > 1 and num_hit_tokens:
            # A hit counts as seen again: offer the hit blocks after this step too.
            n = num_hit_tokens // self.block_size
            for g in range(self.num_groups):
                self._stored.append((g, req.block_hashes[:n]))
        return tier_tokens

    def _count_tier_tokens(self, entry, num_hit_tokens: int) -> int:
        if entry is None:
            return 0
        start, tiers = entry
        bs = self.block_size
        usable = max(0, min(len(tiers), num_hit_tokens // bs - start))
        for t in tiers[:usable]:
            self.hit_tokens[t] += bs
        return usable * bs

    def on_finish(self, req, aborted: bool) -> None:
        """Before the KV manager frees req (finished, aborted or preempted)."""
        rid = req.request_id
        self._rounds.pop(rid, None)
        self._loaded.pop(rid, None)
        st = self._reqs.pop(rid, None)
        if st is not None:
            if st.phase == "load":
                self._loading.pop(req.block_hashes[st.start], None)
            if st.phase == "load" and not st.handle.done():
                blocks = self.kv.coordinator.request_blocks(rid)
                held = [b for g in blocks for b in g[st.start:st.start + st.num]]
                self.pool.touch(held)
                self._held.append((st.handle, held))
            else:
                st.handle.cancel()
        if aborted or req.session_id is None:
            return
        blocks = self.kv.coordinator.request_blocks(rid)
        if blocks is None:
            return
        n = self.kv.coordinator.num_cached_blocks(rid)
        keys, rows, refs = [], [], []
        for g, ks in enumerate(self.keyspaces):
            for h, b in zip(req.block_hashes[:n], blocks[g][:n]):
                keys.append(ks.key(h))
                rows.append(b.block_id)
                refs.append(b)
        if not keys:
            return
        self.counters["session_pauses"] += 1
        store = self.store
        store.on_session_pause(keys, None, session_id=req.session_id)  # prefetch registry
        new = store.unwritten(keys)  # the rest is in the top tier or on its way down
        if new:
            self._hold(store.store([keys[i] for i in new], self.buffer, [rows[i] for i in new]),
                       [refs[i] for i in new])

    # -- engine side --------------------------------------------------------------------------
    def after_execute(self) -> None:
        """The step's blocks hold their data now: offer them to the store."""
        if not self._stored:
            return
        stored, self._stored = self._stored, []
        keys, rows, refs = [], [], []
        cached = self.pool.cached
        for g, hashes in stored:
            ks = self.keyspaces[g]
            get = cached[g].get
            for h in hashes:
                b = get(h)
                if b is not None:
                    keys.append(ks.key(h))
                    rows.append(b.block_id)
                    refs.append(b)
        if keys:
            self.counters["offered_blocks"] += len(keys)
            self._hold(self.store.offer(keys, self.buffer, rows), refs)

    def _hold(self, handle, blocks: list[Block]) -> None:
        if handle.done() or not blocks:
            return
        self.pool.touch(blocks)
        self._held.append((handle, blocks))

    def poll(self) -> None:
        """Once per step: finish the loads that are done (their blocks become cached and the
        request holds none, whatever its place in the queue: a full pool must not wait on a
        request the scheduler does not reach), release rows whose store/load finished, start
        due prefetches."""
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
