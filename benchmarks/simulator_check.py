"""Reference check: `loomserve bench simulate` against KVCache.AI's `kvcache-simulator`.

Usage:
    benchmarks/peers/kvcache_sim_env.sh          # once: benchmarks/.peers/kvcache-sim-venv
    python benchmarks/simulator_check.py [TRACE_OR_DIR...] [--fractions 0.05,0.1,0.2,0.3,0.4]
        [--backend cpp|python] [--out benchmarks/results/simulator_check.json]

Both simulators replay the same requests (default: the 36 real traces in
/work/shared/traces/weka, merged in time order exactly as `loomserve bench simulate` orders them)
at the same capacities, in one run, and the script prints their LRU (and optimal) hit rates side
by side. It exits 1 when an LRU point differs by more than 1 percentage point.

The reference. `kvcache-simulator` 0.1.3 (PyPI, Apache-2.0, by KVCache.AI; installed only in the
peer venv, never a loomserve dependency) is driven through its own CLI,
`kvcache-simulator run --trace T.jsonl --model llama-3.1-8b --budgets-gib ... --policies
lru,optimal --format json` (default C++ backend, which it compiles on first use with `c++`). Its
input is JSONL, one request per line ({"block_size", "hash_ids", "input_length"}), replayed in
file order. Capacities are memory budgets in GiB turned into blocks with the model's bytes per
block; the script asks once for llama-3.1-8b's bytes per 64-token block and passes
(blocks + 0.5) * bytes / GiB so each budget floors to exactly the intended block count, which it
checks in the output (`cacheBlocks`). What its source (kvcache_sim/policies.py, trace.py,
plan.py) does, read from the wheel:
  * hash ids are interned and built into a prefix trie (node = parent node + id), so a block is
    its whole prefix, like loomserve's chained hashes; per-trace scopes are kept here by giving
    each trace's ids their own numbers (the simulator's interned trace-block ids);
  * a block weighs min(block_size, input_length - 64 i) tokens; with input_length = 64 *
    len(hash_ids) (the trace tail past the last full block has no id, so it is left out) every
    block weighs 64 and the denominator is 64 * len(hash_ids);
  * hit = tokens of the longest continuously cached prefix, no "- 1" cap; only the last 50% of
    requests are measured (warmup = floor(n / 2)); a budget whose cache did not fill before that
    window is omitted from the output, and so are budgets above the trie's node count;
  * LRU: after the hit scan, the request's present path is protected, its hit prefix touched
    (clock increases along the path), missing blocks inserted in order (a block only under a
    present parent), each insertion into a full cache evicting the unprotected *leaf* of the trie
    with the oldest touch; when nothing can be evicted the rest of the request is not cached;
  * optimal: the same trie, evicting the leaf whose next request is farthest, and not inserting
    a block whose next request is not nearer than that (bypass).
loomserve's side is `--semantics kvcache-sim` (the same accounting: full trace blocks only, no
cap, last 50%), with the eviction left to loomserve's KVCacheManager (free queue, a request's
blocks freed tail first) and Belady from loomserve.bench.belady for `optimal`.

Why the LRU numbers can still differ (and what the run shows):
  * eviction granularity/order: the trie evicts the globally oldest leaf; loomserve's queue
    evicts the oldest *freed* block, and tail-first freeing puts a chain's leaf before its head
    (a parent is always more recent than its children, so the queue front is always a leaf, too).
    The two orders are the same up to ties within a request's own path, so they agree closely;
  * capacity accounting: loomserve's pool must also hold the running request (its blocks are
    claimed, not evictable, while it runs) plus one unhashed block for the marker token; the
    simulator gives the pool that one extra block so the cached blocks number the same;
  * a request larger than the free space is cached up to what fits in both;
  * time ordering: identical (the JSONL is written in loomserve's merged order).
The run's JSON records both results per capacity, the differences, and the ceilings (kvcache-
simulator's `hitRateCeiling` against loomserve's infinite policy, which must be equal).

Result on the 36 weka traces (2,156 requests, 134,982 unique blocks; capacities 5-40% of them,
all filled before the window; benchmarks/results/simulator_check.json): LRU hit tokens are
identical at every capacity (difference 0.000 pp), Belady equals kvcache-simulator's `optimal`,
and the ceilings agree (0.973566). The one case where they would part: a single request larger
than the whole cache -- kvcache-simulator then keeps exactly `capacity` blocks, loomserve's pool
(capacity + 1 blocks, the extra one for the marker token) can keep one more; no request of these
traces is that large at these capacities.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loomserve.bench.simulate import Workload, run_infinite, run_lru, run_optimal  # noqa: E402
from loomserve.bench.trace import load_traces  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from common.results import write_json  # noqa: E402

VENV = ROOT / "benchmarks" / ".peers" / "kvcache-sim-venv"
CLI = VENV / "bin" / "kvcache-simulator"
MODEL = "llama-3.1-8b"
GIB = 1 << 30
DEFAULT_TRACES = "/work/shared/traces/weka"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_jsonl(w: Workload, path: Path) -> None:
    with path.open("w") as f:
        for r in w.requests:
            f.write(json.dumps({"block_size": r.trace_block_size, "hash_ids": list(r.block_tids),
                                "input_length": r.counted_tokens, "timestamp": r.t}) + "\n")


def run_ref(trace: Path, budgets: list[float], backend: str) -> dict:
    cmd = [str(CLI), "run", "--trace", str(trace), "--model", MODEL, "--budgets-gib",
           ",".join(repr(b) for b in budgets), "--policies", "lru,optimal", "--backend", backend,
           "--format", "json", "--no-progress"]
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    res = json.loads(out.stdout)
    res["_wall_s"] = time.perf_counter() - t
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", default=[DEFAULT_TRACES])
    ap.add_argument("--fractions", default="0.05,0.1,0.2,0.3,0.4",
                    help="capacities as fractions of the working set (unique blocks)")
    ap.add_argument("--backend", choices=["cpp", "python"], default="cpp")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "simulator_check.json"))
    args = ap.parse_args()
    if not CLI.exists():
        log(f"{CLI} missing: run benchmarks/peers/kvcache_sim_env.sh first")
        return 2

    sessions = load_traces(args.traces)
    w = Workload(sessions, semantics="kvcache-sim")
    wl = Workload(sessions)  # loomserve semantics, for context
    unique = w.unique_blocks
    fracs = [float(x) for x in args.fractions.split(",")]
    caps = [max(1, round(f * unique)) for f in fracs]
    log(f"{len(sessions)} traces, {len(w)} requests, {unique} unique blocks; capacities {caps}")

    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "merged.jsonl"
        write_jsonl(w, trace)
        probe = run_ref(trace, [1.0], args.backend)
        bpb = float(probe["metadata"]["bytesPerBlock"])
        budgets = [(c + 0.5) * bpb / GIB for c in caps]
        ref = run_ref(trace, budgets, args.backend)
    meta = ref["metadata"]
    ref_points = {p["cacheBlocks"]: p["results"] for p in ref["points"]}
    log(f"kvcache-simulator: {meta['requestCount']} requests, {meta['uniqueBlocks']} unique "
        f"blocks, warmup {meta['warmupRequests']}, {ref['_wall_s']:.1f} s for "
        f"{len(caps)} capacities x 2 policies")

    inf = run_infinite(w)
    rows = []
    worst = 0.0
    for f, c in zip(fracs, caps):
        lru = run_lru(w, c * w.block_size)
        opt = run_optimal(w, c * w.block_size)
        lru_l = run_lru(wl, c * wl.block_size)
        ref_res = ref_points.get(c)
        row = {"fraction": f, "capacity_blocks": c, "capacity_tokens": c * w.block_size,
               "loomserve_lru": lru.token_hit_rate, "loomserve_optimal": opt.token_hit_rate,
               "loomserve_lru_filled_before_window": lru.filled_before_window,
               "loomserve_lru_s": lru.wall_s, "loomserve_lru_evictions": lru.evictions,
               "loomserve_semantics_lru": lru_l.token_hit_rate}
        if ref_res is None:
            row["kvcache_sim"] = None
            row["note"] = ("omitted by kvcache-simulator: cache not full before the measurement "
                           "window (or capacity above its unique blocks)")
        else:
            r_lru, r_opt = ref_res["lru"], ref_res["optimal"]
            row.update({"kvcache_sim_lru": r_lru["hitRate"],
                        "kvcache_sim_optimal": r_opt["hitRate"],
                        "kvcache_sim_lru_hit_tokens": r_lru["hitTokens"],
                        "loomserve_lru_hit_tokens": lru.hit_tokens,
                        "kvcache_sim_total_tokens": r_lru["totalTokens"],
                        "loomserve_total_tokens": lru.counted_tokens,
                        "lru_diff_pp": 100 * (lru.token_hit_rate - r_lru["hitRate"]),
                        "optimal_diff_pp": 100 * (opt.token_hit_rate - r_opt["hitRate"])})
            worst = max(worst, abs(row["lru_diff_pp"]))
        rows.append(row)

    print(f"{'capacity':>10} {'of WS':>6} | {'LRU kvsim':>9} {'LRU loom':>9} {'diff pp':>8} | "
          f"{'OPT kvsim':>9} {'Belady':>9} {'diff pp':>8} | {'LRU loom-sem':>12}")
    for r in rows:
        if r.get("kvcache_sim_lru") is None:
            print(f"{r['capacity_blocks']:>10,} {r['fraction']:>6.0%} | {'omitted':>9} "
                  f"{r['loomserve_lru']:>9.4f} {'':>8} | {'':>9} {r['loomserve_optimal']:>9.4f} "
                  f"{'':>8} | {r['loomserve_semantics_lru']:>12.4f}")
            continue
        print(f"{r['capacity_blocks']:>10,} {r['fraction']:>6.0%} | {r['kvcache_sim_lru']:>9.4f} "
              f"{r['loomserve_lru']:>9.4f} {r['lru_diff_pp']:>+8.3f} | "
              f"{r['kvcache_sim_optimal']:>9.4f} {r['loomserve_optimal']:>9.4f} "
              f"{r['optimal_diff_pp']:>+8.3f} | {r['loomserve_semantics_lru']:>12.4f}")
    print(f"ceiling: kvcache-simulator {ref['hitRateCeiling']:.6f}, loomserve infinite "
          f"{inf.token_hit_rate:.6f}")
    ok = worst <= 1.0
    print(f"largest LRU difference {worst:.3f} pp: {'OK (<= 1 pp)' if ok else 'FAIL (> 1 pp)'}")

    ref_version = subprocess.run([str(VENV / "bin" / "python"), "-c",
                                  "from importlib.metadata import version;"
                                  "print(version('kvcache-simulator'))"],
                                 capture_output=True, text=True).stdout.strip() or None
    result = {
        "benchmark": "simulator_check",
        "traces": [os.fspath(t) for t in args.traces], "num_traces": len(sessions),
        "requests": len(w), "unique_blocks": unique, "block_size": w.block_size,
        "reference": {"package": "kvcache-simulator", "version": ref_version, "model": MODEL,
                      "backend": args.backend, "bytes_per_block": bpb,
                      "warmup_requests": meta["warmupRequests"],
                      "unique_blocks": meta["uniqueBlocks"], "wall_s": ref["_wall_s"],
                      "hit_rate_ceiling": ref["hitRateCeiling"]},
        "loomserve": {"semantics": "kvcache-sim", "warmup_requests": w.warmup_requests,
                      "infinite_hit_rate": inf.token_hit_rate},
        "points": rows, "max_lru_diff_pp": worst, "within_1pp": ok,
    }
    write_json(args.out, result)
    log(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
