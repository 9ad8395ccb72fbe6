"""Cost of `KVCacheManager.refresh_prefix` (an arriving request's cached prefix made the most
recently used) beside the prefix probe that hashes the prompt, at long contexts.

A prompt of N tokens is computed and freed; then, per repeat, a fresh request with the same
prompt plus 64 new tokens is probed (`get_computed_blocks`, which hashes the prompt), and
another is refreshed (`refresh_prefix`: hashing + lookup + touch and re-free of every hit
block). The difference is what the refresh adds to a request's arrival.

    python benchmarks/kv_refresh_cost.py [--tokens 131072] [--repeats 7]

Writes benchmarks/results/kv_refresh_cost.json (--out NAME: another file).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# The simulator's manager (token-level spec) and request stand-in: nothing here is new.
from loomserve.bench.simulate.policies import _make_manager
from loomserve.bench.simulate.workload import _KVReq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.results import write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="kv_refresh_cost.json", help="result file")
    a = ap.parse_args()
    kv = _make_manager(a.tokens // a.block_size + 64, a.block_size, 1)
    prompt = list(range(a.tokens))
    first = _KVReq("first", prompt, None, None)
    hit, n = kv.get_computed_blocks(first)
    assert kv.allocate_slots(first, len(prompt) - n, hit, n)
    first.num_computed_tokens = len(prompt)
    kv.free(first)
    probe, refresh = [], []
    for k in range(a.repeats):
        tokens = prompt + [7] * 64
        t0 = time.perf_counter()
        kv.get_computed_blocks(_KVReq(f"p{k}", list(tokens), None, None), record_stats=False)
        t1 = time.perf_counter()
        n = kv.refresh_prefix(_KVReq(f"r{k}", list(tokens), None, None))
        t2 = time.perf_counter()
        probe.append(t1 - t0)
        refresh.append(t2 - t1)
    p, r = statistics.median(probe) * 1e3, statistics.median(refresh) * 1e3
    print(f"{a.tokens} tokens, {n} hit blocks: probe {p:.2f} ms, refresh {r:.2f} ms "
          f"(adds {r - p:.2f} ms; medians of {a.repeats})")
    write_json(a.out, {"tokens": a.tokens, "block_size": a.block_size, "repeats": a.repeats,
                       "hit_blocks": n, "probe_ms": as_ms(probe), "refresh_ms": as_ms(refresh),
                       "probe_ms_median": p, "refresh_ms_median": r})


def as_ms(seconds: list[float]) -> list[float]:
    return [round(s * 1e3, 4) for s in seconds]


if __name__ == "__main__":
    main()
