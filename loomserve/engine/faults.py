"""Debug hooks for the core loop, off unless their environment variable is set.

LOOMSERVE_FAULT_INJECT=POINT[:N] raises an InjectedFault on the N-th call (default 1) of one
core-loop path: `step`, `abort`, `idle`, `tier_poll` (the tier connector's poll) or `add`.
tier_poll also runs in the idle loop; only its calls while requests are in the engine count.
LOOMSERVE_STEP_DELAY_MS=D sleeps D ms before every step (to pace a fast machine in tests).
Both wrap the core's bound methods once at start, so the loop itself has no check per step.
Tests use them to show that a failure anywhere in the loop fails every request and never hangs.
"""

from __future__ import annotations

import os
import time

POINTS = ("step", "abort", "idle", "tier_poll", "add")


class InjectedFault(RuntimeError):
    pass


def install(core) -> None:
    """Wrap `core`'s methods as the environment asks (no-op when neither variable is set)."""
    delay = float(os.environ.get("LOOMSERVE_STEP_DELAY_MS", "0") or 0) / 1000
    if delay > 0:
        step = core.step

        def paced_step():
            time.sleep(delay)
            return step()
        core.step = paced_step
    spec = os.environ.get("LOOMSERVE_FAULT_INJECT")
    if spec:
        point, _, nth = spec.partition(":")
        _arm(core, point, int(nth or 1))


def _arm(core, point: str, nth: int) -> None:
    if point not in POINTS:
        raise ValueError(f"LOOMSERVE_FAULT_INJECT: unknown point {point!r} (one of {POINTS})")
    counts = None
    if point == "tier_poll":
        if core.tiers is None:
            raise ValueError("LOOMSERVE_FAULT_INJECT=tier_poll needs KV tiers")
        owner, name, counts = core.tiers, "poll", core.has_work
    else:
        owner, name = core, point
    target = getattr(owner, name)
    calls = [0]

    def faulty(*args, **kwargs):
        if counts is None or counts():
            calls[0] += 1
        if calls[0] == nth:
            raise InjectedFault(f"injected fault in {point} (call {nth})")
        return target(*args, **kwargs)
    setattr(owner, name, faulty)
