"""Which sessions are live on each instance: the resident KV a new session's placement weighs.

Agents send no "session ended". A session counts as live until it has been silent for
LIVE_GAPS times its own mean gap between requests (an exponential average), never less than
LIVE_MIN_S and never more than the window (LIVE_SESSION_S by default); before its second
request it counts for the whole window. A fixed window alone counted every session that ended
in the last five minutes: under agent traffic that turns over sessions in minutes, placement
balanced sessions ever seen, not sessions holding KV now.

Invariants: `counts()[i]` is the number of tracked sessions whose last request went to i and
whose deadline has not passed; each tracked session has exactly one heap entry with its
current sequence number (older entries are skipped when they surface); the heap is rebuilt
from the live sessions' entries when it outgrows twice their number, so it stays O(sessions).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

LIVE_SESSION_S = 300.0  # the longest a silent session counts as live
LIVE_GAPS = 4.0  # silence of this many mean gaps ends a session's liveness
LIVE_MIN_S = 5.0  # ... but never sooner than this
GAP_EMA = 0.3  # weight of the newest gap in the mean


@dataclass(slots=True)
class _Session:
    instance: str
    last: float
    gap: float | None
    seq: int
    deadline: float
    counted: bool = True


class LiveSessions:
    """Live sessions per instance, O(log n) per request; expired ones leave in deadline order."""

    def __init__(self, window_s: float = LIVE_SESSION_S,
                 clock: Callable[[], float] = time.monotonic, gaps: float = LIVE_GAPS,
                 min_s: float = LIVE_MIN_S) -> None:
        self.window_s, self.clock, self.gaps, self.min_s = window_s, clock, gaps, min_s
        self._sessions: dict[str, _Session] = {}
        self._heap: list[tuple[float, int, str]] = []  # (deadline, seq, session)
        self._seq = count()
        self._count: dict[str, int] = {}

    def seen(self, session: str, instance: str) -> None:
        now, old = self.clock(), self._sessions.get(session)
        gap = None
        if old is not None:
            step = now - old.last
            gap = step if old.gap is None else (1 - GAP_EMA) * old.gap + GAP_EMA * step
            self._uncount(old)
        seq, deadline = next(self._seq), now + self.ttl(gap)
        self._sessions[session] = _Session(instance, now, gap, seq, deadline)
        self._count[instance] = self._count.get(instance, 0) + 1
        heapq.heappush(self._heap, (deadline, seq, session))
        if len(self._heap) > 2 * len(self._sessions) + 64:  # superseded entries pile up
            self._heap = [(s.deadline, s.seq, name) for name, s in self._sessions.items()
                          if s.counted]
            heapq.heapify(self._heap)

    def ttl(self, gap: float | None) -> float:
        """How long a session with this mean gap stays live after a request."""
        if gap is None:
            return self.window_s
        return min(self.window_s, max(self.min_s, self.gaps * gap))

    def drop(self, session: str) -> None:
        old = self._sessions.pop(session, None)
        if old is not None:
            self._uncount(old)

    def counts(self) -> dict[str, int]:
        now, heap = self.clock(), self._heap
        while heap and heap[0][0] < now:
            _, seq, session = heapq.heappop(heap)
            s = self._sessions.get(session)
            if s is not None and s.seq == seq:
                self._uncount(s)
        return self._count

    def tracked(self, session: str) -> bool:
        return session in self._sessions

    def _uncount(self, s: _Session) -> None:
        if s.counted:
            s.counted = False
            self._count[s.instance] -= 1
