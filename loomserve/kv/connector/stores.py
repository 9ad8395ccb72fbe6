"""The store side: computed pages go down to the tiers, and their rows are kept until copied.

StoreSide collects the pool's BlockStored events and offers those pages to the store once the
step that computed them has run; when a request of a session finishes, it writes down the
pages a hit at its end reads and registers them for a prefetch before the session returns.
When each offer happens and the session write-down: docs/design/tiers.md.

Invariants:
- A row being stored is not reused before the store's handle is done: one reference per block
  is held (hold) and dropped by release_done once the handle is.
- Pages loaded from a tier are not offered back (quiet() while they are cached).
- The pool is reached through the KV manager's facade only.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from loomserve.kv.connector.hits import HitAccounting
from loomserve.kv.events import BlockStored
from loomserve.kv.pool import Block

PREFETCH_POLL_S = 0.02  # the prefetch predictor's due() scans every paused session


class StoreSide:
    def __init__(self, kv, store, buffer: torch.Tensor, keyspaces: list,
                 hits: HitAccounting) -> None:
        self.kv = kv
        self.store = store
        self.buffer = buffer
        self.keyspaces = keyspaces
        self.counters = hits.counters
        self._stored: list[tuple[int, list[bytes]]] = []  # BlockStored since the last offer
        # (group, hash) of pages a pausing session needs that get hashed only when its request
        # is freed (state checkpoints): stored whatever their seen count once they are.
        self._pause_pending: set[tuple[int, bytes]] = set()
        self._collect = True
        self._held: list[tuple[object, list[Block]]] = []  # (handle, blocks referenced)
        # Prefetch brings pages up into host memory: only useful with a host tier above others.
        self.prefetching = store.host is not None and bool(store.lower)
        self._next_prefetch = 0.0
        kv.subscribe(self._on_event)

    # -- events (engine thread, inside allocate_slots or free) -------------------------------
    def _on_event(self, event) -> None:
        if self._collect and isinstance(event, BlockStored):
            self._stored.append((event.group_id, event.block_hashes))

    @contextmanager
    def quiet(self):
        """Pages cached inside came from a tier: nothing to write back."""
        self._collect = False
        try:
            yield
        finally:
            self._collect = True

    def on_hit(self, req, num_hit_tokens: int) -> None:
        """req was admitted with a device hit: with write_after_seen > 1 the hit counts as
        seen again, so its blocks are offered after this step too."""
        if self.store.write_after_seen > 1 and num_hit_tokens:
            n = num_hit_tokens // self.kv.block_size
            for g in range(len(self.keyspaces)):
                self._stored.append((g, req.block_hashes[:n]))

    # -- writes ------------------------------------------------------------------------------
    def on_session_pause(self, req) -> None:
        """A request of a session finished (before the KV manager frees it): write the pages
        a hit at the end of this turn reads (attention blocks, the last window, the state
        checkpoint at the boundary) down, and register them for a prefetch."""
        kv = self.kv
        end = kv.hit_boundary(req.request_id)
        if end is None:
            return
        hashes = req.block_hashes
        all_keys, keys, rows, refs = [], [], [], []
        for g, r in enumerate(kv.hit_positions(end)):
            ks = self.keyspaces[g]
            for p, b in zip(r, kv.cached_blocks(g, hashes[r.start:r.stop])):
                k = ks.key(hashes[p])
                all_keys.append(k)
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
        self._store_unwritten(keys, rows, refs)  # the rest is in the top tier or on its way

    def offer_stored(self) -> None:
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
        for g, hashes in stored:
            ks = self.keyspaces[g]
            for h, b in zip(hashes, self.kv.cached_blocks(g, hashes)):
                if b is not None:
                    out = must if pending and (g, h) in pending else (keys, rows, refs)
                    out[0].append(ks.key(h))
                    out[1].append(b.block_id)
                    out[2].append(b)
        if keys:
            self.counters["offered_blocks"] += len(keys)
            self.hold(self.store.offer(keys, self.buffer, rows), refs)
        if must[0]:
            self._store_unwritten(*must)

    def _store_unwritten(self, keys: list[bytes], rows: list[int], refs: list[Block]) -> None:
        new = self.store.unwritten(keys) if keys else []
        if new:
            self.hold(self.store.store([keys[i] for i in new], self.buffer,
                                       [rows[i] for i in new]),
                      [refs[i] for i in new])

    # -- rows held while a tier copies them -------------------------------------------------
    def hold(self, handle, blocks: list[Block]) -> None:
        """Reference blocks until handle is done (their rows are being copied out)."""
        if handle.done() or not blocks:
            return
        self.kv.hold_blocks(blocks)
        self._held.append((handle, blocks))

    def keep(self, handle, blocks: list[Block]) -> None:
        """Take over references already held (an aborted load's rows, still being written)
        until handle is done."""
        self._held.append((handle, blocks))

    def release_done(self) -> None:
        if not self._held:
            return
        keep = []
        for handle, blocks in self._held:
            if handle.done():
                self.kv.release_pages(reversed(blocks))  # chain heads last: live longest
            else:
                keep.append((handle, blocks))
        self._held = keep

    @property
    def num_held_blocks(self) -> int:
        return sum(len(b) for _, b in self._held)

    # -- prefetch ----------------------------------------------------------------------------
    def poll_prefetch(self) -> None:
        """Start the prefetches the store's think-time predictors say are due (rate-limited)."""
        if self.prefetching:
            now = time.monotonic()
            if now >= self._next_prefetch:
                self._next_prefetch = now + PREFETCH_POLL_S
                self.store.poll_prefetch()

    def bring_forward(self, session_id: str) -> None:
        """Start the session's prefetch now, if its pause still has pages to fetch (see
        TierConnector.on_finish: a subagent reported back, its parent returns next)."""
        if not self.prefetching:
            return
        entry = self.store.sessions.paused.get(session_id)
        if entry is not None and entry[1]:
            self.store.prefetch(session_id, entry[1])
