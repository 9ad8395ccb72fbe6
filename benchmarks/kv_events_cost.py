"""What publishing KV events costs per engine step (loomserve.kv.event_publisher).

Workload: steps of a decode-heavy batch. Each step the pool reports S BlockStored events of one
16-token block each (S sequences crossing a block boundary; default 32) and one BlockRemoved of
S hashes (the blocks their allocations evicted): what a 32-sequence decode step produces at
worst. We time, per step:
  core thread: the pool's hook calls (on_pool_event) + flush() (the hand-off to the thread);
  publisher thread: converting to wire events, msgpack encoding and the PUB send (measured
  as the wall time to drain N queued batches, with no subscriber, divided by N).
The step's own share is the core-thread number; the thread runs beside the step (the GIL makes
it not free: its time is in end-to-end, and process CPU time counts both threads). Median over --reps runs of --steps steps.

Usage: python benchmarks/kv_events_cost.py [--steps 2000] [--seqs 32] [--reps 5]
Writes benchmarks/results/kv_events_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from loomserve.kv import events as ev
from loomserve.kv.event_publisher import KVEventPublisher
from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.results import write_json  # noqa: E402

BS = 16


def run(steps: int, seqs: int) -> tuple[float, float, float, int]:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=8, head_dim=64, dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=4096, groups=(KVCacheGroup(spec, tuple(range(8))),))
    pub = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", cfg,
                           buffer_steps=steps + 1, max_queue_batches=steps + 1)
    toks = list(range(BS))
    h = 0
    events = []
    for _ in range(steps):  # built beforehand: the pool builds them whether anyone listens
        step = []
        for _ in range(seqs):
            h += 1
            step.append(ev.BlockStored([h.to_bytes(16, "big")], (h - 1).to_bytes(16, "big"),
                                       toks, BS, 0))
        step.append(ev.BlockRemoved([(h - i).to_bytes(16, "big") for i in range(seqs)], 0))
        events.append(step)
    while pub.stats()["pending"]:  # batch 0
        time.sleep(0.001)
    t0 = time.perf_counter()
    c0 = time.process_time()  # both threads: a shared host inflates wall time, not this
    for step in events:
        for e in step:
            pub.on_pool_event(e)
        pub.flush()
    core = (time.perf_counter() - t0) / steps
    while pub.stats()["pending"]:
        time.sleep(0.0005)
    total = (time.perf_counter() - t0) / steps
    cpu = (time.process_time() - c0) / steps
    size = len(pub._buffer[-1][1])
    pub.close()
    return core, total, cpu, size


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    runs = [run(a.steps, a.seqs) for _ in range(a.reps)]
    core = statistics.median(r[0] for r in runs) * 1e6
    total = statistics.median(r[1] for r in runs) * 1e6
    cpu = statistics.median(r[2] for r in runs) * 1e6
    out = {"cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"),
           "steps": a.steps, "seqs_per_step": a.seqs, "reps": a.reps,
           "core_thread_us_per_step": round(core, 2),
           "end_to_end_us_per_step": round(total, 2),
           "process_cpu_us_per_step": round(cpu, 2),
           "payload_bytes_per_step": runs[-1][3], "load_avg_1m": os.getloadavg()[0]}
    print(json.dumps(out, indent=1))
    write_json("kv_events_cost.json", out)


if __name__ == "__main__":
    main()
