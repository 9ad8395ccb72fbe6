"""Scheduler + KV bookkeeping CPU time per engine step, without the model.

32 requests decode together (prompts of 1-4K tokens, prefix caching on, block size 16); each
step runs Scheduler.schedule() and Scheduler.update() with a sampled token per request, exactly
as EngineCore.step() does around the forward pass. Reported: median and p99 microseconds per
step over many steps, repeated; target < 1 ms at 32 running requests.

    python benchmarks/scheduler_step.py [--running 32] [--steps 2000] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from loomserve.execution.request import Request
from loomserve.execution.scheduler import Scheduler
from loomserve.kv.cache_manager import KVCacheManager
from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from loomserve.sampling_params import SamplingParams


def run_once(running: int, steps: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=running * (4096 + steps) // 16 + 64,
                        groups=(KVCacheGroup(spec, tuple(range(30))),))
    kv = KVCacheManager(cfg)
    sched = Scheduler(kv, max_num_batched_tokens=1 << 20, max_num_seqs=running,
                      long_prefill_threshold=0)
    params = SamplingParams(temperature=0, max_tokens=steps + 10, ignore_eos=True)
    for i in range(running):
        prompt = [rng.randrange(50_000) for _ in range(rng.randint(1024, 4096))]
        sched.add(Request(f"r{i}", prompt, params, params.max_tokens))
    sampled = {f"r{i}": 1 for i in range(running)}
    out = sched.schedule()  # the prefill step, not timed
    sched.update(out, sampled)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.update(out, {k: rng.randrange(50_000) for k in sampled})
        times.append(time.perf_counter() - t0)
    assert len(out.scheduled) == running
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--running", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    medians, p99s = [], []
    for r in range(args.repeats):
        t = sorted(run_once(args.running, args.steps, seed=r))
        medians.append(statistics.median(t) * 1e6)
        p99s.append(t[int(len(t) * 0.99)] * 1e6)
    result = {"running": args.running, "steps": args.steps, "repeats": args.repeats,
              "median_us_per_step": statistics.median(medians),
              "p99_us_per_step": statistics.median(p99s), "target_us": 1000}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"scheduler+KV per step at {args.running} running: median "
              f"{result['median_us_per_step']:.0f} us, p99 {result['p99_us_per_step']:.0f} us "
              f"(target < 1000 us)", file=sys.stderr)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
