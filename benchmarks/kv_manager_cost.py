"""Per-turn CPU cost of the KV cache manager in a long agent session: loomserve vs vLLM v1.

Workload: one agent session of 64 turns whose prompt grows to 128K tokens (131072), each turn
adding 1K-4K new tokens (seeded random draws, rescaled so they sum to 128K); block size 16 and
enough blocks to hold the whole session. Each turn is a new request (session_id set) whose
prompt is the previous prompt, the token generated last turn and the new tokens, as a fresh
Python list (as a server re-tokenizing the chat would produce). Per turn we time:
  create the request (vLLM hashes its prompt blocks in Request.__init__) + get_computed_blocks
  + allocate_slots for the whole uncached prompt + append 1 generated token and allocate_slots
  for it (decode) + free at the end of the turn.
Building the token list is not timed. The session is repeated --reps times on a fresh manager;
per turn we take the median over repetitions, then report the median over all turns and over
the last 8 turns (120K-128K tokens).

vLLM side: vllm==0.33.0 installed with --no-deps into benchmarks/.peers/vllm-venv by
benchmarks/peers/vllm_env.sh; this script re-runs itself there with --driver vllm and drives
vllm.v1.core.kv_cache_manager.KVCacheManager (one FullAttentionSpec group, default
prefix_caching_hash_algo sha256 and, for reference, xxhash) with vllm.v1.request.Request
objects carrying its block hasher. Same token sequences (same seed).

Usage: python benchmarks/kv_manager_cost.py [--reps 5] [--no-vllm]
Writes benchmarks/results/kv_manager_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VLLM_PY = os.path.join(HERE, ".peers", "vllm-venv", "bin", "python")
BLOCK_SIZE = 16
TOTAL = 131072
TURNS = 64


def make_session(seed: int, turns: int = TURNS, total: int = TOTAL):
    """Prompt length per turn (cumulative) and the session's token ids."""
    rng = np.random.default_rng(seed)
    inc = rng.integers(1024, 4097, turns).astype(np.float64)
    inc = np.clip(np.round(inc * (total - turns) / inc.sum()), 1024, 4096).astype(np.int64)
    inc[-1] += (total - turns) - inc.sum()  # one generated token per turn completes the total
    lengths = []
    p = 0
    for i in range(turns):
        p += int(inc[i])
        lengths.append(p)
        p += 1  # the token generated in this turn is part of the next prompt
    tokens = rng.integers(1000, 150_000, p + 1, dtype=np.int64)
    return lengths, tokens


def _summarize(per_turn_reps: list[list[float]]) -> dict:
    per_turn = [statistics.median(col) for col in zip(*per_turn_reps)]
    return {
        "median_ms_all_turns": statistics.median(per_turn) * 1e3,
        "median_ms_last8_turns": statistics.median(per_turn[-8:]) * 1e3,
        "per_turn_ms": [t * 1e3 for t in per_turn],
    }


# -- loomserve ----------------------------------------------------------------------------
def run_loomserve(seed: int, reps: int) -> dict:
    sys.path.insert(0, ROOT)
    from dataclasses import dataclass, field

    import torch

    from loomserve.kv.manager import KVCacheManager
    from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup

    @dataclass
    class Req:
        request_id: str
        all_token_ids: list
        num_prompt_tokens: int
        num_computed_tokens: int = 0
        cache_salt: str | None = None
        session_id: str | None = None
        block_hashes: list = field(default_factory=list)

    lengths, tokens = make_session(seed)
    spec = FullAttentionSpec(BLOCK_SIZE, 8, 128, torch.bfloat16)
    num_blocks = TOTAL // BLOCK_SIZE + 512
    totals, phases = [], []
    for rep in range(reps):
        kv = KVCacheManager(KVCacheConfig(num_blocks, (KVCacheGroup(spec, (0,)),)))
        times, ph = [], []
        for t, plen in enumerate(lengths):
            prompt = tokens[:plen].tolist()
            nxt = int(tokens[plen])
            t0 = time.perf_counter()
            req = Req(f"s-{rep}-{t}", prompt, plen, session_id="agent")
            hit, n_hit = kv.get_computed_blocks(req)
            t1 = time.perf_counter()
            if not kv.allocate_slots(req, plen - n_hit, hit, n_hit):
                raise RuntimeError("pool too small")
            req.num_computed_tokens = plen
            t2 = time.perf_counter()
            req.all_token_ids.append(nxt)
            if not kv.allocate_slots(req, 1):
                raise RuntimeError("pool too small")
            req.num_computed_tokens += 1
            t3 = time.perf_counter()
            kv.free(req)
            t4 = time.perf_counter()
            if t:
                assert n_hit >= (lengths[t - 1] + 1) // BLOCK_SIZE * BLOCK_SIZE, (t, n_hit)
            times.append(t4 - t0)
            ph.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
        totals.append(times)
        phases.append(ph)
    out = _summarize(totals)
    names = ("hash_lookup", "allocate_prompt", "decode_1", "free")
    last = [[statistics.median(r[t][i] for r in phases) for t in range(TURNS - 8, TURNS)]
            for i in range(4)]
    out["last8_phase_median_ms"] = {n: statistics.median(v) * 1e3 for n, v in zip(names, last)}
    return out


