"""The simulator's sweep: policies at several capacities, and the hit-rate-vs-capacity curve.

`simulate` runs `infinite` once and each bounded policy at each capacity, given either in tokens
or as fractions of the working set (unique cacheable blocks * block size); it returns the
JSON-ready result of `loomserve bench simulate --json`.

Invariants:
- a fraction f gives a capacity of round(f * working set / B) blocks, at least one block;
- the result has a "curve" (one row per capacity, one column per policy) whenever more than
  one capacity ran, or one capacity beside `infinite`.
"""

from __future__ import annotations

import time

from loomserve.bench.simulate.policies import RunResult, _log, run_infinite, run_policy
from loomserve.bench.simulate.workload import Workload

__all__ = ["DEFAULT_SWEEP", "simulate"]

DEFAULT_SWEEP = tuple(round(0.1 * i, 1) for i in range(1, 11))


def simulate(w: Workload, policies: list[str], capacities: list[int] | None = None,
             fractions: list[float] | None = None, progress: bool = False) -> dict:
    """Run policies at capacities (tokens) or at fractions of the working set; returns the
    JSON-ready result (runs, and a curve when more than one capacity)."""
    info: dict = {"command": "simulate", "traces": w.num_traces, "requests": len(w),
                  "semantics": w.semantics, "block_size": w.block_size,
                  "stagger_s": w.stagger_s, "append_outputs": w.append_outputs,
                  "warmup_requests": w.warmup_requests, "policies": list(policies)}
    need_keys = fractions is not None or "optimal" in policies or "infinite" in policies
    if need_keys:
        t = time.perf_counter()
        info["unique_blocks"] = w.unique_blocks
        info["working_set_tokens"] = w.working_set_tokens
        if progress:
            _log(f"block keys: {info['unique_blocks']} unique blocks "
                 f"({time.perf_counter() - t:.1f} s)")
    points: list[tuple[int, float | None]] = []
    if fractions is not None:
        ws = info["working_set_tokens"]
        points = [(max(w.block_size, int(round(f * ws / w.block_size)) * w.block_size), f)
                  for f in fractions]
    elif capacities:
        points = [(c, None) for c in capacities]
    runs: list[RunResult] = []
    inf = None
    if "infinite" in policies:
        inf = run_infinite(w)
        runs.append(inf)
    bounded = [p for p in policies if p != "infinite"]
    if bounded and not points:
        raise ValueError("lru and optimal need a capacity (--capacity-tokens or a sweep)")
    for cap, frac in points:
        for p in bounded:
            r = run_policy(w, p, cap, progress, attribute="infinite" in policies)
            if frac is None and "working_set_tokens" in info and info["working_set_tokens"]:
                frac = cap / info["working_set_tokens"]
            r.capacity_fraction = frac
            runs.append(r)
            if progress:
                _log(f"{p:8} capacity {cap:>11,} tokens: hit rate {r.token_hit_rate:.4f} "
                     f"({r.wall_s:.1f} s)")
    info["runs"] = [r.to_dict() for r in runs]
    if len(points) > 1 or (points and inf is not None):
        curve = []
        for cap, _frac in points:
            row = {"capacity_tokens": cap}
            for r in runs:
                if r.capacity_tokens == cap:
                    row["capacity_fraction"] = r.capacity_fraction
                    row[r.policy] = r.token_hit_rate
            if inf is not None:
                row["infinite"] = inf.token_hit_rate
            curve.append(row)
        info["curve"] = curve
    return info
