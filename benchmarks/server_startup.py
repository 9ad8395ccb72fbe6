"""Server start time and resident memory with the default model.

Starts `loomserve serve` (no model argument: the built-in SmolLM2-135M-Instruct) on a free
127.0.0.1 port, times launch -> first 200 from /health, sends one short completion, then reads
resident memory (VmRSS) and its peak (VmHWM) from /proc, summed over the server's process and
its children (the engine core runs in its own process), with the core's share apart. The first
start may
convert the GGUF into the weight cache; the following starts are the warm figure (median).
Targets: ready in < 15 s with cached weights; RSS < 2 GB at default settings.

    python benchmarks/server_startup.py [--repeats 3] [--dtype float32] [--engine-in-process] [--json]

Writes benchmarks/results/server_startup.json (--out NAME: another file).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common.results import write_json  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_mem_mb(pid: int) -> dict[str, float]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def tree_mem_mb(pid: int) -> dict[str, float]:
    """VmRSS / VmHWM of pid plus its children; the children's part as core_*."""
    top = proc_mem_mb(pid)
    kids = [proc_mem_mb(c) for c in children(pid)]
    core = {k: sum(m.get(k, 0.0) for m in kids) for k in ("VmRSS", "VmHWM")}
    return {"rss_mb": top["VmRSS"] + core["VmRSS"], "peak_rss_mb": top["VmHWM"] + core["VmHWM"],
            "core_rss_mb": core["VmRSS"]}


def start_once(extra: list[str]) -> dict[str, float]:
    port = free_port()
    cmd = [sys.executable, "-m", "loomserve", "serve", "--port", str(port), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": httpx.get(url + "/v1/models").json()["data"][0]["id"],
            "prompt": "The capital of France is", "max_tokens": 8})
        r.raise_for_status()
        return {"ready_s": ready, **tree_mem_mb(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default="server_startup.json", help="result file")
    ap.add_argument("--engine-in-process", action="store_true",
                    help="time the one-process layout (the engine core in a thread)")
    args = ap.parse_args()
    extra = ["--dtype", args.dtype] if args.dtype else []
    if args.engine_in_process:
        extra.append("--engine-in-process")
    first = start_once(extra)
    warm = [start_once(extra) for _ in range(args.repeats)]
    result = {
        "first_start": first,
        "warm_ready_s_median": statistics.median(w["ready_s"] for w in warm),
        "warm_rss_mb_median": statistics.median(w["rss_mb"] for w in warm),
        "warm_peak_rss_mb_median": statistics.median(w["peak_rss_mb"] for w in warm),
        "warm_core_rss_mb_median": statistics.median(w["core_rss_mb"] for w in warm),
        "repeats": args.repeats, "cpus": os.cpu_count(),
        "targets": {"ready_s": 15, "rss_mb": 2000}, "warm": warm,
    }
    print(json.dumps(result, indent=None if args.json else 2))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
