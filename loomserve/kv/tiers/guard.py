"""TierGuard: calls into the lower tiers (disk, a shared pool), bounded in time, with health.

A lower tier may hang or fail; the engine must not wait on it. Each lower tier gets one thread
of its own; `call` runs an operation there and waits at most `op_timeout_s`. A tier that raises
or times out is marked unhealthy (base.Health: exponential backoff, then one probing call) and
is skipped while its backoff runs.

Invariants:
- `call` never raises for a tier fault: None means "no answer", which callers count as misses.
- A call that returns after its timeout writes only into the buffers it was given; callers pass
  per-call staging, never the destination, so late bytes land where nobody reads.
- Every failure runs `on_fail(tier)` (TieredStore forgets what it wrote there: a backend that
  comes back may have lost everything).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Sequence

from loomserve.kv.tiers.base import Tier, TierUnavailable
from loomserve.kv.tiers.io_priority import io_pool

log = logging.getLogger(__name__)


class TierGuard:
    def __init__(self, tiers: Sequence[Tier], op_timeout_s: float,
                 backoff_s: tuple[float, float] = (0.5, 30.0),
                 on_fail: Callable[[Tier], None] = lambda tier: None) -> None:
        self.op_timeout_s = op_timeout_s
        self._on_fail = on_fail
        self._backoff_s = backoff_s
        self._threads: dict[str, ThreadPoolExecutor] = {}
        for t in tiers:
            self.add(t)

    def add(self, tier: Tier) -> None:
        """Guard one more tier (its own thread, the store's backoff)."""
        tier.health.base_s, tier.health.max_s = self._backoff_s
        self._threads[tier.name] = io_pool(1, f"tier-{tier.name}")

    @staticmethod
    def ok(tier: Tier) -> None:
        tier.health.ok()
        tier.stats.healthy = True

    def fail(self, tier: Tier, err: str) -> None:
        if tier.health.healthy:
            log.warning("tier %s unavailable: %s", tier.name, err)
        tier.health.fail(err)
        tier.stats.healthy = False
        self._on_fail(tier)

    def call(self, tier: Tier, fn, *args):
        """fn(*args) on the tier's own thread, bounded by op_timeout_s; None on any fault."""
        if not tier.health.available():
            tier.stats.add(skipped_unhealthy=1)
            return None
        fut = self._threads[tier.name].submit(fn, *args)
        try:
            res = fut.result(timeout=self.op_timeout_s)
        except FutureTimeout:
            tier.stats.add(timeouts=1)
            self.fail(tier, f"timed out after {self.op_timeout_s}s")
            return None
        except TierUnavailable as e:
            self.fail(tier, str(e))
            return None
        except Exception as e:  # a backend raising anything else is a fault too
            self.fail(tier, f"{type(e).__name__}: {e}")
            return None
        self.ok(tier)
        return res

    def submit(self, tier: Tier, fn, *args) -> None:
        """fn(*args) on the tier's thread, not waited for; skipped while the tier is unhealthy
        (for hints such as touch, whose loss costs nothing)."""
        if tier.health.healthy:
            self._threads[tier.name].submit(fn, *args)

    def shutdown(self) -> None:
        for ex in self._threads.values():
            ex.shutdown(wait=False, cancel_futures=True)
