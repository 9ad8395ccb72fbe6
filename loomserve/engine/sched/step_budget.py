"""One engine step's time budget: the target and how much of a prefill fits in it.

A StepPlan starts from the step's running decodes (priced up front: they always go) and the
target: `--target-step-ms`, or with `auto` AUTO_TARGET_MULT x the predicted cost of those
decodes (none in a step without decodes: no stream to protect). The scheduler asks it for each
prefill's share (`chunk`) and records what it scheduled (`add`).

Long and short prefills (Request.long_prefill, set at admission: uncached work over one
long-prefill chunk): a long prefill (a cold prompt, a fresh subagent) is cut to what keeps the
predicted step within the target, on a block boundary where that leaves anything; the step's
first long chunk gets at least one block, so a long prefill never starves. A short one (a warm
turn: a tool result over a cached context) goes whole, as without a target: cutting it would
stretch its TTFT about mult / (mult - 1)x, and its stall stays bounded by the long-prefill cap.
Holding a short one that does not fit for a later step was tried and measured worse (16-session
AgentX replay: TPGS -13% instead of -5.5%, ITL p99/p50 4.4 instead of 4.2; docs/design/scheduler.md).

Invariant: chunk() is at most n; a step exceeds the predicted target only by its short prefills
and one block of its first long one.
"""

from __future__ import annotations

from loomserve.engine.sched.step_cost import StepFeatures

# Auto target: this multiple of the predicted cost of the step's decodes alone, so ITL p99 /
# p50 stays under 3 with room for the cost model's error (p90 0.2-0.25 in the replays).
AUTO_TARGET_MULT = 2.5
_FIXED = StepFeatures.fixed_term()


class StepPlan:
    """Features so far (decodes first), the target in seconds (None: no time limit)."""

    __slots__ = ("feats", "target", "model", "block_size", "prefilled")

    def __init__(self, feats: StepFeatures, target: float | None, model=None,
                 block_size: int = 1) -> None:
        self.feats, self.target, self.model = feats, target, model
        self.block_size, self.prefilled = block_size, False

    @classmethod
    def for_step(cls, running, layout, model, target_step_ms: float | None,
                 block_size: int) -> "StepPlan":
        """The plan with every running decode counted up front."""
        feats = StepFeatures(layout)
        if model is None or target_step_ms == 0:
            return cls(feats, None)
        decoding = False
        for r in running:
            if r.num_tokens - r.num_computed_tokens == 1:
                feats.add(r.num_computed_tokens, 1)
                decoding = True
        if target_step_ms is not None:
            target = target_step_ms / 1000.0
        elif decoding:
            target = AUTO_TARGET_MULT * model.predict(feats.vector)
        else:
            target = None
        return cls(feats, target, model, block_size)

    def add(self, context: int, n: int) -> None:
        """A prefill chunk of n tokens after `context` was scheduled."""
        self.feats.add(context, n)

    def chunk(self, n: int, context: int, long_prefill: bool) -> int:
        """How many of a prefill's next n tokens (already capped) go this step (0: none)."""
        if self.target is None or n <= 1 or not long_prefill:
            return n
        fit = self._fit(context, n)
        if not self.prefilled:
            fit = max(fit, min(n, self.block_size))
            self.prefilled = fit > 0
        return fit

    def _fits(self, context: int, n: int) -> bool:
        return self.model.predict(self.feats.with_chunk(context, n) + _FIXED) <= self.target

    def _fit(self, context: int, n: int) -> int:
        """Most tokens (<= n) whose chunk keeps the predicted step within the target; cut to
        end on a block boundary when that leaves anything."""
        if self._fits(context, n):
            return n
        lo, hi = 0, n  # predict is monotone in n: bisect the largest fitting n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(context, mid):
                lo = mid
            else:
                hi = mid - 1
        bs = self.block_size
        aligned = (context + lo) // bs * bs - context
        return aligned if aligned > 0 else lo
