"""The waiting queue and the order in which the scheduler tries to admit it.

Requests sit in arrival order (preempted ones pushed back at the front, as before); `order()`
gives the admission order of a policy:

- fcfs: arrival order, preempted requests first (the scheduler's order before policies).
- priority: by the request's `priority` (lower first, as vLLM's priority scheduling), then
  arrival order.
- cache_aware (the engine's default): by priority, then warm sessions first, then least
  uncached work (the tokens left after the request's cached prefix, probed without touching the
  hit-rate counters), then arrival order. A warm turn on a cached 100K context goes before a
  cold 6K prefill that arrived first.

Aging (priority and cache_aware): a request waiting longer than `max_postpone_s` since it first
entered the queue goes to the front whatever its priority or uncached work, oldest first; so
no request is postponed by later arrivals for more than that bound (it can still wait for
blocks or the token budget, which the requests ahead of it release as they finish). A running
prefill ordered against waiting requests (the step-time budget's shared order) ages from its
last chunk instead (`progressed`): it is postponed only while it gets nothing, so a cold prefill
that is being served does not jump ahead of every later warm turn once it is 10 s old.

Warm: the session (`session_id`) holds a KV pin, or one of its requests finished within
`warm_window_s`. Probing the prefix cache costs a hash lookup per block, so a request's
uncached work is re-probed only every PROBE_EVERY orderings (hits change slowly).

Invariant: every request appears once; `order()` is a permutation of the queue.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterator

POLICIES = ("cache_aware", "priority", "fcfs")
PROBE_EVERY = 8  # orderings between two prefix-cache probes of the same waiting request
WARM_WINDOW_S = 60.0  # a session whose last request finished this recently counts as warm
_MAX_SESSIONS = 8192  # recent-turn memo size before old entries are pruned


class WaitingQueue:
    """A deque of waiting requests (the scheduler's own operations) plus a policy's order."""

    def __init__(self, policy: str = "fcfs", max_postpone_s: float = 10.0, kv=None,
                 clock: Callable[[], float] = time.monotonic,
                 warm_window_s: float = WARM_WINDOW_S) -> None:
        """kv: the KV manager, probed for cached prefixes (get_computed_blocks without stats)
        and session pins (kv.pins); None: no probes, no pins."""
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; one of {POLICIES}")
        self.policy = policy
        self.max_postpone_s = max_postpone_s
        self.kv = kv
        self.clock = clock
        self.warm_window_s = warm_window_s
        self._q: deque = deque()
        self._since: dict[str, float] = {}  # request id -> when it first entered the queue
        self._probe: dict[str, tuple[int, int]] = {}  # request id -> (ordering no., uncached)
        self._last_turn: dict[str, float] = {}  # session id -> when its last request finished
        self._orderings = 0

    # -- the deque the scheduler manipulates ------------------------------------------------
    def append(self, req) -> None:
        self._since.setdefault(req.request_id, self.clock())
        self._q.append(req)

    def appendleft(self, req) -> None:
        """A preempted request: back at the front (fcfs), aging from its first arrival."""
        self._since.setdefault(req.request_id, self.clock())
        self._q.appendleft(req)

    def remove(self, req) -> None:
        self._q.remove(req)

    def progressed(self, req) -> None:
        """A running prefill got a chunk: its postponement clock restarts."""
        self._since[req.request_id] = self.clock()

    def forget(self, req) -> None:
        """The request finished: drop its bookkeeping."""
        self._since.pop(req.request_id, None)
        self._probe.pop(req.request_id, None)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator:
        return iter(self._q)

    def __getitem__(self, i):
        return self._q[i]

    # -- sessions ---------------------------------------------------------------------------
    def note_turn(self, session_id: str | None) -> None:
        """A request of the session finished: the session counts as warm for a while."""
        if session_id is None:
            return
        now = self.clock()
        self._last_turn.pop(session_id, None)
        self._last_turn[session_id] = now  # insertion order = recency order
        if len(self._last_turn) > _MAX_SESSIONS:
            for sid in list(self._last_turn)[: _MAX_SESSIONS // 2]:
                del self._last_turn[sid]

    def is_warm(self, req) -> bool:
        sid = req.session_id
        if sid is None:
            return False
        t = self._last_turn.get(sid)
        if t is not None and self.clock() - t <= self.warm_window_s:
            return True
        pins = getattr(self.kv, "pins", None)
        return pins is not None and bool(pins.blocks(sid))

    def waited(self, req) -> float:
        """Seconds since the request first entered the queue."""
        return self.clock() - self._since.get(req.request_id, self.clock())

    # -- admission order --------------------------------------------------------------------
    def order(self) -> list:
        """The requests in the order admission should try them (see the module doc)."""
        q = list(self._q)
        if self.policy == "fcfs" or len(q) <= 1:
            return q
        self._orderings += 1
        return sorted(q, key=self.key)  # stable: ties keep the queue order

    def key(self, req, uncached: int | None = None) -> tuple:
        """The policy's sort key (smaller first). uncached: the work left when the caller
        knows it (a running request's remaining prefill); else probed. Aged requests
        (waited max_postpone_s since they first entered the queue) sort first, oldest first."""
        now = self.clock()
        since = self._since.get(req.request_id, now)
        if now - since >= self.max_postpone_s:
            return (0, since)
        if self.policy != "cache_aware":
            return (1, getattr(req, "priority", 0))
        work = self._uncached(req) if uncached is None else uncached
        return (1, getattr(req, "priority", 0), not self.is_warm(req), work)

    def _uncached(self, req) -> int:
        """Tokens left after the request's cached prefix (a probe: no hit-rate stats)."""
        if self.kv is None:
            return 0
        memo = self._probe.get(req.request_id)
        if memo is not None and self._orderings - memo[0] < PROBE_EVERY:
            return memo[1]
        n = req.num_tokens - self.kv.get_computed_blocks(req, record_stats=False)[1]
        self._probe[req.request_id] = (self._orderings, n)
        return n
