"""An online cost model of one engine step: predicted seconds from what the step computes.

Features of a step (StepFeatures, one float each):
  fixed          1 per step (launch, sampling, Python overhead)
  tokens         new tokens computed (projections, MLP: linear in tokens)
  full_pairs     sum over seqs of new x (context before + new / 2), query-key pairs of the
                 full-attention layers (the causal triangle of the chunk included)
  sliding_pairs  the same with the context capped at the sliding window (sliding layers)
  linear_tokens  new tokens through linear-state (SSM / linear attention) layers
  seqs           sequences in the step (per-seq metadata, sampling)
A feature whose layer kind the model lacks stays 0 and its weight is never fitted.

Fit: weighted least squares of the measured step seconds over the features, with exponential
forgetting (half-life HALF_LIFE_STEPS) and relative weighting (a sample counts by
1/predicted^2, so short decode steps are predicted as well as long prefill ones; after
WARMUP_STEPS a sample is clipped at 1.5x its prediction, so host noise spikes do not drag the
fit). The unknowns are factors theta_j >= 0 on a prior (seconds per unit of feature j, from
the model's FLOPs): a ridge term pulls theta toward 1, so before the first ~8 steps the prior
rules and features that never vary (e.g. tokens == seqs in pure decode) keep the prior's
split. Non-negativity is enforced by projected coordinate descent (6 unknowns; microseconds
per step).

Invariants: predict() is monotone non-decreasing in every feature (non-negative weights) and
sees every sample observed so far; observe() records the relative error of the prediction made
*before* that sample updates it, by a fit at most SOLVE_EVERY samples old. The fit is solved
when a caller predicts, or every SOLVE_EVERY samples: a steady decode stream, whose scheduling
asks for no predictions, pays ~20 us per step instead of a solve (up to 0.2 ms when the
projected descent runs: 5% of a 128K-context decode step on a 2-core CPU).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

FEATURES = ("fixed", "tokens", "full_pairs", "sliding_pairs", "linear_tokens", "seqs")
NUM_FEATURES = len(FEATURES)
HALF_LIFE_STEPS = 200.0  # forgetting: a sample's weight halves after this many later steps
RIDGE = 1e-2  # pull of the prior, in units of (relative error)^2 of one sample
ERROR_WINDOW = 4096  # steps whose relative prediction error is kept for quantiles
WARMUP_STEPS = 8  # samples before outlier clipping starts (the prior may be far off)
SOLVE_EVERY = 16  # most samples folded in between solves when no caller predicts


@dataclass(frozen=True)
class ModelLayout:
    """Which layer kinds a model has and the sliding window (0: none)."""

    full_layers: int = 1
    sliding_layers: int = 0
    sliding_window: int = 0
    linear_layers: int = 0

    @classmethod
    def from_kv_config(cls, config) -> "ModelLayout":
        """From a KVCacheConfig (loomserve.kv.spec): layer counts per group kind."""
        full = sliding = linear = window = 0
        for g in getattr(config, "groups", ()):
            kind, n = g.spec.kind, len(g.layer_ids)
            if kind == "sliding_window":
                sliding += n
                window = max(window, g.spec.sliding_window)
            elif kind == "linear_state":
                linear += n
            else:  # full attention, MLA and any other attention kind
                full += n
        if not (full or sliding or linear):
            full = 1
        return cls(full, sliding, window, linear)


class StepFeatures:
    """A step's feature vector, built one scheduled chunk at a time (plain floats: the
    scheduler adds one chunk per scheduled seq every step, numpy only to predict)."""

    __slots__ = ("v", "layout", "_full", "_window", "_linear")

    def __init__(self, layout: ModelLayout, v: list[float] | None = None) -> None:
        self.layout = layout
        self.v = [0.0] * NUM_FEATURES if v is None else list(v)
        self._full = bool(layout.full_layers)
        self._window = layout.sliding_window if layout.sliding_layers else 0
        self._linear = bool(layout.linear_layers)

    def chunk(self, context: int, new: int) -> np.ndarray:
        """The features one seq adds: `new` tokens after `context` already-computed ones."""
        d = [0.0] * NUM_FEATURES
        self._accumulate(d, context, new)
        return np.array(d)

    def _accumulate(self, d: list[float], context: int, new: int) -> None:
        if new <= 0:
            return
        d[1] += new
        if self._full:
            d[2] += new * (context + new / 2.0)
        w = self._window
        if w:
            d[3] += new * (min(context, w) + min(new, w) / 2.0)
        if self._linear:
            d[4] += new
        d[5] += 1.0

    def add(self, context: int, new: int) -> None:
        self._accumulate(self.v, context, new)

    def with_chunk(self, context: int, new: int) -> np.ndarray:
        d = list(self.v)
        self._accumulate(d, context, new)
        return np.array(d)

    @staticmethod
    def fixed_term() -> np.ndarray:
        """The fixed feature alone (add it to a chunk-built vector to price a whole step)."""
        d = np.zeros(NUM_FEATURES)
        d[0] = 1.0
        return d

    def copy(self) -> "StepFeatures":
        return StepFeatures(self.layout, self.v)

    @property
    def vector(self) -> np.ndarray:
        """With the fixed term set (a step that computes anything pays it once)."""
        out = np.array(self.v)
        out[0] = 1.0
        return out


def prior_seconds_per_unit(layout: ModelLayout, num_params: int, heads_x_head_dim: int,
                           flops_per_s: float) -> np.ndarray:
    """Seconds per unit of each feature from FLOPs at an assumed rate (2 per parameter per
    token, 4 x heads x head_dim per query-key pair per attention layer)."""
    pair = 4.0 * heads_x_head_dim / flops_per_s
    total = max(1, layout.full_layers + layout.sliding_layers + layout.linear_layers)
    return np.array([
        2e-3,  # fixed: a few ms of Python and launch overhead
        2.0 * num_params / flops_per_s,
        pair * layout.full_layers,
        pair * layout.sliding_layers,
        2.0 * num_params / flops_per_s * layout.linear_layers / total * 0.1,
        5e-5,  # per seq: metadata, sampling
    ])


class StepCostModel:
    """predict(features) -> seconds; observe(features, seconds) after each measured step."""

    def __init__(self, prior: np.ndarray, half_life_steps: float = HALF_LIFE_STEPS,
                 ridge: float = RIDGE) -> None:
        self.prior = np.asarray(prior, dtype=float)
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.ridge = ridge
        self.theta = np.ones(NUM_FEATURES)
        self._weights = self.prior.copy()
        self._A = np.zeros((NUM_FEATURES, NUM_FEATURES))
        self._b = np.zeros(NUM_FEATURES)
        self.num_samples = 0
        self._unsolved = 0  # samples folded into _A, _b since the last solve
        self.errors: deque[float] = deque(maxlen=ERROR_WINDOW)

    @property
    def weights(self) -> np.ndarray:
        """Seconds per unit of each feature, fitted to every sample so far."""
        if self._unsolved:
            self._solve()
        return self._weights

    def predict(self, features: np.ndarray) -> float:
        return float(np.dot(self.weights, features))

    def observe(self, features: np.ndarray, seconds: float) -> None:
        """Fold in one measured step (features with the fixed term set, wall seconds)."""
        if seconds <= 0:
            return
        if self._unsolved >= SOLVE_EVERY or self.num_samples < WARMUP_STEPS:
            self._solve()  # while the prior may be far off, every sample counts at once
        pred = float(np.dot(self._weights, features))
        self.errors.append(abs(pred - seconds) / seconds)
        # Relative to the prediction (clipped to within 4x of the sample while the prior may
        # be far off), not to the sample: 1/seconds^2 would favour the luckiest fast steps.
        scale = min(max(pred, seconds / 4.0), seconds * 4.0)
        # A step slowed by something else on the host (a spike) teaches at most 1.5x the
        # prediction; a real cost the model misses still grows it 1.5x per step.
        if self.num_samples >= WARMUP_STEPS:
            seconds = min(seconds, 1.5 * pred)
        z = features * self.prior / scale
        self._A *= self.decay
        self._b *= self.decay
        self._A += np.outer(z, z)
        self._b += z * (seconds / scale)
        self.num_samples += 1
        self._unsolved += 1

    def _solve(self) -> None:
        """min (A + rI) theta . theta / 2 - (b + r) . theta over theta >= 0; the prior's
        unused features (prior 0) stay at theta 1 and weigh nothing anyway. The unconstrained
        optimum (one 6x6 solve: A + rI is positive definite) is the answer whenever it is
        non-negative, the usual case; else projected coordinate descent from the last theta,
        in plain floats (numpy's per-call cost dominates at this size)."""
        r = self.ridge
        A = self._A + r * np.eye(NUM_FEATURES)
        b = self._b + r
        theta = np.linalg.solve(A, b)
        if (theta < 0).any():
            theta = _projected_descent(A.tolist(), b.tolist(), self.theta.tolist())
        self.theta = theta
        self._weights = self.prior * theta
        self._unsolved = 0

    def error_quantiles(self) -> tuple[float, float]:
        """(median, p90) of the relative prediction error over the recent steps; 0s if none."""
        if not self.errors:
            return 0.0, 0.0
        e = np.fromiter(self.errors, float)
        return float(np.quantile(e, 0.5)), float(np.quantile(e, 0.9))


def _projected_descent(A: list[list[float]], b: list[float], theta: list[float],
                       sweeps: int = 30, tol: float = 1e-6) -> np.ndarray:
    """Coordinate descent for min A theta . theta / 2 - b . theta over theta >= 0 (A SPD)."""
    n = len(b)
    for _ in range(sweeps):
        delta = 0.0
        for j in range(n):
            row = A[j]
            g = b[j] - sum(row[k] * theta[k] for k in range(n)) + row[j] * theta[j]
            new = max(0.0, g / row[j])
            delta = max(delta, abs(new - theta[j]))
            theta[j] = new
        if delta < tol:
            break
    return np.array(theta)
