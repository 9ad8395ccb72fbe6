"""Slow-step log: where a long engine step spent its time.

`LOOMSERVE_SLOW_STEP_MS=N` logs (INFO, logger loomserve.engine.steps) every step whose wall
time, or whose gap since the previous step ended (the core loop's own work: receiving requests,
sending outputs; a gap across an idle wait is not counted), exceeds N ms, with the time of each
phase and the batch's shape. Off (the default) it costs one attribute check per phase. A
diagnostic for tail inter-token latency: the longest gaps a stream sees are steps, and this says
which part of which step.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("loomserve.engine.steps")


class StepTrace:
    def __init__(self, threshold_ms: float | None = None) -> None:
        if threshold_ms is None:
            raw = os.environ.get("LOOMSERVE_SLOW_STEP_MS", "")
            threshold_ms = float(raw) if raw else None
        self.threshold_s = None if threshold_ms is None else threshold_ms / 1000.0
        self.enabled = self.threshold_s is not None
        self._phases: list[tuple[str, float]] = []
        self._t0 = 0.0
        self._last_end: float | None = None

    def idle(self) -> None:
        """The loop went idle: the next step's gap is waiting for work, not the loop's own."""
        self._last_end = None

    def begin(self) -> None:
        if self.enabled:
            self._t0 = time.perf_counter()
            self._phases = []

    def mark(self, phase: str) -> None:
        """End the phase named `phase` (it ran since the previous mark or begin)."""
        if self.enabled:
            self._phases.append((phase, time.perf_counter()))

    def end(self, shape: str) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        gap = None if self._last_end is None else self._t0 - self._last_end
        self._last_end = now
        total = now - self._t0
        if total < self.threshold_s and (gap is None or gap < self.threshold_s):
            return
        parts, prev = [], self._t0
        for name, t in self._phases:
            parts.append(f"{name}={1e3 * (t - prev):.1f}")
            prev = t
        log.info("slow step %.1f ms (gap before %.1f ms) %s | %s", 1e3 * total,
                 1e3 * (gap or 0.0), " ".join(parts), shape)
