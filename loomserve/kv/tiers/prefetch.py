"""When to bring a paused session's pages back up: think-time prediction per session.

An agent session alternates turns with pauses (a tool runs, a human reads). Its pages drift to
the lower tiers during a long pause; fetching them only when the next turn arrives puts the
whole transfer on that turn's time to first token. A session's pauses are fairly regular
(the same tools, the same agent), so predict the next gap from its past ones and start the
fetch early enough to finish just before the predicted return.

`ThinkTimePredictor` keeps an EWMA of the gaps and a window of recent gaps; the prefetch aims at
the earlier of the EWMA and a low percentile of the window (returning early is the costly
mistake: a late prefetch only costs a little host memory for a while). `SessionPrefetcher`
holds one predictor per session, remembers each paused session's pages, and says which sessions
are due.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque


class ThinkTimePredictor:
    def __init__(self, alpha: float = 0.3, quantile: float = 0.25, window: int = 32,
                 default_gap_s: float | None = None) -> None:
        self.alpha = alpha
        self.quantile = quantile
        self.gaps: deque[float] = deque(maxlen=window)
        self.ewma: float | None = None
        self.default_gap_s = default_gap_s

    def observe(self, gap_s: float) -> None:
        if gap_s < 0:
            return
        self.gaps.append(gap_s)
        self.ewma = gap_s if self.ewma is None else (
            self.alpha * gap_s + (1 - self.alpha) * self.ewma)

    def percentile(self, q: float) -> float | None:
        if not self.gaps:
            return None
        s = sorted(self.gaps)
        pos = q * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    def predicted_gap(self) -> float | None:
        """The gap to plan for: min(EWMA, the quantile of recent gaps); default before any."""
        if self.ewma is None:
            return self.default_gap_s
        p = self.percentile(self.quantile)
        return self.ewma if p is None else min(self.ewma, p)

    def prefetch_at(self, paused_at: float, lead_s: float) -> float | None:
        """When to start a prefetch that takes lead_s; None without a prediction."""
        gap = self.predicted_gap()
        if gap is None:
            return None
        return paused_at + max(0.0, gap - lead_s)

    def should_prefetch(self, now: float, paused_at: float, lead_s: float) -> bool:
        t = self.prefetch_at(paused_at, lead_s)
        return t is not None and now >= t


class SessionPrefetcher:
    """Paused sessions and their pages; `due(now)` returns the ones to prefetch now.

    lead time = margin_s + pages * page_bytes / bandwidth (bandwidth_fn() -> bytes/s, e.g. the
    lower tiers' observed load bandwidth). Bounded: the least recently paused sessions are
    forgotten first."""

    def __init__(self, page_bytes: int, bandwidth_fn=lambda: None,
                 default_bandwidth: float = 1e9, margin_s: float = 0.05,
                 max_sessions: int = 4096, clock=time.monotonic, **predictor_kw) -> None:
        self.page_bytes = page_bytes
        self.bandwidth_fn = bandwidth_fn
        self.default_bandwidth = default_bandwidth
        self.margin_s = margin_s
        self.max_sessions = max_sessions
        self.clock = clock
        self.predictor_kw = predictor_kw
        self.predictors: OrderedDict[str, ThinkTimePredictor] = OrderedDict()
        self.paused: OrderedDict[str, tuple[float, list[bytes]]] = OrderedDict()

    def predictor(self, session_id: str) -> ThinkTimePredictor:
        p = self.predictors.get(session_id)
        if p is None:
            p = self.predictors[session_id] = ThinkTimePredictor(**self.predictor_kw)
            while len(self.predictors) > self.max_sessions:
                self.predictors.popitem(last=False)
        else:
            self.predictors.move_to_end(session_id)
        return p

    def lead_time(self, num_pages: int) -> float:
        bw = self.bandwidth_fn() or self.default_bandwidth
        return self.margin_s + num_pages * self.page_bytes / bw

    def on_pause(self, session_id: str, keys: list[bytes], now: float | None = None) -> None:
        now = self.clock() if now is None else now
        self.paused[session_id] = (now, list(keys))
        self.paused.move_to_end(session_id)
        while len(self.paused) > self.max_sessions:
            self.paused.popitem(last=False)

    def on_resume(self, session_id: str, now: float | None = None) -> None:
        """The session's next turn arrived: learn the gap, stop tracking the pause."""
        now = self.clock() if now is None else now
        entry = self.paused.pop(session_id, None)
        if entry is not None:
            self.predictor(session_id).observe(now - entry[0])

    def prefetch_at(self, session_id: str) -> float | None:
        entry = self.paused.get(session_id)
        if entry is None:
            return None
        paused_at, keys = entry
        return self.predictor(session_id).prefetch_at(paused_at, self.lead_time(len(keys)))

    def due(self, now: float | None = None) -> list[tuple[str, list[bytes]]]:
        """Sessions whose prefetch should start now; each is returned once per pause."""
        now = self.clock() if now is None else now
        out = []
        for sid, (paused_at, keys) in list(self.paused.items()):
            if not keys:
                continue
            p = self.predictors.get(sid)
            if p is not None and p.should_prefetch(now, paused_at, self.lead_time(len(keys))):
                out.append((sid, keys))
                self.paused[sid] = (paused_at, [])  # fetched; keep the pause time for the gap
        return out
