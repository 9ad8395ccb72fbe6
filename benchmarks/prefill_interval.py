"""The prefill schedule interval under DEP: dummy-step fraction, TPGS and warm ITL at interval 1
against longer intervals (issue 14).

Deployment: `loomserve serve MODEL --data-parallel-size 2 --enable-expert-parallel
--prefill-schedule-interval N` (default MODEL: tests/fixtures/tiny-deepseek-v3, the MoE + MLA
fixture), one torch thread per rank. The two DP ranks step in lockstep (every MoE layer is an
all-to-all over both), so a rank with nothing to run does a dummy step, and a rank's prefill
makes the other rank's decodes wait at the exchange. With interval N, new prefills start only on
every N-th step, on both ranks at once.

Fixed work per interval (token-id /v1/completions, streaming, greedy, ignore_eos):
  warm  W sessions (X-Session-ID, so the front end keeps each on one rank), each a context of
        --warm-context tokens primed once, then --turns turns adding --warm-suffix tokens and
        streaming --warm-output tokens;
  cold  --cold prompts of --cold-tokens fresh tokens (8 output tokens), one every --cold-every s
        from the start, their own sessions (the front end spreads them over the ranks).
Reported per interval: wall time of the work, TPGS = (prompt + output tokens) / wall / 2 ranks,
the warm inter-token gaps p50/p99, cold TTFT p50, and the dummy steps per rank from each rank's
shutdown line ("DP lockstep: S steps, D of them dummy").

    python benchmarks/prefill_interval.py [--intervals 1 2 4 8]

Writes benchmarks/results/prefill_interval.json. Ports 24600-24699.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, host_info, write_json  # noqa: E402
from common.agent_cluster import env  # noqa: E402
from common.servers import ServerProcess  # noqa: E402
from pd_agentx import pct, stream  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCKSTEP = re.compile(r"DP lockstep: (\d+) steps, (\d+) of them dummy")


def ids(rng: random.Random, n: int, hi: int) -> list[int]:
    return [rng.randrange(3, hi) for _ in range(n)]


async def warm(client, url, a, k: int, recs: list) -> None:
    rng = random.Random(100 + k)
    ctx = ids(rng, a.warm_context, a.vocab_hi)
    hdr = {"X-Session-ID": f"warm-{k}"}
    await stream(client, url, ctx, 1, hdr)  # primer (not counted)
    for _ in range(a.turns):
        ctx = ctx + ids(rng, a.warm_suffix, a.vocab_hi)
        if len(ctx) + a.warm_output > a.max_model_len - 8:
            ctx = ctx[:a.warm_context]
        rec = await stream(client, url, ctx, a.warm_output, hdr)
        recs.append(("warm", len(ctx), a.warm_output, rec))


async def cold(client, url, a, k: int, recs: list) -> None:
    await asyncio.sleep(k * a.cold_every)
    prompt = ids(random.Random(9000 + k), a.cold_tokens, a.vocab_hi)
    rec = await stream(client, url, prompt, 8, {"X-Session-ID": f"cold-{k}"})
    recs.append(("cold", len(prompt), 8, rec))


async def drive(url: str, a) -> tuple[list, float]:
    import httpx
    recs: list = []
    async with httpx.AsyncClient(timeout=a.request_timeout) as client:
        t0 = time.monotonic()
        await asyncio.gather(*[warm(client, url, a, k, recs) for k in range(a.warm)],
                             *[cold(client, url, a, k, recs) for k in range(a.cold)])
        return recs, time.monotonic() - t0


def summarize(recs: list, wall: float, log_text: str) -> dict:
    ok = [(kind, p, o, r) for kind, p, o, r in recs if not r["error"]]
    gaps = [b - x for kind, _, _, r in ok if kind == "warm"
            for x, b in zip(r["times"], r["times"][1:])]
    ttft = [r["times"][0] - r["t0"] for kind, _, _, r in ok if kind == "cold" and r["times"]]
    tokens = sum(p + len(r["times"]) for _, p, _, r in ok)
    ranks = [(int(s), int(d)) for s, d in LOCKSTEP.findall(log_text)]
    return {"wall_s": round(wall, 2), "tokens": tokens, "tpgs": round(tokens / wall / 2, 1),
            "warm_itl_p50_ms": round(1000 * pct(gaps, 0.5), 1) if gaps else None,
            "warm_itl_p99_ms": round(1000 * pct(gaps, 0.99), 1) if gaps else None,
            "cold_ttft_p50_s": round(pct(ttft, 0.5), 2) if ttft else None,
            "errors": len(recs) - len(ok), "requests": len(recs),
            "lockstep_steps_dummy": ranks,
            "dummy_fraction": round(sum(d for _, d in ranks) / max(1, sum(s for s, _ in ranks)), 4)
            if ranks else None}


def run_interval(a, interval: int, port: int) -> dict:
    argv = [sys.executable, "-m", "loomserve", "serve", a.model, "--port", str(port),
            "--dtype", "float32", "--data-parallel-size", "2", "--enable-expert-parallel",
            "--prefill-schedule-interval", str(interval), "--max-model-len", str(a.max_model_len)]
    server = ServerProcess(argv, port, name=f"dep-interval{interval}", env=env(1),
                           startup_timeout=300)
    server.start()
    try:
        recs, wall = asyncio.run(drive(server.base_url, a))
    finally:
        server.stop()
    with open(server.log.name, errors="replace") as f:
        out = summarize(recs, wall, f.read())
    out.update(interval=interval, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               loadavg_1m_end=os.getloadavg()[0])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--model", default=os.path.join(ROOT, "tests", "fixtures", "tiny-deepseek-v3"))
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--vocab-hi", type=int, default=500)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--warm-context", type=int, default=256)
    ap.add_argument("--warm-suffix", type=int, default=16)
    ap.add_argument("--warm-output", type=int, default=32)
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--cold", type=int, default=24)
    ap.add_argument("--cold-tokens", type=int, default=448)
    ap.add_argument("--cold-every", type=float, default=0.5)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "prefill_interval.json"))
    a = ap.parse_args()
    runs = []
    for i, interval in enumerate(a.intervals):
        r = run_interval(a, interval, 24600 + 10 * i)
        print(json.dumps(r), flush=True)
        runs.append(r)
    write_json(a.out, {"host": host_info(), "args": vars(a), "runs": runs})
    print(f"{'interval':>8} {'wall s':>7} {'TPGS':>7} {'dummy':>6} {'ITL p50/p99 ms':>16} "
          f"{'cold TTFT p50':>13} errors")
    for r in runs:
        print(f"{r['interval']:>8} {r['wall_s']:>7} {r['tpgs']:>7} {r['dummy_fraction']!s:>6} "
              f"{r['warm_itl_p50_ms']!s:>7}/{r['warm_itl_p99_ms']!s:<8} "
              f"{r['cold_ttft_p50_s']!s:>13} {r['errors']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
