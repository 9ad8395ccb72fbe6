"""Attention alone, the backends side by side (issue 12): metadata, decode, prefill.

1. Metadata for 64 decodes at a 128K context each, per step: the runner's path (incremental
   block tables, build_metadata, the CPU backend's per-step plan) vs what the torch backend
   derives (padded tables and a dense mask), the old design's per-step cost.
2. Decode attention of the long-context benchmark model's shape (2 layers, 4 query heads, 1 KV
   head of 32, fp32, block 16) at one sequence of 32K / 128K, beside the KV-bandwidth limit
   (K and V bytes read / measured read bandwidth).
3. A 2,048-token prefill chunk over a cached 104K context (one layer), beside the FLOP limit
   (4 * q * ctx * head_dim * heads FLOPs at a measured fp32 matmul rate).
4. A 2,048-token prefill chunk over a cached 8K context under a sliding window (one layer), in
   gpt-oss-20b's attention shape (64 query heads, 8 KV heads of 64, window 128, sinks) and
   Mistral-7B-v0.1's (32 / 8 of 128, window 4096), beside the FLOP limit over the keys each
   query sees, with the peak memory each backend adds (VmHWM over VmRSS, each in a fresh process).

    python benchmarks/paged_attention.py [--repeats 5] [--out benchmarks/results/paged_attention.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common.host import host_info  # noqa: E402
from benchmarks.common.results import write_json  # noqa: E402
from loomserve.execution.attention import (  # noqa: E402
    BlockTables,
    build_metadata,
    paged_attention,
    select_backend,
)
from loomserve.execution.attention.torch_backend import _decode_inputs  # noqa: E402

CPU = torch.device("cpu")
BS, KVH, HD, HEADS = 16, 1, 32, 4


def timed(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bandwidth() -> float:
    """Read bandwidth in bytes/s: a 1 GiB sum (what a decode's KV read looks like)."""
    x = torch.ones(256 << 20)
    return x.numel() * 4 / timed(lambda: x.sum(), 5)


def matmul_rate() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048 ** 3 / timed(lambda: a @ b, 5)


def metadata(repeats: int, seqs: int = 64, ctx: int = 131072) -> dict:
    cpu = select_backend("cpu_paged", CPU, torch.float32)
    torch_be = select_backend("torch", CPU, torch.float32)
    lists = [list(range(i * 10, i * 10 + ctx // BS + 1)) for i in range(seqs)]
    tables = BlockTables()
    for i, ids in enumerate(lists):
        tables.get(str(i), 0, ids)

    def ours():
        decs = [(ctx - 1, tables.get(str(i), 0, ids)) for i, ids in enumerate(lists)]
        meta, _ = build_metadata(decs, [], BS, CPU, torch.float32, cpu)
        cpu._decode_plan(meta, KVH, HEADS)

    def old():
        decs = [(ctx - 1, tables.get(str(i), 0, ids)) for i, ids in enumerate(lists)]
        meta, _ = build_metadata(decs, [], BS, CPU, torch.float32, torch_be)
        _decode_inputs(meta)

    return {"seqs": seqs, "context": ctx, "cpu_paged_ms": timed(ours, repeats) * 1e3,
            "torch_padded_tables_and_mask_ms": timed(old, max(1, repeats // 2)) * 1e3}


def decode(repeats: int, ctx: int, bw: float) -> dict:
    nb = ctx // BS + 2
    pages = torch.randn(nb, 2, 2, BS, KVH, HD)  # [blocks, layers, K/V, ...]
    table = np.random.default_rng(0).permutation(nb).astype(np.int32)
    q, k, v = torch.randn(1, HEADS, HD), torch.randn(1, KVH, HD), torch.randn(1, KVH, HD)
    out = {"context": ctx, "limit_ms": 2 * ctx * 2 * KVH * HD * 4 / bw * 1e3}
    for name in ("cpu_paged", "torch"):
        be = select_backend(name, CPU, torch.float32)

        def step():
            meta, _ = build_metadata([(ctx - 1, table)], [], BS, CPU, torch.float32, be)
            for layer in range(2):
                paged_attention(q, k, v, pages[:, layer, 0], pages[:, layer, 1], meta, HD ** -0.5)
        out[f"{name}_ms"] = timed(step, repeats if name == "cpu_paged" else max(1, repeats // 2)) * 1e3
    return out


def prefill(repeats: int, rate: float, cached: int = 106496, n: int = 2048) -> dict:
    ctx = cached + n
    nb = ctx // BS + 2
    pages = torch.randn(nb, 2, BS, KVH, HD)
    table = np.random.default_rng(1).permutation(nb).astype(np.int32)
    q, k, v = torch.randn(n, HEADS, HD), torch.randn(n, KVH, HD), torch.randn(n, KVH, HD)
    flops = 4 * n * (cached + n / 2) * HD * HEADS
    out = {"cached": cached, "chunk": n, "limit_ms": flops / rate * 1e3}
    for name in ("cpu_paged", "torch"):
        be = select_backend(name, CPU, torch.float32)

        def step():
            meta, _ = build_metadata([], [(cached, n, table)], BS, CPU, torch.float32, be)
            paged_attention(q, k, v, pages[:, 0], pages[:, 1], meta, HD ** -0.5)
        out[f"{name}_ms"] = timed(step, max(1, repeats // 2)) * 1e3
    return out


WINDOWED = {"gpt-oss-20b": (64, 8, 64, 128, True), "mistral-7b-v0.1": (32, 8, 128, 4096, False)}


def windowed_prefill(repeats: int, rate: float, shape: str, cached: int = 8192, n: int = 2048) -> dict:
    heads, kvh, hd, w, _ = WINDOWED[shape]
    seen = sum(min(w, p + 1) for p in range(cached, cached + n))
    out = {"shape": shape, "window": w, "cached": cached, "chunk": n,
           "limit_ms": 4 * seen * hd * heads / rate * 1e3}
    spawn = multiprocessing.get_context("spawn")
    for name in ("cpu_paged", "torch"):  # each in a fresh process: its own peak memory
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            ms, grew = pool.submit(_windowed_run, name, shape, cached, n, max(1, repeats // 2)).result()
        out[f"{name}_ms"], out[f"{name}_peak_growth_mb"] = ms, grew
    return out


def _windowed_run(name: str, shape: str, cached: int, n: int, repeats: int) -> tuple[float, float]:
    """(median ms of one layer's chunk, growth of the process's peak RSS in MB while timing)."""
    heads, kvh, hd, w, with_sinks = WINDOWED[shape]
    nb = (cached + n) // BS + 2
    pages = torch.randn(nb, 2, BS, kvh, hd)
    table = np.random.default_rng(2).permutation(nb).astype(np.int32)
    q, k, v = torch.randn(n, heads, hd), torch.randn(n, kvh, hd), torch.randn(n, kvh, hd)
    sinks = torch.randn(heads) if with_sinks else None
    be = select_backend(name, CPU, torch.float32)

    def step():
        meta, _ = build_metadata([], [(cached, n, table)], BS, CPU, torch.float32, be, w)
        paged_attention(q, k, v, pages[:, 0], pages[:, 1], meta, hd ** -0.5, sinks)
    before = _rss_kb(reset_peak=True)
    ms = timed(step, repeats) * 1e3
    return ms, (_rss_kb("VmHWM") - before) / 1024


def _rss_kb(field: str = "VmRSS", reset_peak: bool = False) -> int:
    """The process's resident (VmRSS) or peak resident (VmHWM) kB; reset_peak first sets the
    peak to the current RSS (Linux: 5 > /proc/self/clear_refs)."""
    if reset_peak:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/paged_attention.json")
    args = ap.parse_args()
    bw, rate = bandwidth(), matmul_rate()
    res = {"host": host_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "threads": torch.get_num_threads(), "load_avg": os.getloadavg(),
           "bandwidth_gb_s": bw / 1e9, "fp32_matmul_gflops": rate / 1e9,
           "metadata": metadata(args.repeats),
           "decode": [decode(args.repeats, c, bw) for c in (32768, 131072)],
           "prefill": prefill(args.repeats, rate),
           "windowed_prefill": [windowed_prefill(args.repeats, rate, s) for s in WINDOWED]}
    print(json.dumps(res, indent=1))
    write_json(args.out, res)


if __name__ == "__main__":
    main()
