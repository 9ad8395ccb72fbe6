"""What attributing prompt-cache misses costs (loomserve.kv.miss_causes), and the hit-rate gap
it explains on the shared AgentX traces.

Part 1, traces: every request of /work/shared/traces/weka goes through the real KVCacheManager
(`loomserve bench simulate`'s lru replay) at three pool sizes (10%, 30%, 60% of the working
set), beside the infinite cache (the theoretical hit rate). Per measured request: the CPU time
(this thread) of KVCacheManager.explain_miss, next to the manager's own CPU for the request
(probe, allocation, free); and the gap between the served and the theoretical hit rate split
by the causes it returned (loomserve.bench.miss_gap), with the unattributed remainder.

Part 2, engine: 32 streams of agent sessions (growing prompts: each turn appends 40-120
tokens to its session's previous prompt) through the tiny Llama fixture on CPU, in a pool
small enough to evict, 16 output tokens a turn (so about 0.7 admissions per step: far more
than agent turns of hundreds of output tokens). Per step: the CPU time (this thread: the
engine core runs in it) spent in explain_miss over the step's wall time, and the attribution
per step (its admissions amortized) against the host CPU of a 32-running scheduler step
(benchmarks/results/scheduler_step.json).

Usage: python benchmarks/miss_attribution_cost.py [--traces DIR] [--skip-engine]
Writes benchmarks/results/miss_attribution_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common.results import write_json  # noqa: E402

FRACTIONS = (0.1, 0.3, 0.6)


def traces_part(traces: str) -> dict:
    from loomserve.bench.simulate import Workload, run_infinite, run_lru
    from loomserve.bench.trace import load_traces

    w = Workload(load_traces([traces]))
    inf = run_infinite(w)
    runs = []
    for f in FRACTIONS:
        cap = max(w.block_size, int(f * w.working_set_tokens) // w.block_size * w.block_size)
        r = run_lru(w, cap, attribute=True)
        d = r.to_dict()
        runs.append({"capacity_fraction": f, "capacity_tokens": cap,
                     "hit_rate": d["token_hit_rate"], "theoretical": inf.token_hit_rate,
                     "miss_gap": d["miss_gap"], "attribution_cpu_us": d["attribution_cpu_us"],
                     "manager_cpu_us": d["manager_cpu_us"],
                     "measured_requests": d["measured_requests"]})
        g = d["miss_gap"]
        print(f"{f:.0%} of the working set: served {g['served']:.2%}, theoretical "
              f"{g['theoretical']:.2%}, gap {g['gap_points']:.2f} points {g['points']}, "
              f"unattributed {g['unattributed_points']:.3f}; attribution CPU median "
              f"{d['attribution_cpu_us']['median']:.1f} us, p99 "
              f"{d['attribution_cpu_us']['p99']:.1f} us; manager "
              f"{d['manager_cpu_us']['median']:.0f} us", file=sys.stderr)
    return {"traces": os.path.basename(os.path.normpath(traces)), "requests": len(w),
            "block_size": w.block_size, "working_set_tokens": w.working_set_tokens,
            "runs": runs}


def engine_part(streams: int = 32, turns: int = 4, seed: int = 0) -> dict:
    from loomserve import LLM, SamplingParams
    from loomserve.engine.processor import RequestState
    from loomserve.kv.cache_manager import KVCacheManager

    spent = [0]
    calls = [0]
    orig = KVCacheManager.explain_miss

    def timed(self, *a, **k):
        t = time.thread_time_ns()
        try:
            return orig(self, *a, **k)
        finally:
            spent[0] += time.thread_time_ns() - t
            calls[0] += 1

    KVCacheManager.explain_miss = timed
    tiny = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "tiny-llama")
    llm = LLM(tiny, kv_cache_memory=str(8192 * 160), block_size=16, dtype="float32",
              max_num_seqs=streams)
    rng = random.Random(seed)
    prompts = {s: [rng.randrange(3, 400) for _ in range(24)] for s in range(streams)}
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    step_s: list[float] = []
    per_step_attr: list[float] = []
    admissions = 0
    try:
        for turn in range(turns):
            states = {}
            for s in range(streams):
                p = prompts[s] = (prompts[s] + [rng.randrange(3, 400)
                                                for _ in range(rng.randint(40, 120))])[-200:]
                rid = f"t{turn}-s{s}"
                req = llm.inputs.make_core_request(rid, p, sp, session_id=f"s{s}")
                states[rid] = RequestState(rid, req.prompt_token_ids, sp, llm.tokenizer)
                llm.core.add(req)
            while llm.core.has_work():
                before = spent[0]
                t = time.perf_counter()
                llm.core.step()
                step_s.append(time.perf_counter() - t)
                per_step_attr.append((spent[0] - before) / 1e9)
            admissions += streams
    finally:
        KVCacheManager.explain_miss = orig
    total_step, total_attr = sum(step_s), sum(per_step_attr)
    sched = _scheduler_step_us()
    per_step_us = total_attr / len(step_s) * 1e6
    return {"streams": streams, "turns": turns, "steps": len(step_s), "admissions": admissions,
            "explain_miss_calls": calls[0],
            "attribution_us_per_admission": total_attr / max(1, calls[0]) * 1e6,
            "attribution_us_per_step": per_step_us,
            "step_ms_median": statistics.median(step_s) * 1e3,
            "attribution_share_of_step_time": total_attr / total_step,
            "scheduler_step_us_32_running": sched,
            "attribution_share_of_scheduler_step": per_step_us / sched if sched else None}


def _scheduler_step_us() -> float | None:
    """Host CPU of a scheduler step with 32 running (scheduler_step.json's first run)."""
    try:
        with open(os.path.join(HERE, "results", "scheduler_step.json")) as f:
            d = json.load(f)
        case = next(c for c in d["runs"][0]["cases"] if c["running"] == 32)
        return case["per_step"]["total"]["median_us"]
    except (OSError, StopIteration, KeyError, ValueError):
        return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--traces", default="/work/shared/traces/weka")
    p.add_argument("--skip-engine", action="store_true")
    a = p.parse_args()
    out = {"traces_part": traces_part(a.traces)}
    if not a.skip_engine:
        out["engine_part"] = engine_part()
        print(json.dumps(out["engine_part"], indent=1), file=sys.stderr)
    out["load_avg_1m"] = os.getloadavg()[0]
    print(write_json("miss_attribution_cost.json", out))


if __name__ == "__main__":
    main()
