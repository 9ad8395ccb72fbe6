"""KV tiers under AgentX-style traffic: served prefix hit rate and TTFT with a device pool that
holds only a fraction of the live sessions, as tiers are added below it; then two instances
sharing one Mooncake pool behind per-request round-robin routing (cross-instance hits).

Configurations (each a fresh server on the built-in SmolLM2-135M, replayed with
`loomserve bench agentx` over the same synthetic traces, `--profile cpu`):
  device       the device pool alone
  host         + host-memory tier
  host+disk    + local disk tier
  host+disk+mc + Mooncake Store (a `loomserve store`-style master + storage client)
  2x-rr-mc     two instances (device + host + Mooncake each) behind a round-robin proxy that
               alternates instances per request, so a session's consecutive turns land on
               different instances and only the shared pool can serve their prefix
  2x-rr-none   the same two instances without tiers (what the shared pool buys)

Target: the shared pool's served hit rate >= 90% of a single instance's (host+disk+mc).
Each configuration reports the served hit rate split by source (device, host, disk, mooncake):
`bench agentx` scrapes the servers' /metrics before and after the replay (both instances of a
pair, through --metrics-url). The 1-minute load average is sampled during each configuration
(the host may be shared). Writes benchmarks/results/tiers_agentx.json.

    python benchmarks/tiers_agentx.py [--concurrency 4] [--duration 160] [--only device host]

Defaults (since the re-run with ~50 requests per configuration): --scale 32 (each 64-token
trace block becomes 32 tokens: half-size prompts, same prefix structure), --kv-cache-memory
32MiB (about a third of 4 live sessions, as 64MiB was unscaled), --max-context 1408 (the
server's context must fit the pool), --max-output 16, 160 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO_ROOT, ServerProcess, format_table, free_port, host_info, write_json  # noqa: E402


def env() -> dict:
    # Run this checkout's loomserve (not whatever an editable install points at); one torch
    # thread per server so two servers share a small host fairly.
    return {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "LOOMSERVE_NUM_THREADS": os.environ.get("LOOMSERVE_NUM_THREADS", "1")}


def synth_traces(sessions: int, seed: int) -> str:
    out = os.path.join(tempfile.gettempdir(), f"loomserve-tiers-agentx-{sessions}-{seed}")
    if not os.path.isdir(out) or not os.listdir(out):
        subprocess.run([sys.executable, "-m", "loomserve", "bench", "synth", "--profile", "cpu",
                        "--sessions", str(sessions), "--seed", str(seed), "--out", out, "--json"],
                       check=True, stdout=subprocess.DEVNULL, env=env())
    return out


def replay(url: str, traces: str, args, metrics_urls: list[str] | None = None) -> dict:
    cmd = [sys.executable, "-m", "loomserve", "bench", "agentx", "--endpoint", url,
           "--traces", traces, "--concurrency", str(args.concurrency),
           "--duration", str(args.duration), "--time-scale", str(args.time_scale),
           "--max-context", str(args.max_context), "--max-output", str(args.max_output),
           "--seed", str(args.seed), "--no-progress", "--json"]
    if args.scale:
        cmd += ["--scale", str(args.scale)]
    if metrics_urls:
        cmd += ["--metrics-url", *metrics_urls]
    print(f"  replay on {url}", file=sys.stderr, flush=True)
    res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env())
    return json.loads(res.stdout)


def commit() -> str | None:
    """The loomserve commit measured: $LOOMSERVE_COMMIT (set it when running an export of a
    commit), else this checkout's HEAD (plus '-dirty' when its tree has changes)."""
    if os.environ.get("LOOMSERVE_COMMIT"):
        return os.environ["LOOMSERVE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


class LoadSampler:
    """Samples the 1-minute load average every `every` seconds in a thread."""

    def __init__(self, every: float = 5.0) -> None:
        self.every = every
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.every)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        xs = self.samples or [float("nan")]
        return {"mean": round(sum(xs) / len(xs), 2), "max": round(max(xs), 2),
                "samples": len(self.samples)}


