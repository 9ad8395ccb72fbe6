"""Sustained memory read bandwidth of this machine, for decode rooflines.

What it measures (all medians over ``--repeats`` passes, after one warm-up pass):
  * ``torch_sum``   - torch.sum over a float32 tensor of ``--gib`` GiB with ``--threads``
                      torch threads: bytes read / time.
  * ``torch_copy``  - dst.copy_(src) over half that size: (read + write bytes) / time.
  * ``numpy_copy``  - np.copyto(dst, src), single-threaded: (read + write bytes) / time.
  * ``numpy_sum``   - np.add.reduce, single-threaded: bytes read / time.
  The headline ``read_gbs`` is the larger of torch_sum and numpy_sum: decode is a streaming
  read of weights and KV cache, and a roofline should be a ceiling.
  * ``torch_sum_llc`` - the torch sum over a 128 MiB tensor, i.e. what a working set that
                      fits in the last-level cache sees (for information: a 135M-parameter
                      model in bf16 is ~270 MB, and some server CPUs have L3 that large).

The buffers are far larger than any cache by default (2 GiB), so the main numbers are DRAM
bandwidth. The result is cached in benchmarks/results/membw.json together with a host
fingerprint; ``measure_read_bandwidth()`` returns the cached read GB/s when the host and
settings match, else measures again.

Run:    python benchmarks/membw.py [--gib 2] [--threads 2] [--repeats 7] [--refresh]
Import: from membw import measure_read_bandwidth   (benchmarks/ on sys.path)
Needs:  torch, numpy; ~2 GiB of free RAM at the default size. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, host_info, median, write_json  # noqa: E402

RESULT_NAME = "membw.json"
DEFAULT_GIB = 2.0
DEFAULT_THREADS = 2
DEFAULT_REPEATS = 7


def _time_it(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm-up: page faults, thread pool start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def run_all(gib: float = DEFAULT_GIB, threads: int = DEFAULT_THREADS,
            repeats: int = DEFAULT_REPEATS, numpy_too: bool = True) -> dict[str, Any]:
    """Run every measurement; returns a dict of GB/s (1 GB = 1e9 bytes) and settings."""
    import numpy as np
    import torch

    # Bound methods and partials, not lambdas: a lambda would close over buffers that are
    # deleted (to free their memory) right after their measurement.
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict[str, Any] = {}
    try:
        n = int(gib * (1 << 30)) // 4
        x = torch.ones(n, dtype=torch.float32)  # ones, not empty: pages must be touched
        nbytes = x.numel() * 4
        t = _time_it(x.sum, repeats)
        out["torch_sum"] = nbytes / median(t) / 1e9
        out["torch_sum_best"] = nbytes / min(t) / 1e9
        del x

        half = n // 2
        src = torch.ones(half, dtype=torch.float32)
        dst = torch.zeros(half, dtype=torch.float32)
        t = _time_it(partial(dst.copy_, src), repeats)
        out["torch_copy"] = 2 * half * 4 / median(t) / 1e9
        del src, dst

        small = torch.ones((128 << 20) // 4, dtype=torch.float32)
        t = _time_it(small.sum, max(repeats, 15))
        out["torch_sum_llc"] = small.numel() * 4 / median(t) / 1e9
        del small

        if numpy_too:
            a = np.ones(half, dtype=np.float32)
            b = np.zeros(half, dtype=np.float32)
            t = _time_it(partial(np.copyto, b, a), repeats)
            out["numpy_copy"] = 2 * a.nbytes / median(t) / 1e9
            del b
            t = _time_it(partial(np.add.reduce, a), max(3, repeats // 2))
            out["numpy_sum"] = a.nbytes / median(t) / 1e9
            del a
    finally:
        torch.set_num_threads(old_threads)
    out = {k: round(v, 2) for k, v in out.items()}
    # Headline: the best of the read-only measures, since a roofline is a ceiling.
    read = max(out["torch_sum"], out.get("numpy_sum", 0.0))
    return {"read_gbs": read, "gbs": out,
            "settings": {"gib": gib, "threads": threads, "repeats": repeats},
            "host": host_info(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _cached(gib: float, threads: int) -> dict[str, Any] | None:
    path = os.path.join(RESULTS_DIR, RESULT_NAME)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    host, now = data.get("host", {}), host_info()
    same_host = all(host.get(k) == now.get(k) for k in ("cpu", "nproc", "hostname"))
    s = data.get("settings", {})
    if same_host and s.get("threads") == threads and s.get("gib") == gib and "read_gbs" in data:
        return data
    return None


def measure_read_bandwidth(refresh: bool = False, gib: float = DEFAULT_GIB,
                           threads: int = DEFAULT_THREADS,
                           repeats: int = DEFAULT_REPEATS) -> float:
    """Sustained read bandwidth in GB/s (best of the torch and numpy sums, each a median).

    Cached in benchmarks/results/membw.json per host and settings; ``refresh`` re-measures.
    """
    if not refresh:
        data = _cached(gib, threads)
        if data is not None:
            return float(data["read_gbs"])
    data = run_all(gib=gib, threads=threads, repeats=repeats)
    write_json(RESULT_NAME, data)
    return float(data["read_gbs"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=DEFAULT_GIB, help="buffer size for the sum")
    ap.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--refresh", action="store_true", help="ignore the cached result")
    args = ap.parse_args()
    data = None if args.refresh else _cached(args.gib, args.threads)
    if data is None:
        data = run_all(gib=args.gib, threads=args.threads, repeats=args.repeats)
        print("wrote", write_json(RESULT_NAME, data), file=sys.stderr)
    else:
        print("(cached result; --refresh to measure again)", file=sys.stderr)
    for k, v in data["gbs"].items():
        print(f"{k:>15}: {v:8.2f} GB/s")
    print(f"sustained read bandwidth: {data['read_gbs']:.2f} GB/s "
          f"({data['settings']['threads']} threads, {data['settings']['gib']} GiB)")


if __name__ == "__main__":
    main()
