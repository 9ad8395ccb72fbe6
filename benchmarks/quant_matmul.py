"""Quantized matmul kernel (kernels/quant.c) vs fp32 torch matmul, per matrix shape of the default model.

For SmolLM2-135M's matrices (per layer qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536;
the 49152x576 tied LM head), at R rows (sequences decoding at once):

  fp32   F.linear on the input-major weight the fp32 CPU layout uses (MKL)
  q4_1   QuantLinear, 4-bit with mins (GGUF Q4_1's bytes: 0.5 B/weight + fp16 s, m per 32)
  q8_0   QuantLinear, 8-bit symmetric (GGUF Q8_0's bytes: 1 B/weight + fp16 s per 32)

Beside each: the weight bytes streamed per call and the bandwidth limit (bytes / measured read
GB/s from benchmarks/membw.py), the best a one-row call can do. Median and minimum of --repeats
calls, the variants interleaved so machine noise hits all alike; on a shared 2-core host an
OpenMP barrier waiting on a descheduled thread costs a scheduler quantum, so the minimum is
the better estimate of the kernels' own speed and the ratios below use it. "model pass" sums one call per matrix of
the whole model (30 layers + LM head), each timed on a matrix that stays in cache between
calls; "model, distinct" times a real pass over 121 distinct matrices (every byte from memory,
as a decode step reads them), 4-bit layers with the Q8_0 LM head as the default GGUF has.

Run:  nice -n -15 python benchmarks/quant_matmul.py [--rows 1 32] [--repeats 30] [--threads 1]
Output: a table, and benchmarks/results/quant_matmul.json (quant_matmul-t1.json with --threads 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import host_info, write_json  # noqa: E402

from loomserve.execution.layers.quant import QuantLinear, quantize_weight  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
PER_MODEL = {"qkv": 30, "o": 30, "gate_up": 30, "down": 30, "lm_head": 1}


def variants(n: int, k: int, rows: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g)
    wt = w.t().contiguous().t()  # input-major, as optimize_cpu_layout stores fp32 weights
    q4 = QuantLinear(*quantize_weight(w, 4), 4)
    q8 = QuantLinear(*quantize_weight(w, 8), 8)
    return {"fp32": (lambda: F.linear(x, wt), n * k * 4),
            "q4_1": (lambda: q4(x), q4.weight_bytes()),
            "q8_0": (lambda: q8(x), q8.weight_bytes())}


def distinct_pass(rows: int, repeats: int, bw: float) -> dict:
    """One pass over the whole model with a distinct weight per matrix (Q4_1 layers, Q8_0 head)."""
    g = torch.Generator().manual_seed(1)
    mats = [QuantLinear(*quantize_weight(torch.randn(n, k, generator=g) * 0.05, 8 if name == "lm_head" else 4),
                        8 if name == "lm_head" else 4)
            for name, (n, k) in SHAPES.items() for _ in range(PER_MODEL[name])]
    xs = {k: torch.randn(rows, k, generator=g) for k in (576, 1536)}

    def run():
        for m in mats:
            m(xs[m.in_features])
    times = time_variants({"q4_1+q8_0": (run, 0)}, repeats)["q4_1+q8_0"]
    nbytes = sum(m.weight_bytes() for m in mats)
    return {"shape": "model, distinct", "rows": rows, "variant": "q4_1+q8_0", "median_us": times[0] * 1e6,
            "us": times[1] * 1e6, "bytes": nbytes, "limit_us": nbytes / bw / 1e3, "gbs": nbytes / times[1] / 1e9,
            "speedup_vs_fp32": float("nan")}


def time_variants(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """(median, min) seconds per variant."""
    for f, _ in fns.values():
        f()
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, (f, _) in fns.items():
            t = time.perf_counter()
            f()
            runs[name].append(time.perf_counter() - t)
    return {k: (statistics.median(v), min(v)) for k, v in runs.items()}


def _row(rec: dict) -> None:
    shape = rec["shape"] + (f" {rec['n']}x{rec['k']}" if "n" in rec else "")
    print(f"{shape:>16} {rec['rows']:>4} {rec['variant']:7} {rec['median_us']:9.1f} {rec['us']:9.1f} "
          f"{rec['bytes'] / 1e6:7.2f} {rec['limit_us']:9.1f} {rec['gbs']:6.1f} {rec['speedup_vs_fp32']:7.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch (and kernel) threads; 1 measures a core without OpenMP waits")
    ap.add_argument("--out", default=None,
                    help="result file (default: quant_matmul.json, quant_matmul-t1.json with --threads 1)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from membw import measure_read_bandwidth
    bw = measure_read_bandwidth()
    out = {"host": host_info(), "read_gbs": bw, "threads": torch.get_num_threads(),
           "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "results": []}
    print(f"read bandwidth {bw:.1f} GB/s, {torch.get_num_threads()} threads")
    print(f"{'shape':>16} {'rows':>4} {'variant':7} {'med us':>9} {'min us':>9} {'MB':>7} {'limit us':>9} "
          f"{'GB/s':>6} {'vs fp32':>7}")
    for rows in args.rows:
        model = {}
        for name, (n, k) in SHAPES.items():
            fns = variants(n, k, rows)
            times = time_variants(fns, args.repeats)
            for var, (med, t) in times.items():
                nbytes = fns[var][1]
                rec = {"shape": name, "n": n, "k": k, "rows": rows, "variant": var, "median_us": med * 1e6,
                       "us": t * 1e6, "bytes": nbytes, "limit_us": nbytes / bw / 1e3, "gbs": nbytes / t / 1e9,
                       "speedup_vs_fp32": times["fp32"][1] / t}
                out["results"].append(rec)
                m = model.setdefault(var, [0.0, 0, 0.0])
                m[0] += PER_MODEL[name] * t
                m[1] += PER_MODEL[name] * nbytes
                m[2] += PER_MODEL[name] * med
                _row(rec)
        for var, (t, nbytes, med) in model.items():
            rec = {"shape": "model pass", "rows": rows, "variant": var, "median_us": med * 1e6, "us": t * 1e6,
                   "bytes": nbytes, "limit_us": nbytes / bw / 1e3, "gbs": nbytes / t / 1e9,
                   "speedup_vs_fp32": model["fp32"][0] / t}
            out["results"].append(rec)
            _row(rec)
        rec = distinct_pass(rows, args.repeats, bw)
        out["results"].append(rec)
        _row(rec)
    name = args.out or ("quant_matmul-t1.json" if args.threads == 1 else "quant_matmul.json")
    print("wrote", write_json(name, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
