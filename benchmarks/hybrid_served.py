"""Served vs simulated prefix-hit rate for a hybrid (linear-state + attention) model.

A tiny Qwen3-Next (Gated DeltaNet + gated attention, tests/fixtures/tiny-qwen3-next) runs
behind `loomserve serve` with a given KV capacity and retention; `loomserve bench agentx`
replays scaled synthetic agent traces against it (one live session, no warm-up primers) and
records every prompt it sent. The same prompts, in send order, then go through a fresh
KVCacheManager with the server's exact KV config and retention but no model (prefill in the
engine's chunks, then the output decoded token by token with tokens that never recur, as the
model's do): the simulator's view of that replay. Reported: both hit rates and the gap (target:
within 5 points), beside the infinite-cache rate of the same requests.

    python benchmarks/hybrid_served.py [--kv-cache-memory 2MiB] [--duration 60]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO_ROOT, ServerProcess, free_port, host_info, write_json  # noqa: E402

MODEL = os.path.join(REPO_ROOT, "tests", "fixtures", "tiny-qwen3-next")


class SimRequest:
    def __init__(self, rid: str, ids: list[int], session: str | None) -> None:
        self.request_id = rid
        self.all_token_ids = list(ids)
        self.num_prompt_tokens = len(ids)
        self.num_computed_tokens = 0
        self.cache_salt = None
        self.session_id = session
        self.block_hashes: list[bytes] = []


def simulate(records: list[dict], config, chunk: int, seed: int = 0) -> dict:
    """The replay's requests through the KV manager alone, as the engine would drive it."""
    from loomserve.engine.core import EngineCore, flop_model, retention_config
    from loomserve.kv.cache_manager import KVCacheManager

    runner = EngineCore(config).runner  # only for its KV config and FLOP model: no step runs
    kv = KVCacheManager(runner.kv_cache_config, retention=retention_config(config),
                        eviction=config.cache.eviction, flop_model=flop_model(runner))
    rng = random.Random(seed)
    hit = prompt = 0
    for i, rec in enumerate(records):
        req = SimRequest(str(i), rec["prompt_ids"], rec["session"])
        handle, n_hit = kv.get_computed_blocks(req)
        first = min(chunk, req.num_prompt_tokens - n_hit)
        if not kv.allocate_slots(req, first, handle, n_hit):
            raise RuntimeError("the simulated pool cannot hold one request")
        req.num_computed_tokens = n_hit + first
        while req.num_computed_tokens < req.num_prompt_tokens:
            n = min(chunk, req.num_prompt_tokens - req.num_computed_tokens)
            assert kv.allocate_slots(req, n)
            req.num_computed_tokens += n
        for _ in range(max(0, (rec["output_tokens"] or 0) - 1)):
            req.all_token_ids.append(rng.randrange(1 << 30))  # generated: never in a prompt
            assert kv.allocate_slots(req, 1)
            req.num_computed_tokens += 1
        kv.free(req)
        hit += n_hit
        prompt += req.num_prompt_tokens
    return {"hit_rate": hit / prompt if prompt else None, "hit_tokens": hit, "prompt_tokens": prompt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-memory", default="2MiB")
    ap.add_argument("--retention", default="interval,marconi")
    ap.add_argument("--eviction", default="lru")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--scale", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=24)
    args = ap.parse_args()

    from loomserve.config import EngineConfig

    traces = os.path.join(tempfile.gettempdir(), f"loomserve-hybrid-served-{args.sessions}-{args.seed}")
    if not os.path.isdir(traces):
        subprocess.run([sys.executable, "-m", "loomserve", "bench", "synth", "--profile", "cpu",
                        "--sessions", str(args.sessions), "--seed", str(args.seed), "--out", traces,
                        "--json"], check=True, stdout=subprocess.DEVNULL)
    config = EngineConfig.from_kwargs(model=MODEL, kv_cache_memory=args.kv_cache_memory, dtype="float32",
                          retention=args.retention, eviction=args.eviction)
    port = free_port()
    serve = [sys.executable, "-m", "loomserve", "serve", MODEL, "--port", str(port),
             "--kv-cache-memory", args.kv_cache_memory, "--dtype", "float32",
             "--retention", args.retention, "--eviction", args.eviction]
    with ServerProcess(serve, port, name="loomserve-hybrid") as server:
        out = subprocess.run(
            [sys.executable, "-m", "loomserve", "bench", "agentx", "--endpoint", server.base_url,
             "--traces", traces, "--concurrency", "1", "--duration", str(args.duration),
             "--scale", str(args.scale), "--time-scale", "0.01", "--max-output",
             str(args.max_output), "--no-warmup", "--no-progress", "--records",
             "--record-prompts", "--json"], check=True, stdout=subprocess.PIPE, text=True)
    result = json.loads(out.stdout)
    records = [r for r in result["records"] if r["error"] is None and r["prompt_ids"]]
    served = result["metrics"]["hit_rate"]["served"]
    sim = simulate(records, config, chunk=config.scheduler.long_prefill_threshold)
    payload = {
        "host": host_info(), "args": vars(args), "requests": len(records),
        "served_hit_rate": served, "simulated_hit_rate": sim["hit_rate"],
        "gap_points": 100 * abs(served - sim["hit_rate"]),
        "theoretical_hit_rate": result["metrics"]["hit_rate"]["theoretical"],
        "target_gap_points": 5.0,
    }
    print(json.dumps(payload, indent=1))
    write_json("hybrid_served.json", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
