"""Per-turn CPU cost of the KV cache manager in a long agent session: loomserve vs vLLM v1.

Workload: one agent session of 64 turns whose prompt grows to 128K tokens (131072), each turn
adding 1K-4K new tokens (seeded draws from 1K + 3K * Beta(1, 2), mean 2K, rescaled to sum
to 128K); block size 16 and
enough blocks to hold the whole session. Each turn is a new request (session_id set) whose
prompt is the previous prompt, the token generated last turn and the new tokens, as a fresh
Python list (as a server re-tokenizing the chat would produce). Per turn we time:
  create the request (vLLM hashes its prompt blocks in Request.__init__) + get_computed_blocks
  + allocate_slots for the whole uncached prompt + append 1 generated token and allocate_slots
  for it (decode) + free at the end of the turn.
Building the token list is not timed. A second loomserve row runs without session_id, so
every turn rehashes its whole prompt (what the session memo saves). The session is repeated --reps times on a fresh manager;
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
    lo, hi = 1024, 4096
    target = total - turns  # one generated token per turn completes the total
    # 1K + 3K * Beta(1, 2): spans 1K-4K with mean 2K, so 64 turns reach ~128K; then the
    # excesses over 1K are rescaled (clipped at 4K) to hit 128K exactly.
    x = lo + (hi - lo) * rng.beta(1.0, 2.0, turns)
    for _ in range(20):
        x = np.minimum(hi, lo + (x - lo) * (target - turns * lo) / (x.sum() - turns * lo))
    inc = np.floor(x).astype(np.int64)
    for i in np.argsort(inc):  # hand out the rounding remainder, 1 token each
        if inc.sum() == target:
            break
        inc[i] += inc[i] < hi
    assert inc.sum() == target and inc.min() >= lo and inc.max() <= hi
    lengths = []
    p = 0
    for i in range(turns):
        p += int(inc[i])
        lengths.append(p)
        p += 1  # the token generated in this turn is part of the next prompt
    tokens = rng.integers(1000, 150_000, p + 1, dtype=np.int64)
    return lengths, tokens


def _summarize(reps: list[tuple[list[float], list[tuple]]]) -> dict:
    """reps: per repetition, (per-turn totals, per-turn phase tuples)."""
    per_turn = [statistics.median(col) for col in zip(*(r[0] for r in reps))]
    names = ("hash_lookup", "allocate_prompt", "decode_1", "free")
    last = [[statistics.median(r[1][t][i] for r in reps) for t in range(TURNS - 8, TURNS)]
            for i in range(4)]
    return {
        "median_ms_all_turns": statistics.median(per_turn) * 1e3,
        "median_ms_last8_turns": statistics.median(per_turn[-8:]) * 1e3,
        "last8_phase_median_ms": {n: statistics.median(v) * 1e3 for n, v in zip(names, last)},
        "per_turn_ms": [t * 1e3 for t in per_turn],
    }


def _drive(lengths, tokens, new_request, lookup, allocate, append_token, free):
    """One session on a fresh manager: per-turn total seconds and phase split."""
    times, phases = [], []
    for t, plen in enumerate(lengths):
        prompt = tokens[:plen].tolist()
        nxt = int(tokens[plen])
        t0 = time.perf_counter()
        req = new_request(t, prompt)
        hit, n_hit = lookup(req)
        t1 = time.perf_counter()
        if not allocate(req, plen - n_hit, hit, n_hit):
            raise RuntimeError("pool too small")
        req.num_computed_tokens = plen
        t2 = time.perf_counter()
        append_token(req, nxt)
        if not allocate(req, 1, None, 0):
            raise RuntimeError("pool too small")
        req.num_computed_tokens += 1
        t3 = time.perf_counter()
        free(req)
        t4 = time.perf_counter()
        if t:  # the whole previous turn (prompt + generated token) must hit, block aligned
            assert n_hit == (lengths[t - 1] + 1) // BLOCK_SIZE * BLOCK_SIZE, (t, n_hit)
        times.append(t4 - t0)
        phases.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    return times, phases


# -- loomserve ----------------------------------------------------------------------------
def loomserve_rep(seed: int, rep: int, session: bool = True):
    sys.path.insert(0, ROOT)
    from dataclasses import dataclass, field

    import torch

    from loomserve.kv.cache_manager import KVCacheManager
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
    kv = KVCacheManager(KVCacheConfig(num_blocks, (KVCacheGroup(spec, (0,)),)))
    sid = "agent" if session else None
    return _drive(lengths, tokens,
                  lambda t, prompt: Req(f"s-{rep}-{t}", prompt, len(prompt), session_id=sid),
                  kv.get_computed_blocks,
                  lambda req, n, hit, n_hit: kv.allocate_slots(req, n, hit, n_hit),
                  lambda req, tok: req.all_token_ids.append(tok),
                  kv.free)


# -- vLLM (run inside the peer venv) ------------------------------------------------------
def vllm_rep(seed: int, rep: int, hash_algo: str):
    import logging

    logging.disable(logging.WARNING)
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    lengths, tokens = make_session(seed)
    hash_fn = get_hash_fn_by_name(hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128,
                             dtype=torch.bfloat16)
    num_blocks = TOTAL // BLOCK_SIZE + 512
    sp = SamplingParams(max_tokens=1)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    kv = KVCacheManager(cfg, max_model_len=TOTAL + 1024, scheduler_block_size=BLOCK_SIZE,
                        hash_block_size=BLOCK_SIZE, enable_caching=True)

    def allocate(req, n, blocks, n_hit):
        if blocks is None:
            return kv.allocate_slots(req, n) is not None
        return kv.allocate_slots(req, n, n_hit, blocks) is not None

    return _drive(lengths, tokens,
                  lambda t, prompt: Request(f"s-{rep}-{t}", prompt, sp, None,
                                            block_hasher=hasher, session_id="agent"),
                  lambda req: kv.get_computed_blocks(req)[:2],
                  allocate,
                  lambda req, tok: req.append_output_token_ids(tok),
                  kv.free)


def vllm_driver(seed: int) -> None:
    """Peer-venv side: one line in (hash algo, rep), one JSON line out."""
    import vllm

    print(json.dumps({"version": vllm.__version__}), flush=True)
    for line in sys.stdin:
        algo, rep = line.split()
        times, phases = vllm_rep(seed, int(rep), algo)
        print(json.dumps({"times": times, "phases": phases}), flush=True)


class VllmPeer:
    def __init__(self, seed: int) -> None:
        self.proc = subprocess.Popen(
            [VLLM_PY, os.path.abspath(__file__), "--driver", "vllm", "--seed", str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.version = self._read()["version"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(self.proc.stderr.read()[-3000:])
        return json.loads(line)

    def rep(self, algo: str, rep: int):
        self.proc.stdin.write(f"{algo} {rep}\n")
        self.proc.stdin.flush()
        r = self._read()
        return r["times"], r["phases"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--vllm-hash-algos", default="sha256,xxhash")
    ap.add_argument("--driver", choices=["vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kv_manager_cost.json"))
    args = ap.parse_args()
    if args.driver == "vllm":
        vllm_driver(args.seed)
        return

    lengths, _ = make_session(args.seed)
    results = {"workload": {"turns": TURNS, "final_prompt_tokens": lengths[-1] + 1,
                            "block_size": BLOCK_SIZE, "seed": args.seed, "reps": args.reps,
                            # new prompt tokens per turn (after the generated token)
                            "new_tokens_per_turn_min_max": [
                                min(b - a - 1 for a, b in zip([-1] + lengths, lengths)),
                                max(b - a - 1 for a, b in zip([-1] + lengths, lengths))]}}
    algos = [] if args.no_vllm else args.vllm_hash_algos.split(",")
    peer = None
    if algos:
        try:
            if not os.path.exists(VLLM_PY):
                raise RuntimeError(f"{VLLM_PY} missing: run benchmarks/peers/vllm_env.sh")
            peer = VllmPeer(args.seed)
        except Exception as e:  # noqa: BLE001 - report, keep the loomserve side
            for algo in algos:
                results[f"vllm_{algo}"] = {"error": str(e)}
            algos = []
    # Repetitions are interleaved (loomserve, loomserve without session, each vLLM variant)
    # so drift in a shared machine's load hits every row alike.
    runs: dict[str, list] = {"loomserve": [], "loomserve_nosess": []}
    runs.update({f"vllm_{a}": [] for a in algos})
    for rep in range(args.reps):
        runs["loomserve"].append(loomserve_rep(args.seed, rep))
        # Without a session id every turn rehashes its whole prompt (xxh3-128).
        runs["loomserve_nosess"].append(loomserve_rep(args.seed, rep, session=False))
        for a in algos:
            runs[f"vllm_{a}"].append(peer.rep(a, rep))
    if peer is not None:
        peer.close()
    for name, reps in runs.items():
        results[name] = _summarize(reps)
        if name.startswith("vllm_"):
            results[name].update(version=peer.version, hash_algo=name[5:])

    print(f"{'manager':<16}{'median/turn ms':>16}{'last 8 (128K) ms':>18}{'ratio@128K':>12}")
    ours = results["loomserve"]["median_ms_last8_turns"]
    for name, r in results.items():
        if name == "workload":
            continue
        if "error" in r:
            print(f"{name:<16} failed: {(r['error'].strip().splitlines() or ['?'])[-1]}")
            continue
        ratio = r["median_ms_last8_turns"] / ours
        r["ratio_vs_loomserve_at_128k"] = ratio
        print(f"{name:<16}{r['median_ms_all_turns']:>16.2f}{r['median_ms_last8_turns']:>18.2f}"
              f"{ratio:>11.1f}x")
        print("    last-8 phases ms: " + ", ".join(
            f"{k} {v:.2f}" for k, v in r["last8_phase_median_ms"].items()))
    sys.path.insert(0, HERE)  # here, not at the top: vLLM's venv runs this file as a driver
    from common.results import write_json

    write_json(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
