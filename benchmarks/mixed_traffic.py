"""Mixed traffic in one instance: 8 decoding streams plus one cold 6K-token prefill arriving
mid-way. Does the prefill stall the streams?

Per config, on a fresh `loomserve serve`: N streams (/v1/completions, streaming, ignore_eos)
decode `--stream-tokens` tokens each; `--prefill-after` seconds after they start, one cold
prompt of `--prefill-tokens` random token ids (no cached prefix) asks for one token. Reported
per config and repeat: the streams' worst inter-token gap while the prefill is in flight
(from its send to its first token), the streams' ITL p50/p99 over the whole run, the prefill's
TTFT, and the server's step-time target and step cost model error (median / p90) scraped
from /metrics while the prefill runs. Configs (interleaved, `--repeats` times each):
  today: --target-step-ms 0 --scheduling-policy fcfs (token budget only, arrival order)
  new:   --target-step-ms auto (the step-time budget; cache_aware, the default order)
Writes benchmarks/results/mixed_traffic.json (or --out).

    nice -n -15 python benchmarks/mixed_traffic.py [--repeats 3]
    python benchmarks/mixed_traffic.py --model tests/fixtures/tiny-agent --prefill-tokens 2000 \
        --stream-tokens 64 --repeats 1 --out /tmp/mixed_smoke.json      # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    ServerProcess,
    format_table,
    free_port,
    host_info,
    stream_completion,
    which_loomserve,
    write_json,
)

from loomserve.bench.replay.transport import sse_lines  # noqa: E402

CONFIGS = {
    "today": ["--target-step-ms", "0", "--scheduling-policy", "fcfs"],
    "new": ["--target-step-ms", "auto"],
}


def scrape(url: str) -> dict[str, float]:
    """Scheduler figures from /metrics: target step (s), cost model error p50/p90, samples."""
    import httpx
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'^loomserve_(target_step_seconds|step_cost_samples_total|'
                     r'num_preemptions_total)\{[^}]*\} (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
        m = re.match(r'^loomserve_step_cost_relative_error\{.*quantile="([0-9.]+)"\} (\S+)$',
                     line)
        if m:
            out[f"cost_error_p{int(float(m.group(1)) * 100)}"] = float(m.group(2))
    return out


async def timed_stream(client, body) -> list[float]:
    """Token chunk times of one streamed completion (client clock)."""
    times: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in sse_lines(resp.aiter_text()):  # CR/LF only, as SSE
            if line.startswith("data:") and '"text"' in line and line[5:].strip() != "[DONE]":
                times.append(time.perf_counter())
    return times


async def one_run(url: str, args) -> dict:
    import httpx
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0),
                                 limits=limits) as client:
        # warm the engine (first-step costs, the cost model's first samples)
        await stream_completion(client, "/v1/completions", {
            "prompt": [rng.randrange(10, 500) for _ in range(32)], "max_tokens": 8,
            "stream": True, "ignore_eos": True})
        bodies = [{"prompt": [rng.randrange(10, 500) for _ in range(args.stream_prompt)],
                   "max_tokens": args.stream_tokens, "stream": True, "ignore_eos": True,
                   "temperature": 0} for _ in range(args.streams)]
        streams = [asyncio.create_task(timed_stream(client, b)) for b in bodies]
        await asyncio.sleep(args.prefill_after)
        cold = [rng.randrange(10, 500) for _ in range(args.prefill_tokens)]
        t_sent = time.perf_counter()
        prefill = asyncio.create_task(stream_completion(client, "/v1/completions", {
            "prompt": cold, "max_tokens": 1, "stream": True}))
        samples = []
        while not prefill.done():
            samples.append(await asyncio.to_thread(scrape, url))
            await asyncio.wait([prefill], timeout=0.5)
        p = prefill.result()
        t_first = p.t_first or time.perf_counter()
        chunk_times = await asyncio.gather(*streams)
    itl, worst = [], 0.0
    for ct in chunk_times:
        gaps = np.diff(ct)
        itl.extend(gaps.tolist())
        for a, b in zip(ct, ct[1:]):
            if b >= t_sent and a <= t_first:  # the gap overlaps the prefill
                worst = max(worst, b - a)
    itl_a = np.asarray(itl) if itl else np.zeros(1)
    after = scrape(url)
    targets = [s.get("target_step_seconds", 0.0) for s in samples] or [0.0]
    return {"worst_gap_during_prefill_s": worst, "prefill_ttft_s": t_first - t_sent,
            "prefill_error": p.error, "itl_p50_s": float(np.percentile(itl_a, 50)),
            "itl_p99_s": float(np.percentile(itl_a, 99)),
            "itl_p99_over_p50": float(np.percentile(itl_a, 99)
                                      / max(1e-9, np.percentile(itl_a, 50))),
            "stream_tokens": sum(len(c) for c in chunk_times),
            "target_step_ms_during_prefill": 1000 * float(np.median(targets)),
            "cost_error_p50": after.get("cost_error_p50"),
            "cost_error_p90": after.get("cost_error_p90"),
            "preemptions": after.get("num_preemptions_total")}


def serve_argv(args, port: int, extra: list[str]) -> list[str]:
    argv = [*which_loomserve(), "serve", "--port", str(port), "--dtype", args.dtype,
            "--kv-cache-memory", args.kv_cache_memory]
    if args.model:
        argv.insert(len(which_loomserve()) + 1, args.model)
    return argv + extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: loomserve serve's default model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-prompt", type=int, default=64)
    ap.add_argument("--stream-tokens", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=6000)
    ap.add_argument("--prefill-after", type=float, default=3.0, help="seconds after the streams")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--out", default="mixed_traffic.json")
    args = ap.parse_args()

    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    for rep in range(args.repeats):
        for name in args.configs:  # interleaved: host noise hits both alike
            port = free_port()
            with ServerProcess(serve_argv(args, port, CONFIGS[name]), port, name=name) as srv:
                print(f"  {name} repeat {rep}", file=sys.stderr, flush=True)
                runs[name].append(asyncio.run(one_run(srv.base_url, args)))
    summary = {name: {k: float(np.median([r[k] for r in rs]))
                      for k in ("worst_gap_during_prefill_s", "prefill_ttft_s", "itl_p50_s",
                                "itl_p99_s", "itl_p99_over_p50", "target_step_ms_during_prefill")}
               for name, rs in runs.items() if rs}
    rows = [[n, s["worst_gap_during_prefill_s"], s["itl_p50_s"], s["itl_p99_s"],
             s["itl_p99_over_p50"], s["prefill_ttft_s"], s["target_step_ms_during_prefill"]]
            for n, s in summary.items()]
    print(format_table(["config", "worst gap s", "ITL p50 s", "ITL p99 s", "p99/p50",
                        "prefill TTFT s", "target ms"], rows), file=sys.stderr)
    payload = {"host": host_info(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "command": " ".join(sys.argv), "args": vars(args),
               "configs": {n: CONFIGS[n] for n in args.configs}, "summary_medians": summary,
               "runs": runs}
    print(write_json(args.out, payload), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
