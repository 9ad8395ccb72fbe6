"""The numbers behind `loomserve bench pd-profile`: levels, saturation, the P:D ratio, the layout.

Saturation. A phase runs closed-loop at concurrency 1, 2, 4, ... up to --max-concurrency. It is
saturated at the first level whose throughput does not beat the best level so far by more than
`gain` (5 % by default); the saturation rate is the best throughput measured. A phase that still
gained at its last level is reported as not saturated: its rate (and so the ratio) is then a
lower bound of what the instance could do.

Ratio. Per request of the workload (input `in` tokens of which `in_new` are not cached, output
`out` tokens):
    a prefill instance spends  t_p = in_new / P_sat  seconds of its saturated capacity,
    a decode instance spends   t_d = out / D_sat     seconds of its saturated capacity,
where P_sat is the prefill-only saturation rate (computed prompt tokens/s) and D_sat the
decode-only one (generated tokens/s summed over the decode batch). D_sat already holds the batch
size: at the saturating concurrency c, each stream runs at D_sat / c tokens/s and c streams run
at once, so a decode instance finishes D_sat / out requests per second. At a request rate L the
deployment needs L * t_p prefill instances and L * t_d decode instances, so

    P:D = t_p / t_d = (in_new / P_sat) / (out / D_sat)      prefill instances per decode instance.

For N instances the layout gives round(N * r / (1 + r)) of them --role prefill (at least one of
each when N >= 2) and the rest --role decode; N = 1 is --role both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Saturation", "concurrency_levels", "saturated", "saturation", "pd_ratio",
           "simple_ratio", "layout"]


@dataclass
class Saturation:
    concurrency: int     # the level with the best throughput
    rate: float          # that throughput (tokens/s)
    reached: bool        # False: still gaining at the last level (the rate is a lower bound)


def concurrency_levels(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... below max_concurrency, then max_concurrency itself."""
    if max_concurrency < 1:
        raise ValueError(f"max concurrency must be >= 1, got {max_concurrency}")
    levels, c = [], 1
    while c < max_concurrency:
        levels.append(c)
        c *= 2
    return levels + [max_concurrency]


def saturated(best_so_far: float, current: float, gain: float = 0.05) -> bool:
    """True when `current` does not beat the best earlier level by more than `gain`."""
    return current <= best_so_far * (1.0 + gain)


def saturation(points: list[tuple[int, float]], gain: float = 0.05) -> Saturation:
    """points: (concurrency, throughput) in the order run. Reached when some level after the
    first did not gain more than `gain` over the best before it."""
    if not points:
        raise ValueError("no measured level")
    best_c, best = points[0]
    reached = False
    for c, thr in points[1:]:
        if saturated(best, thr, gain):
            reached = True
        if thr > best:
            best_c, best = c, thr
    return Saturation(best_c, best, reached)


def pd_ratio(in_new: float, out: float, prefill_rate: float, decode_rate: float) -> float:
    """Prefill instances per decode instance that keep both saturated (module docstring)."""
    if prefill_rate <= 0 or decode_rate <= 0:
        raise ValueError("saturation rates must be positive")
    if out <= 0:
        raise ValueError("the workload must generate at least one token")
    return (in_new / prefill_rate) / (out / decode_rate)


def simple_ratio(r: float, max_total: int = 8) -> tuple[int, int]:
    """The (prefill, decode) pair of small integers (p + d <= max_total, both >= 1) closest to
    r = p / d in log scale; ties go to the smaller pair (it is found first)."""
    target = math.log(max(r, 1e-9))
    best, err = (1, 1), float("inf")
    for total in range(2, max_total + 1):
        for p in range(1, total):
            e = abs(math.log(p / (total - p)) - target)
            if e < err - 1e-9:
                best, err = (p, total - p), e
    return best


def layout(r: float, instances: int) -> list[str]:
    """--role of each of `instances` instances for a P:D ratio r (module docstring)."""
    if instances < 1:
        raise ValueError("need at least one instance")
    if instances == 1:
        return ["both"]
    n_p = min(max(round(instances * r / (1.0 + r)), 1), instances - 1)
    return ["prefill"] * n_p + ["decode"] * (instances - n_p)