# -- a tiny round-robin proxy -----------------------------------------------------------------
class RoundRobinProxy:
    """Forwards every request to the next backend in turn (streaming responses through)."""

    def __init__(self, backends: list[str], port: int) -> None:
        self.backends = backends
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._next = 0
        self._server = None
        self._thread: threading.Thread | None = None

    def app(self):
        import httpx
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import StreamingResponse
        from starlette.routing import Route

        client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=256))

        async def forward(request: Request):
            if request.method == "GET":
                backend = self.backends[0]  # /v1/models, /health: any instance answers
            else:
                backend = self.backends[self._next % len(self.backends)]
                self._next += 1
            headers = {k: v for k, v in request.headers.items()
                       if k.lower() not in ("host", "content-length")}
            req = client.build_request(request.method, backend + request.url.path,
                                       headers=headers, content=await request.body())
            resp = await client.send(req, stream=True)
            keep = {k: v for k, v in resp.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection")}

            async def body():
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()
            return StreamingResponse(body(), status_code=resp.status_code, headers=keep)

        return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])

    def __enter__(self) -> "RoundRobinProxy":
        import uvicorn
        self._server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1",
                                                     port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("proxy did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


# -- configurations ---------------------------------------------------------------------------
def serve_argv(port: int, args, tiers: list[str]) -> list[str]:
    return [sys.executable, "-m", "loomserve", "serve", "--port", str(port), "--dtype",
            args.dtype, "--kv-cache-memory", args.kv_cache_memory, "--max-model-len",
            str(args.max_context), *tiers]


def summarize(result: dict) -> dict:
    m = result["metrics"]
    scrape = m.get("hit_source_scrape") or {}
    return {"hit_served": m["hit_rate"]["served"], "hit_theoretical": m["hit_rate"]["theoretical"],
            "hit_by_source": m["hit_rate"].get("by_source"),
            "hit_tokens_by_source": m["tokens"].get("cached_by_source"),
            "hit_split_exact": scrape.get("exact"),
            "hit_split_server_delta": scrape.get("server_delta"),
            "ttft_p50_s": m["ttft_s"]["p50"], "ttft_p90_s": m["ttft_s"]["p90"],
            "e2e_p50_s": m["e2e_s"]["p50"], "tpgs": m["tpgs"], "window_s": m["window_s"],
            "requests_ok": m["requests"]["ok"], "errors": m["requests"]["errors"],
            "prompt_tokens": m["tokens"]["prompt"], "cached_tokens": m["tokens"]["cached"]}


def run_single(name: str, tiers: list[str], traces: str, args) -> dict:
    port = free_port()
    with ServerProcess(serve_argv(port, args, tiers), port, name=f"tiers-{name}",
                       env=env()) as srv:
        return summarize(replay(srv.base_url, traces, args))


def run_pair(name: str, tiers: list[str], traces: str, args) -> dict:
    ports = [free_port(), free_port()]
    servers = [ServerProcess(serve_argv(p, args, tiers), p, name=f"tiers-{name}-{i}", env=env())
               for i, p in enumerate(ports)]
    try:
        for s in servers:
            s.start()
        with RoundRobinProxy([s.base_url for s in servers], free_port()) as proxy:
            # the proxy answers GET from the first instance: scrape both directly
            res = replay(proxy.url, traces, args, [s.base_url for s in servers])
        return summarize(res)
    finally:
        for s in servers:
            s.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--duration", type=float, default=160.0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-context", type=int, default=1408,
                    help="context cap and --max-model-len (default: %(default)s, under the "
                         "32MiB pool's 1456 tokens)")
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--scale", type=int, default=32,
                    help="tokens per 64-token trace block (default: %(default)s, half-size "
                         "prompts with the traces' prefix structure; 0 = unscaled)")
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--traces", default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", default="32MiB",
                    help="device pool: about a third of the live sessions at -c 4 with "
                         "--scale 32 (default: %(default)s)")
    ap.add_argument("--host-cache-memory", default="1GiB")
    ap.add_argument("--disk-cache-size", default="4GiB")
    ap.add_argument("--pool-size", default="2GB", help="Mooncake pool memory")
    ap.add_argument("--only", nargs="+", default=None)
    args = ap.parse_args()
    started = time.monotonic()
    machine = host_info()

    traces = args.traces or synth_traces(args.sessions, args.seed)
    work = tempfile.mkdtemp(prefix="loomserve-tiers-bench-")
    from loomserve.control.store_launcher import MooncakeService, parse_size
    results: dict[str, dict] = {}
    try:
        host = ["--host-cache-memory", args.host_cache_memory]

        def disk(tag: str) -> list[str]:
            return ["--disk-cache-dir", os.path.join(work, f"disk-{tag}"),
                    "--disk-cache-size", args.disk_cache_size]
        # "mc" stands for a Mooncake pool started fresh for that configuration alone, so no
        # configuration hits what an earlier one left in the pool.
        # "disk" and "mc" alone show each lower tier serving by itself (behind a 1 GiB host
        # tier they are rarely reached within one run).
        singles = {"device": [], "host": host, "disk": disk("d"), "mc": ["mc"],
                   "host+disk": host + disk("a"), "host+disk+mc": host + disk("b") + ["mc"]}
        pairs = {"2x-rr-mc": host + ["mc"], "2x-rr-none": []}
        for name, tiers in [*singles.items(), *pairs.items()]:
            if args.only and name not in args.only:
                continue
            mc = None
            if "mc" in tiers:
                mc = MooncakeService(segment_bytes=parse_size(args.pool_size),
                                     log_dir=work).start()
                tiers = [t for t in tiers if t != "mc"] + [
                    "--remote-cache", f"mooncake://{mc.master_address}"]
            try:
                print(f"{name}: {' '.join(tiers) or 'no tiers'}", file=sys.stderr, flush=True)
                run = run_pair if name in pairs else run_single
                t0 = time.monotonic()
                with LoadSampler() as load:
                    results[name] = run(name, tiers, traces, args)
                results[name]["loadavg_1m"] = load.summary()
                results[name]["wall_s"] = round(time.monotonic() - t0, 1)
            finally:
                if mc is not None:
                    mc.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [[n, r["hit_served"], r["hit_theoretical"],
             " ".join(f"{k}={v:.3f}" for k, v in (r["hit_by_source"] or {}).items()),
             r["ttft_p50_s"], r["ttft_p90_s"], r["tpgs"], r["requests_ok"], r["errors"],
             r["loadavg_1m"]["mean"]]
            for n, r in results.items()]
    print(format_table(["config", "hit served", "hit theor.", "hit by source", "TTFT p50 s",
                        "TTFT p90 s", "TPGS", "ok", "err", "load 1m"], rows), file=sys.stderr)
    shared = None
    single = results.get("host+disk+mc")
    if "2x-rr-mc" in results and single and single["hit_served"]:
        shared = results["2x-rr-mc"]["hit_served"] / single["hit_served"]
        print(f"shared pool hit rate / single instance: {shared:.3f} (target >= 0.9)",
              file=sys.stderr)
    payload = {"host": machine, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": " ".join(["python", "benchmarks/tiers_agentx.py", *sys.argv[1:]]),
               "commit": commit(), "traces": traces, "args": vars(args), "results": results,
               "total_wall_s": round(time.monotonic() - started, 1),
               "shared_over_single_hit_rate": shared}
    print(write_json("tiers_agentx.json", payload), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
