"""Which state checkpoints to keep (retention) and which blocks to hold through tool pauses
(session pinning). Policy only: the state manager asks `RetentionConfig` which boundaries to
save; `SessionPins` holds references through the pool like any other holder.

The state at a freed request's last crossed boundary is always kept; `interval` (prompt end,
every n tokens) and `marconi` (where a full-attention hit outran every checkpoint) add
checkpoints, at most `max_checkpoints_per_path` per request. Pinning keeps a session's latest
hit boundary referenced until the session ends, the TTL runs out or the byte budget needs the
room. The policies in detail: docs/design/kv-cache.md.

Invariants:
- A session holds at most one pin set: a new one replaces the old.
- Pins never exceed the byte budget; the oldest session's pin is dropped first.
- Refreshing (a subagent of the session was seen) only extends a pin that exists.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from loomserve.kv.pool import Block, BlockPool


@dataclass(frozen=True)
class RetentionConfig:
    interval: bool = False
    every_n_tokens: int = 0
    marconi: bool = False
    max_checkpoints_per_path: int = 4
    pin_ttl_s: float = 0.0
    pin_budget_bytes: int = 0

    @property
    def pinning(self) -> bool:
        return self.pin_ttl_s > 0 and self.pin_budget_bytes > 0


class SessionPins:
    """session id -> (expiry, pinned blocks). Invariants: each pinned block holds exactly one
    reference per session pinning it; the total pinned blocks (with multiplicity) never exceed
    budget_blocks; entries are ordered by expiry (the TTL is constant, re-pinning moves a
    session to the end)."""

    def __init__(self, pool: BlockPool, ttl_s: float, budget_blocks: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.ttl_s = ttl_s
        self.budget_blocks = budget_blocks
        self.clock = clock
        self._pins: OrderedDict[str, tuple[float, list[Block]]] = OrderedDict()
        self.num_pinned = 0
        # called with the session id when its pin expires or the budget drops it (not on a
        # re-pin or an explicit release): what was kept for the session goes with its KV
        self.on_drop: Callable[[str], None] | None = None

    def pin(self, session_id: str, blocks: list[Block]) -> bool:
        """Replace the session's pin set with blocks (references taken before the old ones are
        dropped, so shared blocks never bounce through the free queue). False if they alone
        exceed the budget (the old set is released anyway: it is stale)."""
        if len(blocks) > self.budget_blocks or not blocks:
            self.release(session_id)
            return False
        self.pool.touch(blocks)
        self.release(session_id)
        self._pins[session_id] = (self.clock() + self.ttl_s, blocks)
        self.num_pinned += len(blocks)
        while self.num_pinned > self.budget_blocks:
            self._drop_oldest("pin_budget")
        return True

    def refresh(self, session_id: str) -> bool:
        """The session is active (a subagent of it is in the engine): its pin's time-to-live
        starts over. Keeps the expiry order (a constant TTL from a monotonic clock). False when
        the session holds no pin."""
        entry = self._pins.get(session_id)
        if entry is None:
            return False
        self._pins[session_id] = (self.clock() + self.ttl_s, entry[1])
        self._pins.move_to_end(session_id)
        return True

    def release(self, session_id: str) -> None:
        entry = self._pins.pop(session_id, None)
        if entry is not None:
            self.num_pinned -= len(entry[1])
            self.pool.free(reversed(entry[1]))

    def _drop_oldest(self, why: str) -> None:
        """Drop the oldest pin; why (pin_ttl / pin_budget) marks the blocks it held last, so
        their later eviction is attributed to the pin (kv.miss_causes)."""
        session_id, (_, blocks) = self._pins.popitem(last=False)
        self.num_pinned -= len(blocks)
        for b in blocks:
            if b.ref_cnt == 1 and b.block_hash is not None:
                b.release = why
        self.pool.free(reversed(blocks))
        if self.on_drop is not None:
            self.on_drop(session_id)

    def expire(self) -> None:
        if not self._pins:
            return
        now = self.clock()
        pins = self._pins
        while pins and next(iter(pins.values()))[0] <= now:
            self._drop_oldest("pin_ttl")

    def blocks(self, session_id: str) -> list[Block]:
        entry = self._pins.get(session_id)
        return [] if entry is None else entry[1]

    def holders(self) -> dict[int, int]:
        """block id -> references held by pins (for invariant checks)."""
        out: dict[int, int] = {}
        for _, blocks in self._pins.values():
            for b in blocks:
                out[b.block_id] = out.get(b.block_id, 0) + 1
        return out

    def __len__(self) -> int:
        return len(self._pins)
