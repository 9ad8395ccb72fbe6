"""The replay's clock and pacer: when each request of a replay goes out.

`Clock` is the time source (`RealClock` in production, a virtual clock in tests). `Pacer`
holds every agent's send timer and the count of requests in flight: an agent awaits
`wait_until(deadline)`, and the pacer releases it at the deadline, or earlier when nothing is in
flight (see below), or with False once the replay stops.

Invariants:
- whenever nothing at all is in flight, every pending timer is pulled in by the same amount,
  so the next request goes out within `pull_in_s` (10 s) of the moment the system went idle;
  a uniform shift keeps the timers' order, and the total shift is `pulled_in_s`;
- releasing a timer restarts the idle window, so the next timer is not pulled in before the
  released request is in flight;
- after `close()`, every waiter (pending or new) gets False.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from typing import Protocol

__all__ = ["Clock", "RealClock", "Pacer"]


class Clock(Protocol):
    def now(self) -> float: ...
    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))



class Pacer:
    """Send timers plus the in-flight count; pulls timers in when nothing is in flight."""

    def __init__(self, clock: Clock, pull_in_s: float = 10.0) -> None:
        self.clock = clock
        self.pull_in_s = pull_in_s
        self.inflight = 0
        self.idle_since = clock.now()
        self.pulled_in_s = 0.0
        self.closed = False
        self._heap: list[list] = []
        self._seq = 0
        self._wake = asyncio.Event()

    async def wait_until(self, deadline: float) -> bool:
        """Wait for `deadline` (maybe pulled in). False once the pacer is closed."""
        if self.closed:
            return False
        if deadline <= self.clock.now():
            return True
        fut = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._heap, [deadline, self._seq, fut])
        self._wake.set()
        try:
            return await fut
        finally:
            if not fut.done():
                fut.cancel()

    def begin(self) -> None:
        self.inflight += 1
        self._wake.set()

    def end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.idle_since = self.clock.now()
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        for e in self._heap:
            if not e[2].done():
                e[2].set_result(False)
        self._heap.clear()
        self._wake.set()

    async def run(self) -> None:
        while not self.closed:
            self._wake.clear()
            now = self.clock.now()
            heap = self._heap
            while heap and (heap[0][2].done() or heap[0][0] <= now):
                e = heapq.heappop(heap)
                if not e[2].done():
                    e[2].set_result(True)
                    # the released agent is about to send: restart the idle window, so the
                    # next timer is not pulled in before that request is in flight
                    self.idle_since = max(self.idle_since, now)
            if not heap:
                await self._wake.wait()
                continue
            target = earliest = heap[0][0]
            if self.inflight == 0:
                limit = self.idle_since + self.pull_in_s
                if now >= limit:  # idle for pull_in_s: pull every timer in by the same amount
                    shift = earliest - now
                    for e in heap:  # a uniform shift keeps the heap order
                        e[0] -= shift
                    self.pulled_in_s += shift
                    continue
                target = min(earliest, limit)
            sleeper = asyncio.ensure_future(self.clock.sleep(target - now))
            waker = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                waker.cancel()
