"""AgentX replay with forked subagents, scaled to an 8K context: loomserve's scheduler today
vs the new one vs llama-server, the same work and caps for all.

Traces: `loomserve bench synth --profile agentx --forked-subagents 0.5` (cached under the temp
dir), replayed by `loomserve bench agentx` with one --max-context / --max-output / --scale for
every system. Systems, interleaved per repeat, a fresh server each:
  today:         loomserve --target-step-ms 0 --scheduling-policy fcfs
  new:           loomserve --target-step-ms auto (the step-time budget; cache_aware order)
  default:       loomserve as it starts without flags (cache_aware order; the budget is opt-in)
  llama-server:  -np = the largest concurrency, -c = that x the context cap (as agentx_cpu.py)
Reported per system and concurrency: ITL p50 / p99 and their ratio, TTFT p50 / p90 of warm
turns (a theoretical cached share >= --warm-share of the prompt: the work is the same for every
server, so the set of turns is too), split into warm turns whose wait overlapped a cold turn's
wait ("under cold") and the rest ("no cold": the issue's baseline), and of all turns, TPGS,
served hit rate, prompt tokens sent, and for loomserve the step cost model's relative error
(median / p90) and the step-time target scraped from /metrics at the end of each replay.
Writes benchmarks/results/mixed_agentx.json.

    nice -n -15 python benchmarks/mixed_agentx.py [--concurrency 4 16] [--duration 300]
    python benchmarks/mixed_agentx.py --model tests/fixtures/tiny-agent --max-context 4096 \
        --concurrency 2 --duration 10 --sessions 4 --systems today new --out /tmp/m.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

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
from mixed_traffic import scrape  # noqa: E402

SCHED_FLAGS = {"today": ["--target-step-ms", "0", "--scheduling-policy", "fcfs"],
               "new": ["--target-step-ms", "auto"],
               "default": []}  # the engine's defaults (cache_aware order, the budget off)


def synth_traces(args) -> str:
    out = os.path.join(tempfile.gettempdir(), f"loomserve-mixed-agentx-{args.sessions}-"
                                              f"{args.seed}-{args.forked}")
    if not os.path.isdir(out) or not os.listdir(out):
        subprocess.run([sys.executable, "-m", "loomserve", "bench", "synth", "--profile",
                        args.profile, "--sessions", str(args.sessions), "--seed", str(args.seed),
                        "--forked-subagents", str(args.forked), "--out", out, "--json"],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def replay(url: str, traces: str, concurrency: int, args) -> dict:
    cmd = [sys.executable, "-m", "loomserve", "bench", "agentx", "--endpoint", url,
           "--traces", traces, "--concurrency", str(concurrency), "--duration", str(args.duration),
           "--time-scale", str(args.time_scale), "--max-context", str(args.max_context),
           "--max-output", str(args.max_output), "--seed", str(args.seed), "--no-progress",
           "--records", "--json"]
    if args.scale:
        cmd += ["--scale", str(args.scale)]
    if args.once:
        cmd.append("--once")
    print(f"  replay c={concurrency} on {url}", file=sys.stderr, flush=True)
    res = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(res.stdout)


def pct(values) -> dict:
    a = np.asarray(values, float)
    if a.size == 0:
        return {"p50": None, "p90": None, "count": 0}
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "count": int(a.size)}


def summarize(result: dict, warm_share: float) -> dict:
    m = result["metrics"]
    recs = [r for r in result.get("records", []) if not r["primer"] and r["error"] is None
            and r["first_token_time"] is not None]
    def is_warm(r):
        return (r["intended_prompt_tokens"]
                and r["theoretical_cached_tokens"] / r["intended_prompt_tokens"] >= warm_share)

    warm_recs = [r for r in recs if is_warm(r)]
    warm = [r["first_token_time"] - r["send_time"] for r in warm_recs]
    # A warm turn "under a cold prefill": its wait [send, first token] overlaps the wait of a
    # cold turn (a fresh subagent, a first turn: the uncached share above 1 - warm_share).
    cold = [(r["send_time"], r["first_token_time"]) for r in recs if not is_warm(r)]
    under, quiet = [], []
    for r in warm_recs:
        a, b = r["send_time"], r["first_token_time"]
        (under if any(c0 < b and c1 > a for c0, c1 in cold) else quiet).append(b - a)
    itl = m["itl_s"]
    return {"itl_p50_s": itl["p50"], "itl_p99_s": itl["p99"],
            "itl_p99_over_p50": itl["p99"] / itl["p50"] if itl["p50"] else None,
            "ttft_warm_s": pct(warm), "ttft_warm_under_cold_s": pct(under),
            "ttft_warm_no_cold_s": pct(quiet),
            "ttft_all_s": pct([r["first_token_time"] - r["send_time"] for r in recs]),
            "tpgs": m["tpgs"], "hit_served": m["hit_rate"]["served"],
            "hit_theoretical": m["hit_rate"]["theoretical"],
            "prompt_tokens_sent": m["tokens"]["intended_prompt"],
            "requests_ok": m["requests"]["ok"], "errors": m["requests"]["errors"],
            # what failed, kept so a failed request can be traced after the run
            "error_records": [{k: r.get(k) for k in ("error", "error_detail", "session", "agent",
                                                      "turn", "send_time", "first_token_time",
                                                      "max_tokens", "intended_prompt_tokens")}
                              | {"chunks": len(r.get("chunk_times") or [])}
                              for r in result.get("records", []) if r["error"] is not None]}


def server_argv(name: str, port: int, args) -> list[str]:
    if name == "llama-server":
        slots = max(args.concurrency)
        return [ensure_llama_server(), "-m", args.gguf or default_gguf_path(), "--host",
                "127.0.0.1", "--port", str(port), "-np", str(slots),
                "-c", str(slots * args.max_context), "--cont-batching", "-t", str(args.threads),
                "-tb", str(args.threads), "--no-webui", *llama_repack_args()]
    argv = [*which_loomserve(), "serve"] + ([args.model] if args.model else []) + [
        "--port", str(port), "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory,
        "--max-model-len", str(args.max_context)]
    return argv + SCHED_FLAGS[name]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", nargs="+", default=["today", "new", "llama-server"],
                    choices=["today", "new", "default", "llama-server"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--once", action="store_true",
                    help="fixed work (bench agentx --once): each session replays one trace to its "
                         "end, so every system serves the same requests (--duration caps it)")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--profile", default="agentx", choices=["agentx", "cpu", "weka-small"])
    ap.add_argument("--forked", type=float, default=0.5, help="--forked-subagents fraction")
    ap.add_argument("--scale", type=int, default=4,
                    help="tokens per 64-token trace block (4: AgentX's ~128K contexts -> ~8K)")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--sessions", type=int, default=32, help="synthetic sessions to generate")
    ap.add_argument("--traces", default=None)
    ap.add_argument("--warm-share", type=float, default=0.5,
                    help="a warm turn: theoretical cached share of its prompt at least this")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model", default=None, help="loomserve's model (default: its default)")
    ap.add_argument("--gguf", default=None, help="llama-server's model (default: SmolLM2 GGUF)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", default="3GiB")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="mixed_agentx.json")
    args = ap.parse_args()

    traces = args.traces or synth_traces(args)
    results: dict[str, dict[str, list[dict]]] = {s: {} for s in args.systems}

    def save() -> str:  # after every replay: a long run cut short keeps what it measured
        payload = {"host": host_info(),
                   "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                   "command": " ".join(sys.argv), "traces": traces, "args": vars(args),
                   "scheduler_flags": SCHED_FLAGS, "results": results}
        return write_json(args.out, payload)

    for rep in range(args.repeats):
        for name in args.systems:  # interleaved: host noise hits every system alike
            port = free_port()
            with ServerProcess(server_argv(name, port, args), port, name=name) as srv:
                for c in args.concurrency:
                    row = summarize(replay(srv.base_url, traces, c, args), args.warm_share)
                    if name != "llama-server":
                        row["scheduler_metrics"] = scrape(srv.base_url)
                    results[name].setdefault(str(c), []).append(row)
                    save()
    rows = []
    for name, by_c in results.items():
        for c, runs in by_c.items():
            r = runs[-1]
            sm = r.get("scheduler_metrics", {})
            rows.append([name, c, r["itl_p50_s"], r["itl_p99_s"], r["itl_p99_over_p50"],
                         r["ttft_warm_s"]["p90"], r["ttft_warm_no_cold_s"]["p90"],
                         r["ttft_warm_under_cold_s"]["p90"], r["tpgs"], r["hit_served"],
                         r["prompt_tokens_sent"], sm.get("cost_error_p50"),
                         sm.get("cost_error_p90")])
    print(format_table(["system", "c", "ITL p50", "ITL p99", "p99/p50", "warm TTFT p90", "no cold",
                        "under cold", "TPGS", "hit served", "prompt tok", "cost err p50", "p90"],
                       rows),
          file=sys.stderr)
    print(save(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
