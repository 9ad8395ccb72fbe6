"""Attention alone on a GPU, the backends side by side (issue 12): triton (in place) vs torch
(gather + SDPA with masks), one layer call each, on two shapes:
  longctx   the long-context benchmark model's layer: 4 query heads, 1 KV head of 32
  8b        an 8B-class layer: 32 query heads, 8 KV heads of 128
in bf16 with 16-token blocks scattered over the pool. Cases: one decode at 128K context, 64
decodes at 32K each, a 2,048-token chunk over a cached 104K prefix. Beside each: the limit
(decode: K+V bytes / measured copy bandwidth; prefill: attention FLOPs / measured bf16 matmul
rate) and the largest difference from the torch backend's output. A case the torch backend
cannot hold in memory is reported as such.

    python benchmarks/gpu_attention.py [--out gpu_attention.json]     (needs CUDA; ~1 minute)
gpu_check.py runs the same cases as its `attention` part.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import host_info, write_json  # noqa: E402

from loomserve.execution.attention import build_metadata, paged_attention, select_backend  # noqa: E402

BS = 16
SHAPES = {"longctx": (4, 1, 32), "8b": (32, 8, 128)}  # heads, kv heads, head dim
CASES = {"decode_1x128k": ([131072 - 1], 1), "decode_64x32k": ([32768 - 1] * 64, 1),
         "prefill_2k_over_104k": ([106496], 2048)}


def cuda_time(fn, repeats: int = 10) -> float:
    """Median seconds of fn() by CUDA events, after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return float(np.median(times))


def ceilings(dev) -> dict:
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    bw = 2 * x.numel() / cuda_time(lambda: y.copy_(x), 5)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    rate = 2 * 8192 ** 3 / cuda_time(lambda: a @ a, 5)
    return {"bandwidth_gb_s": round(bw / 1e9, 1), "bf16_matmul_tflops": round(rate / 1e12, 1)}


def run(shape: str, case: str, dev, hw: dict) -> dict:
    heads, kvh, hd = SHAPES[shape]
    starts, n = CASES[case]
    dt = torch.bfloat16
    rng = np.random.default_rng(0)
    per_seq = [(s + n + BS - 1) // BS for s in starts]
    pool = sum(per_seq) + 8
    pages = torch.randn(pool, 2, BS, kvh, hd, device=dev, dtype=dt)
    order = rng.permutation(pool).astype(np.int32)
    tables = np.split(order[:sum(per_seq)], np.cumsum(per_seq)[:-1])
    rows = len(starts) * n
    q = torch.randn(rows, heads, hd, device=dev, dtype=dt)
    k = torch.randn(rows, kvh, hd, device=dev, dtype=dt)
    v = torch.randn(rows, kvh, hd, device=dev, dtype=dt)
    decodes = [(s, t) for s, t in zip(starts, tables)] if n == 1 else []
    prefills = [] if n == 1 else [(s, n, t) for s, t in zip(starts, tables)]
    keys = sum(s + n for s in starts)
    if n == 1:
        limit = 2 * keys * kvh * hd * 2 / (hw["bandwidth_gb_s"] * 1e9)
    else:
        limit = 4 * n * (starts[0] + n / 2) * hd * heads / (hw["bf16_matmul_tflops"] * 1e12)
    out = {"shape": shape, "case": case, "limit_ms": round(limit * 1e3, 4)}
    results = {}
    for name in ("triton", "torch"):
        be = select_backend(name, dev, dt)

        def call():
            meta, _ = build_metadata(decodes, prefills, BS, dev, dt, be)
            return paged_attention(q, k, v, pages[:, 0], pages[:, 1], meta, hd ** -0.5)
        try:
            results[name] = call()
            out[f"{name}_ms"] = round(cuda_time(call) * 1e3, 4)
        except torch.OutOfMemoryError:
            out[f"{name}_ms"] = "out of memory"
        torch.cuda.empty_cache()
    if "torch" in results and "triton" in results:
        out["max_abs_diff"] = float((results["triton"].float() - results["torch"].float()).abs().max())
    if isinstance(out.get("triton_ms"), float):
        out["x_of_limit"] = round(out["triton_ms"] / out["limit_ms"], 2)
    print("[gpu_attention]", out, file=sys.stderr, flush=True)
    return out


def measure_all() -> dict:
    """Every shape and case on the current CUDA device, beside the measured ceilings."""
    dev = torch.device("cuda")
    hw = ceilings(dev)
    print("[gpu_attention]", torch.cuda.get_device_name(dev), hw, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    cases = []
    for shape in SHAPES:
        for case in CASES:
            try:
                cases.append(run(shape, case, dev, hw))
            except Exception as e:  # noqa: BLE001 - reported; the other cases stand
                cases.append({"shape": shape, "case": case, "error": f"{type(e).__name__}: {e}"})
                print("[gpu_attention]", cases[-1], file=sys.stderr, flush=True)
    return {"description": "attention alone on a GPU: triton vs torch backends (bf16, block 16)",
            "device": torch.cuda.get_device_name(dev), "hardware": hw, "host": host_info(),
            "torch": torch.__version__, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "wall_s": round(time.perf_counter() - t0, 1), "cases": cases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu_attention.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_attention: no CUDA device; nothing measured", file=sys.stderr)
        return 3
    payload = measure_all()
    print("wrote", write_json(args.out, payload), file=sys.stderr)
    return 0 if not any("error" in c for c in payload["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
