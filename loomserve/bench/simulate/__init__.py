"""`loomserve bench simulate`: replay traces through loomserve's own KV cache manager, offline.

No model runs: every request of every trace goes through the real KV cache manager sized to a
capacity in tokens, and the simulator counts prefix-hit tokens, beside Belady's optimum and an
infinite cache. benchmarks/simulator_check.py checks it against KVCache.AI's kvcache-simulator
(`--semantics kvcache-sim`: LRU hit tokens agree exactly). What stays loomserve's own is the
eviction order: a free queue with each request's blocks freed tail first (a chain is evicted
leaf first, a shared head last), against kvcache-simulator's trie evicting its least recently
touched leaf.

    workload.py   the request model: merged replay order, synthetic prompts, block keys
    policies.py   lru (the real manager), optimal (Belady), infinite; `RunResult`
    sweep.py      policies x capacities, the hit-rate curve (`simulate`)
    cli.py        options, text and plot output, `main`

Every public name is importable from here.
"""

from loomserve.bench.simulate.cli import add_arguments, format_result, main, plot_curve
from loomserve.bench.simulate.policies import (
    PERCENTILES,
    POLICIES,
    RunResult,
    run_infinite,
    run_lru,
    run_optimal,
    run_policy,
)
from loomserve.bench.simulate.sweep import DEFAULT_SWEEP, simulate
from loomserve.bench.simulate.workload import SEMANTICS, SimRequest, Workload

__all__ = ["SEMANTICS", "POLICIES", "Workload", "RunResult", "run_lru", "run_optimal",
           "run_infinite", "run_policy", "simulate", "add_arguments", "main", "SimRequest",
           "DEFAULT_SWEEP", "PERCENTILES", "format_result", "plot_curve"]
