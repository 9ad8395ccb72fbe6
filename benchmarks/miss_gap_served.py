"""The served-vs-theoretical prefix-hit gap by miss cause, on AgentX replays of the shared
traces through a real `loomserve serve` at three KV pool sizes (loomserve.bench.miss_gap).

Server: the tiny-agent fixture (tiny Llama weights, 4096-token context) on CPU, block size 16,
--kv-cache-memory 2, 8 and 32 MiB (256, 1024 and 4096 blocks of 16 tokens). Client:
`loomserve bench agentx` over /work/shared/traces/weka, 4 live sessions for 60 s, --scale 16
(16 tokens per trace block), --max-context 4096, --max-output 32, think gaps x0.05. Per run:
the served and theoretical hit rates, the gap in points by cause and the unattributed
remainder, from the usage's miss_causes. A tiny model on CPU: the cache behaviour is real
(the same KV manager, scheduler and eviction), the timings are not a GPU's.

Usage: python benchmarks/miss_gap_served.py [--pools 2MiB 8MiB 32MiB] [--duration 60]
Writes benchmarks/results/miss_gap_served.json (and the runs' plots beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common.results import write_json  # noqa: E402

MODEL = os.path.join(ROOT, "tests", "fixtures", "tiny-agent")


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError("the server did not start")


def run_pool(pool: str, port: int, args, folder: str) -> dict:
    py = sys.executable
    log = open(os.path.join(folder, f"serve-{pool}.log"), "wb")
    server = subprocess.Popen([py, "-m", "loomserve", "serve", MODEL, "--port", str(port),
                               "--dtype", "float32", "--kv-cache-memory", pool,
                               "--block-size", "16"], stdout=log, stderr=subprocess.STDOUT,
                              cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, server)
        out = os.path.join(folder, f"agentx-{pool}.json")
        subprocess.run([py, "-m", "loomserve", "bench", "agentx", "--endpoint", url,
                        "--traces", args.traces, "--concurrency", str(args.concurrency),
                        "--duration", str(args.duration), "--scale", "16",
                        "--max-context", "4096", "--max-output", "32", "--time-scale", "0.05",
                        "--seed", "0", "--no-progress", "--json-out", out],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(out) as f:
            m = json.load(f)["metrics"]
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    g = m["miss_gap"]
    print(f"{pool}: served {g['served']:.2%} theoretical {g['theoretical']:.2%} gap "
          f"{g['gap_points']:.2f} {g['points']} unattributed {g['unattributed_points']:.3f}",
          file=sys.stderr)
    return {"pool": pool, "requests": m["requests"]["ok"], "miss_gap": g,
            "hit_rate": m["hit_rate"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pools", nargs="+", default=["2MiB", "8MiB", "32MiB"])
    p.add_argument("--traces", default="/work/shared/traces/weka")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--port", type=int, default=18741)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        runs = [run_pool(pool, a.port, a, folder) for pool in a.pools]
    from loomserve.bench.report import plot_miss_gap
    png = os.path.join(HERE, "results", "miss_gap_served.png")
    plot_miss_gap([r["miss_gap"] for r in runs], [r["pool"] for r in runs], png)
    out = {"model": "tiny-agent (CPU, float32)", "block_size": 16,
           "traces": os.path.basename(os.path.normpath(a.traces)),
           "concurrency": a.concurrency, "duration_s": a.duration, "runs": runs,
           "plot": os.path.relpath(png, ROOT), "load_avg_1m": os.getloadavg()[0]}
    print(write_json("miss_gap_served.json", out))


if __name__ == "__main__":
    main()
