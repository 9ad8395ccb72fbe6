"""TierConnector: the device pool's link to the tiers below it (loomserve.kv.tiers.TieredStore).

The scheduler asks (`prepare`: GO / WAIT / FULL; `on_add` / `on_admit` / `on_finish`), the
engine calls `after_execute()` after each forward pass and `poll()` once per step and while
idle; each call goes to the part that owns it: loads.py (scheduler side), stores.py (store
side), hits.py (accounting), factory.py (setup). The contract and the parts: docs/design/tiers.md.

Invariants:
- A block is hashed (hittable) only once its row holds the data of its hash.
- A row being loaded or stored is not reused before its handle is done.
- Tier I/O never blocks a step; the pool is reached through the KVCacheManager facade only.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from loomserve.kv.connector.factory import (
    TIERED_KINDS,
    build_tiered_store,
    model_identity,
    tiers_supported,
)
from loomserve.kv.connector.hits import HitAccounting
from loomserve.kv.connector.loads import FULL, GO, WAIT, LoadSide
from loomserve.kv.connector.stores import StoreSide

# Tunables (MAX_ROUNDS, LOAD_CHUNK_BLOCKS, TIERED_KINDS) are read from their own modules:
# patch them there (loads, factory), not here.
__all__ = ["FULL", "GO", "TIERED_KINDS", "WAIT", "TierConnector", "build_tiered_store",
           "model_identity", "tiers_supported"]


class TierConnector:
    """The one object the engine talks to; it routes each call to the side that owns it.

    Subagents (parent_session_id set): the parent session is waiting for its subagent, not
    back. Its arrival is not the parent's return, so the store is not told the parent resumed
    (that would drop the prefetch planned for the parent's pause and teach its think-time
    predictor a gap that is the subagent's start, not the parent's think time). When a
    subagent request finishes, the parent's planned prefetch is brought forward (started now,
    if its pages were not fetched yet): the parent's next turn follows its subagents' reports,
    which no think-time prediction of the parent can foresee. While the subagent is in the
    engine the KV manager also keeps the parent's session pin alive (kv.retention)."""

    def __init__(self, kv, store, kv_buffer: torch.Tensor, model_id: str,
                 max_inflight: int = 8) -> None:
        from loomserve.kv.tiers import KeySpace, fingerprint_for
        if not tiers_supported(kv.config):
            kinds = sorted({g.spec.kind for g in kv.config.groups} - TIERED_KINDS)
            raise ValueError(f"no tier support for layer kinds {kinds}")
        self.kv = kv
        self.store = store
        self.buffer = kv_buffer
        self.keyspaces = [KeySpace(fingerprint_for(kv.config, model_id, g))
                          for g in range(len(kv.config.groups))]
        self.hits = HitAccounting(kv.block_size)
        self.stores = StoreSide(kv, store, kv_buffer, self.keyspaces, self.hits)
        self._io_done = threading.Event()
        self.loads = LoadSide(kv, store, kv_buffer, self.keyspaces, self.hits, self.stores,
                              self._wake, max_inflight)

    @property
    def counters(self) -> dict[str, int]:
        return self.hits.counters

    @property
    def hit_tokens(self) -> dict[str, int]:
        return self.hits.hit_tokens

    @property
    def num_inflight(self) -> int:
        return len(self.loads.pending)

    @property
    def num_held_blocks(self) -> int:
        return self.stores.num_held_blocks

    # -- scheduler side ----------------------------------------------------------------------
    def on_add(self, req) -> None:
        if req.session_id is not None:
            self.store.on_session_resume(req.session_id)

    def prepare(self, req) -> str:
        """GO: admit req normally (its device probe now sees whatever the tiers gave);
        WAIT: skip it this step; FULL: the pool cannot take its tier blocks now."""
        return self.loads.prepare(req)

    def on_admit(self, req, num_hit_tokens: int, count: bool = True) -> int:
        """req was admitted with a device hit of num_hit_tokens; returns how many of them its
        tier loads supplied (the rest were already on the device). count=False: a re-admission
        (after a preemption), left out of the hit counters."""
        self.loads.on_admit(req.request_id)
        tier_tokens = self.hits.on_admit(req.request_id, num_hit_tokens, count)
        self.stores.on_hit(req, num_hit_tokens)
        return tier_tokens

    def on_finish(self, req, aborted: bool) -> None:
        """Before the KV manager frees req (finished or aborted)."""
        self.loads.on_finish(req)
        self.hits.forget(req.request_id)
        if aborted:
            return
        if req.session_id is not None:
            self.stores.on_session_pause(req)
        parent = getattr(req, "parent_session_id", None)
        if parent is not None and parent != req.session_id:
            self.stores.bring_forward(parent)

    # -- engine side --------------------------------------------------------------------------
    def pace(self, in_flight: Callable[[], bool]) -> None:
        """Async scheduling (EngineCore): in_flight() says whether a step runs on the execution
        thread. Tier writes then copy a page only once the step that writes it has run, and
        loads write rows claimed while a step ran only once that step has (stores.py,
        loads.py)."""
        self.stores.in_flight = self.loads.in_flight = in_flight

    def after_execute(self) -> None:
        """The step's blocks hold their data now: offer them to the store (async scheduling:
        the step the swap returned; start the loads claimed while it ran)."""
        self.loads.start_deferred()
        self.stores.after_execute()

    def poll(self) -> None:
        """Once per step: offer pages hashed since the last step, finish the loads that are
        done, release rows whose store/load finished, start due prefetches."""
        self.stores.before_schedule()
        self.loads.finish_done()
        self.stores.release_done()
        self.stores.poll_prefetch()

    def _wake(self, _handle) -> None:
        self._io_done.set()

    def wait_io(self, timeout: float) -> None:
        """Nothing else to do this step: sleep until some lookup or load finishes (or
        timeout)."""
        if self.loads.pending:
            self._io_done.wait(timeout)
        self._io_done.clear()

    def hit_tokens_by_source(self) -> dict[str, int]:
        return self.hits.by_source()

    def stats(self) -> dict:
        """Connector counters and each tier's counters and health (cheap: no histograms)."""
        return self.hits.stats(self.store, self.num_inflight, self.num_held_blocks)

    def close(self) -> None:
        self.store.close()
