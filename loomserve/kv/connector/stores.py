"""The store side: computed pages go down to the tiers, and their rows are kept until copied.

StoreSide collects the pool's BlockStored events and offers those pages to the store once the
step that computed them has run; when a request of a session finishes, it writes down the
pages a hit at its end reads and registers them for a prefetch before the session returns.
When each offer happens and the session write-down: docs/design/tiers.md.

Under async scheduling (TierConnector.pace) a page may be hashed before the step that writes it
has run: blocks are hashed when allocated for the step about to start, and the update of step N
hashes (and a finish writes down) blocks whose last row step N+1, in flight, writes. Such pages
are collected with a reference held (so their rows keep their hashes) and offered only once
every step that could write them is done: after the next swap returns the step that was in
flight, or as soon as none is.

Invariants:
- A row being stored is not reused before the store's handle is done: one reference per block
  is held (hold) and dropped by release_done once the handle is.
- A page is copied only after the step that writes its row has run (with or without async
  scheduling).
- Pages loaded from a tier are not offered back (quiet() while they are cached).
- The pool is reached through the KV manager's facade only.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable

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
        # Async scheduling: whether a step is in flight (None: synchronous steps). Pages
        # (group, hash, block referenced, a pausing session's) wait in _fresh while a step
        # that may write them runs, then in _due until the swap that returns it.
        self.in_flight: Callable[[], bool] | None = None
        self._scheduling = False  # between poll() and after_execute(): hashes for the next step
        self._fresh: list[tuple[int, bytes, Block, bool]] = []
        self._due: list[tuple[int, bytes, Block, bool]] = []
        kv.subscribe(self._on_event)

    # -- events (engine thread, inside allocate_slots or free) -------------------------------
    def _on_event(self, event) -> None:
        if self._collect and isinstance(event, BlockStored):
            self._note(event.group_id, event.block_hashes)

    def _note(self, group: int, hashes: list[bytes]) -> None:
        """Pages to offer once their step has run: at the next offer, or held until then."""
        if not self._deferring():
            self._stored.append((group, hashes))
            return
        pending = self._pause_pending
        blocks = [b for b in self.kv.cached_blocks(group, hashes) if b is not None]
        self.kv.hold_blocks(blocks)
        self._fresh += [(group, b.block_hash, b, (group, b.block_hash) in pending)
                        for b in blocks]

    def _deferring(self) -> bool:
        """Async scheduling, and a step that may write pages hashed now is in flight or being
        scheduled (after the update of a swap that left none in flight, every step has run)."""
        return self.in_flight is not None and (self._scheduling or self.in_flight())

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
                self._note(g, req.block_hashes[:n])

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
        if self._deferring():  # its last row may be the step in flight's: write it after
            self.kv.hold_blocks(refs)
            self._fresh += [(b.group_id, b.block_hash, b, True) for b in refs]
            return
        self._write([(k, b, True) for k, b in zip(keys, refs)], held=False)

    # -- when pages are offered ---------------------------------------------------------------
    def after_execute(self) -> None:
        """A step ran: offer what it computed. Under async scheduling the swap started the next
        step first: offer the pages held for the step it returned, and hold the ones collected
        since (hashed for the step now in flight) until the next swap returns that one."""
        self.offer_stored()
        if self.in_flight is None:
            return
        self._scheduling = False
        if self.in_flight():
            ready, self._due, self._fresh = self._due, self._fresh, []
            self._offer_held(ready)
        else:  # every step scheduled so far has run
            self._offer_all_held()

    def before_schedule(self) -> None:
        """At the start of each step and while idle: offer what was hashed since the last
        offer (state checkpoints hashed when their request ends, whose step has run). Under
        async scheduling only with no step in flight, and then everything held as well."""
        if self.in_flight is None:
            self.offer_stored()
            return
        if not self.in_flight():
            self.offer_stored()
            self._offer_all_held()
        self._scheduling = True

    def offer_stored(self) -> None:
        """Offer the pages of the BlockStored events collected since the last call. Called
        after each forward pass (attention blocks are hashed when allocated, before the step
        that computes them) and at the start of poll() (events of frees between steps: state
        checkpoints hashed when their request ends, whose step has run)."""
        pending, self._pause_pending = self._pause_pending, set()
        if not self._stored:
            return
        stored, self._stored = self._stored, []
        pages = []
        for g, hashes in stored:
            ks = self.keyspaces[g]
            pages += [(ks.key(h), b, bool(pending) and (g, h) in pending)
                      for h, b in zip(hashes, self.kv.cached_blocks(g, hashes)) if b is not None]
        self._write(pages, held=False)

    def _offer_all_held(self) -> None:
        """No step in flight: every page held for one has been written."""
        ready, self._due, self._fresh = self._due + self._fresh, [], []
        self._offer_held(ready)

    def _offer_held(self, pages: list[tuple[int, bytes, Block, bool]]) -> None:
        """Offer pages collected with a reference held (async scheduling)."""
        if pages:
            self._write([(self.keyspaces[g].key(h), b, m) for g, h, b, m in pages], held=True)

    def _write(self, pages: list[tuple[bytes, Block, bool]], held: bool) -> None:
        """Offer (key, block, must) pages to the store; a `must` page (a pausing session's) is
        stored whatever its seen count, unless the top tier has it or it is on its way. held:
        a reference per page is held already (async scheduling) and passes to its copy or is
        dropped; else each copy takes one."""
        keep = self._pass if held else self.hold
        plain = [(k, b) for k, b, m in pages if not m]
        must = [(k, b) for k, b, m in pages if m]
        if plain:
            self.counters["offered_blocks"] += len(plain)
            keep(self.store.offer([k for k, _ in plain], self.buffer,
                                  [b.block_id for _, b in plain]), [b for _, b in plain])
        if not must:
            return
        new = self.store.unwritten([k for k, _ in must])
        if held:
            skip = set(new)
            self.kv.release_pages([b for i, (_, b) in reversed(list(enumerate(must)))
                                   if i not in skip])
        if new:
            keep(self.store.store([must[i][0] for i in new], self.buffer,
                                  [must[i][1].block_id for i in new]), [must[i][1] for i in new])

    def _pass(self, handle, blocks: list[Block]) -> None:
        """References already held: kept until handle is done, or dropped now if it is."""
        if handle.done():
            self.kv.release_pages(reversed(blocks))
        elif blocks:
            self._held.append((handle, blocks))

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
        return sum(len(b) for _, b in self._held) + len(self._fresh) + len(self._due)

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
