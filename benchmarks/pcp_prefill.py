"""Prefill context parallelism: the time to prefill one long cold prompt at P = 1 and P = 2.

Offline engine (loomserve.LLM, the core stepped in this process; at P = 2 one worker process
more), the default model (SmolLM2-135M) in float32 unless --model, one prompt of --tokens fresh
token ids, max_tokens 1 (the time is the prefill plus one sampled token), --repeats prompts per
layout, each new (no prefix hit). Layouts, on this host's cores:
  p1-t1   P = 1, one torch thread         (the per-rank budget of p2-t1)
  p1-tN   P = 1, N = all cores' threads   (the same cores as p2-t1, used by one process)
  p2-t1   P = 2, one torch thread per rank
Reported: median seconds per prompt and tokens/s, beside the FLOP limit of the layout: 2 x
parameters (less the embedding table: a lookup) x tokens plus the causal attention's 2 x layers x tokens^2 x hidden, at the fp32
torch.mm rate measured here with the layout's threads (x P ranks for P = 2).

    python benchmarks/pcp_prefill.py [--tokens 2048] [--repeats 3]

Writes benchmarks/results/pcp_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, host_info, write_json  # noqa: E402


def mm_gflops(threads: int) -> float:
    """fp32 torch.mm GFLOP/s at `threads` threads (1024^3, best of 5)."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x @ x
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(old)
    return 2 * 1024 ** 3 / best / 1e9


def run(layout: str, pcp: int, threads: int, a) -> dict:
    os.environ["LOOMSERVE_NUM_THREADS"] = str(threads)  # the worker inherits it
    from loomserve import LLM, SamplingParams
    llm = LLM(a.model, prefill_context_parallel_size=pcp, dtype="float32",
              max_model_len=a.tokens + 64, kv_cache_memory=a.kv_cache_memory,
              max_num_batched_tokens=a.tokens)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=1)
        llm.generate([random.Random(0).randrange(100, 40000) for _ in range(64)], sp)  # warm-up
        times = []
        for k in range(a.repeats):
            prompt = [random.Random(1 + k).randrange(100, 40000) for _ in range(a.tokens)]
            t0 = time.perf_counter()
            out = llm.generate(prompt, sp)
            times.append(time.perf_counter() - t0)
            assert out[0].num_cached_tokens == 0
        med = statistics.median(times)
        cfg = llm.core.runner.model_config
        n, layers = a.tokens, cfg.num_layers
        matmul_params = llm.core.runner.num_params - cfg.vocab_size * cfg.hidden_size  # no lookup
        flops = 2 * matmul_params * n + 2 * layers * n * n * cfg.hidden_size
        rate = mm_gflops(threads) * pcp
        return {"layout": layout, "pcp": pcp, "threads_per_rank": threads,
                "seconds": [round(t, 3) for t in times], "median_s": round(med, 3),
                "tok_s": round(a.tokens / med, 1), "gflop": round(flops / 1e9, 1),
                "mm_gflops": round(rate, 1), "flop_limit_s": round(flops / rate / 1e9, 3)}
    finally:
        llm.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: the built-in one)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "pcp_prefill.json"))
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    runs = []
    for layout, pcp, threads in (("p1-t1", 1, 1), (f"p1-t{cores}", 1, cores), ("p2-t1", 2, 1)):
        r = run(layout, pcp, threads, a)
        print(json.dumps(r), flush=True)
        runs.append(r)
    write_json(a.out, {"host": host_info(), "args": vars(a), "loadavg_end": os.getloadavg(),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs})
    print(f"{'layout':>8} {'median s':>9} {'tok/s':>8} {'FLOP limit s':>13}")
    for r in runs:
        print(f"{r['layout']:>8} {r['median_s']:>9} {r['tok_s']:>8} {r['flop_limit_s']:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
