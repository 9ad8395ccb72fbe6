"""Which state checkpoints to keep (retention) and which blocks to hold through tool pauses
(session pinning). Policy only: the state manager asks `RetentionConfig` which boundaries to
save; `SessionPins` holds references through the pool like any other holder.

Always on (the plain-engine baseline, policy "a"): when a request is freed, the state at the
last block boundary its computation crossed is kept as a checkpoint.
On top, combinable:
- interval: a checkpoint at the end of each turn's prompt, block aligned
  (floor(prompt_len / block_size) * block_size), plus one every `every_n_tokens` if > 0.
- marconi: when a request's full-attention hit reaches further than any state checkpoint (a
  prefix reused without a checkpoint; the hit is lowered to the last checkpoint so the gap is
  recomputed anyway), keep a checkpoint at the full-attention hit boundary so the next sharer
  hits there.
`max_checkpoints_per_path` bounds the checkpoints one request keeps (besides the end one);
priority: marconi, then prompt end, then the every-n ones (latest first).

Pinning (pin_ttl_s > 0): when a request of a session is freed, its latest checkpoint(s) and the
prefix blocks a hit there needs are pinned (one reference each, so not evictable) until the
session ends, the TTL expires (checked lazily on allocation, with an injectable clock) or the
byte budget makes room for a newer session's pin (oldest session first). A session holds at most
one pin set: a new one replaces the old.

Subagents: a session whose subagent requests (parent_session_id = the session) are in the
engine is active, not paused: each time the KV manager sees such a request its parent's TTL
starts over (`refresh`), so the parent's prefix survives a subagent run longer than the TTL and
is released at most one TTL after its last subagent request was seen. Refreshing only extends
a pin that exists; it never pins anything, and the byte budget still drops the oldest first.
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
            self._drop_oldest()
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

    def _drop_oldest(self) -> None:
        _, (_, blocks) = self._pins.popitem(last=False)
        self.num_pinned -= len(blocks)
        self.pool.free(reversed(blocks))

    def expire(self) -> None:
        if not self._pins:
            return
        now = self.clock()
        pins = self._pins
        while pins and next(iter(pins.values()))[0] <= now:
            self._drop_oldest()

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