# -- vLLM (run inside the peer venv) ------------------------------------------------------
def run_vllm(seed: int, reps: int, hash_algo: str) -> dict:
    import logging

    logging.disable(logging.WARNING)
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, KVCacheTensor)
    from vllm.v1.request import Request

    lengths, tokens = make_session(seed)
    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128,
                             dtype=torch.bfloat16)
    num_blocks = TOTAL // BLOCK_SIZE + 512
    sp = SamplingParams(max_tokens=1)
    totals, phases = [], []
    for rep in range(reps):
        cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        kv = KVCacheManager(cfg, max_model_len=TOTAL + 1024, scheduler_block_size=BLOCK_SIZE,
                            hash_block_size=BLOCK_SIZE, enable_caching=True)
        times, ph = [], []
        for t, plen in enumerate(lengths):
            prompt = tokens[:plen].tolist()
            nxt = int(tokens[plen])
            t0 = time.perf_counter()
            req = Request(f"s-{rep}-{t}", prompt, sp, None, block_hasher=hasher,
                          session_id="agent")
            blocks, n_hit = kv.get_computed_blocks(req)[:2]
            t1 = time.perf_counter()
            if kv.allocate_slots(req, plen - n_hit, n_hit, blocks) is None:
                raise RuntimeError("pool too small")
            req.num_computed_tokens = plen
            t2 = time.perf_counter()
            req.append_output_token_ids(nxt)
            if kv.allocate_slots(req, 1) is None:
                raise RuntimeError("pool too small")
            req.num_computed_tokens += 1
            t3 = time.perf_counter()
            kv.free(req)
            t4 = time.perf_counter()
            if t:
                assert n_hit >= (lengths[t - 1] + 1) // BLOCK_SIZE * BLOCK_SIZE, (t, n_hit)
            times.append(t4 - t0)
            ph.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
        totals.append(times)
        phases.append(ph)
    out = _summarize(totals)
    names = ("hash_lookup", "allocate_prompt", "decode_1", "free")
    last = [[statistics.median(r[t][i] for r in phases) for t in range(TURNS - 8, TURNS)]
            for i in range(4)]
    out["last8_phase_median_ms"] = {n: statistics.median(v) * 1e3 for n, v in zip(names, last)}
    import vllm
    out["version"] = vllm.__version__
    out["hash_algo"] = hash_algo
    return out


def vllm_subprocess(seed: int, reps: int, hash_algo: str) -> dict:
    if not os.path.exists(VLLM_PY):
        return {"error": f"{VLLM_PY} missing: run benchmarks/peers/vllm_env.sh"}
    proc = subprocess.run([VLLM_PY, os.path.abspath(__file__), "--driver", "vllm", "--seed",
                           str(seed), "--reps", str(reps), "--hash-algo", hash_algo],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-hash-algos", default="sha256,xxhash")
    ap.add_argument("--driver", choices=["vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--hash-algo", default="sha256", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kv_manager_cost.json"))
    args = ap.parse_args()
    if args.driver == "vllm":
        print(json.dumps(run_vllm(args.seed, args.reps, args.hash_algo)))
        return

    lengths, _ = make_session(args.seed)
    results = {"workload": {"turns": TURNS, "final_prompt_tokens": lengths[-1] + 1,
                            "block_size": BLOCK_SIZE, "seed": args.seed, "reps": args.reps,
                            "new_tokens_per_turn_min_max": [
                                min(b - a for a, b in zip([-1] + lengths, lengths)),
                                max(b - a for a, b in zip([-1] + lengths, lengths))]},
               "loomserve": run_loomserve(args.seed, args.reps)}
    if not args.no_vllm:
        for algo in args.vllm_hash_algos.split(","):
            results[f"vllm_{algo}"] = vllm_subprocess(args.seed, args.reps, algo)

    print(f"{'manager':<16}{'median/turn ms':>16}{'last 8 (128K) ms':>18}{'ratio@128K':>12}")
    ours = results["loomserve"]["median_ms_last8_turns"]
    for name, r in results.items():
        if name == "workload":
            continue
        if "error" in r:
            print(f"{name:<16} failed: {r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            continue
        ratio = r["median_ms_last8_turns"] / ours
        r["ratio_vs_loomserve_at_128k"] = ratio
        print(f"{name:<16}{r['median_ms_all_turns']:>16.2f}{r['median_ms_last8_turns']:>18.2f}"
              f"{ratio:>11.1f}x")
        print("    last-8 phases ms: " + ", ".join(
            f"{k} {v:.2f}" for k, v in r["last8_phase_median_ms"].items()))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
