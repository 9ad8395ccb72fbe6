"""The served-vs-theoretical prefix-hit gap by miss cause, on AgentX replays of the shared
traces through a real `loomserve serve` at three KV pool sizes (loomserve.bench.miss_gap).

Server: the tiny-agent fixture (tiny Llama weights, 4096-token context) on CPU, block size 16,
--kv-cache-memory 2, 8 and 32 MiB (256, 1024 and 4096 blocks of 16 tokens). Client:
`loomserve bench agentx` over /work/shared/traces/weka, 4 live sessions for 60 s, --scale 16
(16 tokens per trace block), --max-context 4096, --max-output 32, think gaps x0.05. Per run:
the served and theoretical hit rates, the gap in points by cause and the unattributed
remainder, from the usage's miss_causes. A tiny model on CPU: the cache behaviour is real
(the same KV manager, scheduler and eviction), the timings are not a GPU's.

With --router N: N such instances (KV events on) behind `loomserve router` (default policy),
each with the pool given (a tight one: the sessions outgrow it, so they are evicted and
moved); the replay goes through the router, which writes its causes (placed_elsewhere,
session_moved, index_stale) into each stream's usage, so the client's report attributes them.
The router's own miss counter is kept beside it, and the client's usages' causes summed over
all its requests (primers included), which the counter must equal.

Usage: python benchmarks/miss_gap_served.py [--pools 2MiB 8MiB 32MiB] [--duration 60]
       python benchmarks/miss_gap_served.py --router 2 --pools 3MiB 4MiB [--policy kv_aware]
Writes benchmarks/results/miss_gap_served.json (-router.json with --router, -router-POLICY.json
with another policy) and a plot beside it: a stacked bar per run.
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


def spawn(argv: list[str], log_path: str) -> tuple[subprocess.Popen, object]:
    log = open(log_path, "wb")
    return subprocess.Popen([sys.executable, "-m", "loomserve", *argv], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT), log


def serve_argv(pool: str, port: int, events: bool) -> list[str]:
    argv = ["serve", MODEL, "--port", str(port), "--dtype", "float32", "--kv-cache-memory",
            pool, "--block-size", "16"]
    return argv + (["--kv-events-endpoint", f"tcp://127.0.0.1:{port + 1}"] if events else [])


def run_pool(pool: str, port: int, args, folder: str) -> dict:
    """One instance (or args.router instances behind the router) at `pool`, one replay."""
    n = args.router or 1
    procs = [spawn(serve_argv(pool, port + 10 * (i + 1), args.router > 0),
                   os.path.join(folder, f"serve-{pool}-{i}.log")) for i in range(n)]
    urls = [f"http://127.0.0.1:{port + 10 * (i + 1)}" for i in range(n)]
    url = urls[0]
    try:
        for u, (proc, _) in zip(urls, procs):
            wait_up(u, proc)
        if args.router:
            url = f"http://127.0.0.1:{port}"
            argv = ["router", "--port", str(port), "--log-level", "warning", "--policy",
                    args.policy]
            procs.append(spawn(argv + [x for u in urls for x in ("--instance", u)],
                               os.path.join(folder, f"router-{pool}.log")))
            wait_router(url, procs[-1][0])
        out = os.path.join(folder, f"agentx-{pool}.json")
        subprocess.run([sys.executable, "-m", "loomserve", "bench", "agentx", "--endpoint", url,
                        "--traces", args.traces, "--concurrency", str(args.concurrency),
                        "--duration", str(args.duration), "--scale", "16",
                        "--max-context", "4096", "--max-output", "32", "--time-scale", "0.05",
                        "--seed", "0", "--no-progress", "--json-out", out]
                       + (["--records"] if args.router else []),
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(out) as f:
            result = json.load(f)
        m = result["metrics"]
        router = None
        if args.router:
            router = router_side(url)
            router["client_miss_tokens"] = client_causes(result["records"])
    finally:
        for proc, log in reversed(procs):
            proc.terminate()
            proc.wait(30)
            log.close()
    g = m["miss_gap"]
    print(f"{pool}: served {g['served']:.2%} theoretical {g['theoretical']:.2%} gap "
          f"{g['gap_points']:.2f} {g['points']} unattributed {g['unattributed_points']:.3f}",
          file=sys.stderr)
    run = {"pool": pool, "requests": m["requests"]["ok"], "miss_gap": g,
           "hit_rate": m["hit_rate"]}
    if router is not None:
        run.update(instances=n, router=router)
    return run


def client_causes(records: list[dict]) -> dict[str, int]:
    """The miss causes the client's usages reported, summed over every request (primers
    included): what the router's counter must also hold."""
    out: dict[str, int] = {}
    for r in records:
        for k, v in (r.get("miss_causes") or {}).items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def wait_router(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    """Every instance up and the router's tokenizer loaded (else it routes blind)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the router exited")
        try:
            h = json.load(urllib.request.urlopen(url + "/health", timeout=2))
            if h["tokenizer"] and all(r["up"] for r in h["instances"]):
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError("the router did not get ready")


def router_side(url: str) -> dict:
    """The router's miss counter by cause and its decisions by reason, from its /metrics."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    miss, reasons = {}, {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith("loomserve_prefix_cache_miss_tokens_total{") and float(value):
            miss[name.split('cause="')[1].split('"')[0]] = int(float(value))
        elif line.startswith("loomserve_router_requests_total{") and float(value):
            reason = name.split('reason="')[1].split('"')[0]
            reasons[reason] = reasons.get(reason, 0) + int(float(value))
    return {"miss_tokens": miss, "decisions": reasons}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pools", nargs="+", default=["2MiB", "8MiB", "32MiB"])
    p.add_argument("--traces", default="/work/shared/traces/weka")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--port", type=int, default=18741)
    p.add_argument("--router", type=int, default=0, metavar="N",
                   help="N instances behind `loomserve router` (default: one, no router)")
    p.add_argument("--policy", default="default", help="the router's policy (default: default)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        runs = [run_pool(pool, a.port, a, folder) for pool in a.pools]
    from loomserve.bench.report import plot_miss_gap
    name = "miss_gap_served" + ("-router" if a.router else "") + (
        f"-{a.policy}" if a.router and a.policy != "default" else "")
    png = os.path.join(HERE, "results", name + ".png")
    labels = [(f"router ({a.policy}), {a.router} x {r['pool']}" if a.router else r["pool"])
              for r in runs]
    plot_miss_gap([r["miss_gap"] for r in runs], labels, png)
    out = {"model": "tiny-agent (CPU, float32)", "block_size": 16,
           **({"router": {"instances": a.router, "policy": a.policy}} if a.router else {}),
           "traces": os.path.basename(os.path.normpath(a.traces)),
           "concurrency": a.concurrency, "duration_s": a.duration, "runs": runs,
           "plot": os.path.relpath(png, ROOT), "load_avg_1m": os.getloadavg()[0]}
    print(write_json(name + ".json", out))


if __name__ == "__main__":
    main()
