"""Expert-parallel (DEP) communication per token and per decode step, measured beside the formula.

Deployment: `loomserve serve MODEL --data-parallel-size N --enable-expert-parallel` (default
MODEL: tests/fixtures/tiny-deepseek-v3, the MLA + MoE fixture), one torch thread per rank. Each
MoE layer is a true all-to-all: every (token, expert) pair goes to the rank holding the expert
(hidden + weight + expert id as fp32) and its output (hidden fp32) comes back, after one
all-to-all of pair counts. With uniform routing a pair leaves its rank with probability
(N - 1) / N, so per token and MoE layer a rank sends off-rank on average

    k x (N - 1) / N x (2 x hidden + 2) x 4 bytes   (+ 8 x (N - 1) bytes of counts per layer call)

and a decode step of B streams on the rank sends B x L_moe x that. Measured: every rank's
"DP lockstep: ... expert all-to-all: P (token, expert) pairs routed, X bytes sent to other ranks
over L MoE layers" shutdown line, after --streams concurrent streams of --prompt-tokens fresh
tokens and --output-tokens greedy tokens: bytes per (token, layer) = X / (P / k).

    python benchmarks/dep_comm.py [--streams 8] [--output-tokens 64]

Writes benchmarks/results/dep_comm.json. Port 24700.
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
from pd_agentx import stream  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"DP lockstep: (\d+) steps, (\d+) of them dummy.*?expert all-to-all: (\d+) "
                  r"\(token, expert\) pairs routed, (\d+) bytes sent to other ranks over (\d+)")


async def drive(url: str, a) -> list:
    import httpx
    rng = random.Random(7)
    async with httpx.AsyncClient(timeout=300) as client:
        prompts = [[rng.randrange(3, 500) for _ in range(a.prompt_tokens)]
                   for _ in range(a.streams)]
        return await asyncio.gather(*(stream(client, url, p, a.output_tokens,
                                             {"X-Session-ID": f"s{i}"})
                                       for i, p in enumerate(prompts)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "tests", "fixtures", "tiny-deepseek-v3"))
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "dep_comm.json"))
    a = ap.parse_args()
    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    hidden, k = cfg["hidden_size"], cfg["num_experts_per_tok"]
    argv = [sys.executable, "-m", "loomserve", "serve", a.model, "--port", "24700", "--dtype",
            "float32", "--data-parallel-size", str(a.dp), "--enable-expert-parallel"]
    server = ServerProcess(argv, 24700, name="dep-comm", env=env(1), startup_timeout=300)
    server.start()
    try:
        recs = asyncio.run(drive(server.base_url, a))
    finally:
        server.stop()
    with open(server.log.name, errors="replace") as f:
        ranks = [tuple(int(x) for x in m) for m in LINE.findall(f.read())]
    if len(ranks) != a.dp:
        print(f"expected {a.dp} lockstep lines, found {len(ranks)}", file=sys.stderr)
        return 1
    formula = k * (a.dp - 1) / a.dp * (2 * hidden + 2) * 4
    rows = []
    for r, (steps, dummy, pairs, sent, layers) in enumerate(ranks):
        token_layers = pairs / k
        rows.append({"rank": r, "steps": steps, "dummy": dummy, "pairs": pairs,
                     "bytes_sent_off_rank": sent, "moe_layers": layers,
                     "bytes_per_token_layer": round(sent / max(1, token_layers), 1)})
    per_rank_streams = a.streams / a.dp
    out = {"host": host_info(), "args": vars(a),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "errors": sum(1 for x in recs if x["error"]), "ranks": rows,
           "formula_bytes_per_token_layer": formula,
           "decode_step_bytes_formula": per_rank_streams * ranks[0][4] * formula,
           "decode_step_bytes_measured": [round(per_rank_streams * x["moe_layers"]
                                                * x["bytes_per_token_layer"]) for x in rows]}
    write_json(a.out, out)
    print(json.dumps(out["ranks"], indent=1))
    print(f"formula {formula:.1f} B per token and MoE layer (k={k}, hidden={hidden}, "
          f"N={a.dp}); decode step of {per_rank_streams:g} streams per rank: "
          f"{out['decode_step_bytes_formula']:.0f} B formula, {out['decode_step_bytes_measured']} "
          f"measured; errors {out['errors']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
