"""Quantized matmul kernel (kernels/quant.c) vs fp32 torch matmul, per matrix shape of the default model.

For SmolLM2-135M's matrices (per layer qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536;
the 49152x576 tied LM head), at R rows (sequences decoding at once):

  fp32   F.linear on the input-major weight the fp32 CPU layout uses (MKL)
  q4_1   QuantLinear, 4-bit with mins (GGUF Q4_1's bytes: 0.5 B/weight + fp16 s, m per 32)
  q8_0   QuantLinear, 8-bit symmetric (GGUF Q8_0's bytes: 1 B/weight + fp16 s per 32)
  q5_0   QuantLinear, GGUF Q5_0 in 5 bits (a nibble plane + a bit plane + fp16 s per 32)

K-quants (GGUF Q4_K, Q5_K, Q6_K, run as the file stores them) need rows of whole 256-value
super-blocks: of these shapes only down (K=1536) qualifies, so they are measured at the nearest
legal ones, K=576 rounded down to 512 (576x512, 1536x512, 49152x512, and down's 576x1536), with
q4_1, q5_0 and q8_0 at the same shapes (the "kq" rows). llama.cpp's llama-quantize does the same
rounding the other way for SmolLM2: its Q4_K_M stores every K=576 matrix as Q5_0 (Q8_0 where
the mix asks for Q6_K), and only ffn_down as Q4_K / Q6_K.

Beside each: the weight bytes streamed per call, bits per weight, and the bandwidth limit
(bytes / measured read GB/s from benchmarks/membw.py), the best a one-row call can do. Median
and minimum of --repeats calls, the variants interleaved so machine noise hits all alike; on a
shared 2-core host an OpenMP barrier waiting on a descheduled thread costs a scheduler quantum,
so the minimum is the better estimate of the kernels' own speed and the ratios below use it.
"model pass" sums one call per matrix of the whole model (30 layers + LM head), each timed on a
matrix that stays in cache between calls; "model, distinct" times a real pass over 121 distinct
matrices (every byte from memory, as a decode step reads them) for three whole models:
  q4_1+q8_0   the default GGUF (Q4_1 layers, Q8_0 tied LM head)
  q4_k_m      SmolLM2-135M Q4_K_M as llama-quantize makes it (types above: q|k|v Q5_0, with a
              Q8_0 v on 14 layers as one module of two segments; o, gate|up Q5_0; down Q4_K on
              16 layers, Q6_K on 14; Q8_0 head)
  q4_k_m-int8 the same with Q5_0 widened to int8, as loomserve held Q5_0 before

Run:  nice -n -15 python benchmarks/quant_matmul.py [--rows 1 32] [--repeats 30] [--threads 1]
Output: a table, and benchmarks/results/quant_matmul.json (quant_matmul-t1.json with --threads 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import host_info, write_json  # noqa: E402

from loomserve.execution.layers.quant import QuantLinear, QuantWeight, quantize_weight  # noqa: E402
from loomserve.execution.models.loading.gguf_quant import from_gguf_blocks  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
PER_MODEL = {"qkv": 30, "o": 30, "gate_up": 30, "down": 30, "lm_head": 1}
KQ_SHAPES = {"kq 576x512": (576, 512), "kq 1536x512": (1536, 512), "kq 576x1536": (576, 1536),
             "kq 49152x512": (49152, 512)}
MORE_BITS = {i for i in range(30) if i < 3 or i >= 26 or (i - 3) % 3 == 2}  # llama.cpp's use_more_bits


def gguf_weight(qtype: str, n: int, k: int, rng: np.random.Generator) -> QuantWeight:
    """A GGUF tensor of random blocks (finite d, dmin) as the loader reads it: the kernels'
    speed does not depend on the values."""
    import gguf

    name = qtype.upper()
    t = gguf.GGMLQuantizationType[name]
    size = gguf.GGML_QUANT_SIZES[t][1]
    b = rng.integers(0, 256, (n * k // gguf.GGML_QUANT_SIZES[t][0], size), dtype=np.uint8)
    d = (rng.uniform(0.5, 2, (len(b), 2)) * 1e-3).astype(np.float16).view(np.uint8)  # d, dmin
    at = slice(size - 2, size) if name == "Q6_K" else slice(0, 4 if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 2)
    b[:, at] = d[:, :at.stop - at.start]
    return from_gguf_blocks(b, t, n, k)


def as_int8(w: QuantWeight) -> QuantWeight:
    """A Q5 weight as loomserve held it before (int8 values, same scales)."""
    return QuantWeight(8, w.q, w.scales, w.mins) if w.fmt == 5 else w


def variants(n: int, k: int, rows: int, kq: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g)
    q4 = QuantLinear(*quantize_weight(w, 4), 4)
    q8 = QuantLinear(*quantize_weight(w, 8), 8)
    q5 = QuantLinear.of(gguf_weight("q5_0", n, k, rng))
    out = {"q4_1": (lambda: q4(x), q4.weight_bytes()), "q8_0": (lambda: q8(x), q8.weight_bytes()),
           "q5_0": (lambda: q5(x), q5.weight_bytes())}
    if not kq:
        wt = w.t().contiguous().t()  # input-major, as optimize_cpu_layout stores fp32 weights
        return {"fp32": (lambda: F.linear(x, wt), n * k * 4), **out}
    for name in ("q4_k", "q5_k", "q6_k"):
        m = QuantLinear.of(gguf_weight(name, n, k, rng))
        out[name] = (lambda m=m: m(x), m.weight_bytes())
    return out


def model_mats(kind: str) -> list[QuantLinear]:
    """The 121 matrices of one whole model (the module docstring's kinds), each distinct."""
    g, rng = torch.Generator().manual_seed(1), np.random.default_rng(1)
    if kind == "q4_1+q8_0":
        return [QuantLinear(*quantize_weight(torch.randn(n, k, generator=g) * 0.05, 8 if name == "lm_head" else 4),
                            8 if name == "lm_head" else 4)
                for name, (n, k) in SHAPES.items() for _ in range(PER_MODEL[name])]
    conv = as_int8 if kind.endswith("int8") else (lambda w: w)
    mats = []
    for layer in range(30):
        more = layer in MORE_BITS
        qkv = [gguf_weight("q5_0", 576, 576, rng), gguf_weight("q5_0", 192, 576, rng),
               gguf_weight("q8_0" if more else "q5_0", 192, 576, rng)]
        mats += [QuantLinear.of([conv(w) for w in qkv]), QuantLinear.of(conv(gguf_weight("q5_0", 576, 576, rng))),
                 QuantLinear.of([conv(gguf_weight("q5_0", 1536, 576, rng)) for _ in range(2)]),
                 QuantLinear.of(gguf_weight("q6_k" if more else "q4_k", 576, 1536, rng))]
    return mats + [QuantLinear.of(gguf_weight("q8_0", 49152, 576, rng))]


def distinct_passes(kinds: list[str], rows: int, repeats: int, bw: float) -> list[dict]:
    """One pass over each whole model with a distinct weight per matrix, the models interleaved."""
    models = {kind: model_mats(kind) for kind in kinds}
    g = torch.Generator().manual_seed(2)
    xs = {k: torch.randn(rows, k, generator=g) for k in (576, 1536)}

    def run(mats):
        for m in mats:
            m(xs[m.in_features])
    times = time_variants({kind: (lambda mats=mats: run(mats), 0) for kind, mats in models.items()}, repeats)
    out = []
    for kind, mats in models.items():
        nbytes = sum(m.weight_bytes() for m in mats)
        weights = sum(m.out_features * m.in_features for m in mats)
        med, best = times[kind]
        out.append({"shape": "model, distinct", "rows": rows, "variant": kind, "median_us": med * 1e6,
                    "us": best * 1e6, "bytes": nbytes, "bpw": nbytes * 8 / weights,
                    "limit_us": nbytes / bw / 1e3, "gbs": nbytes / best / 1e9, "speedup_vs_fp32": float("nan")})
    return out


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
    shape = rec["shape"] + (f" {rec['n']}x{rec['k']}" if "n" in rec and not rec["shape"].startswith("kq") else "")
    print(f"{shape:>18} {rec['rows']:>4} {rec['variant']:11} {rec['median_us']:9.1f} {rec['us']:9.1f} "
          f"{rec['bytes'] / 1e6:7.2f} {rec['bpw']:5.2f} {rec['limit_us']:9.1f} {rec['gbs']:6.1f} "
          f"{rec['speedup_vs_fp32']:7.2f}")


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
    print(f"{'shape':>18} {'rows':>4} {'variant':11} {'med us':>9} {'min us':>9} {'MB':>7} {'bpw':>5} "
          f"{'limit us':>9} {'GB/s':>6} {'vs fp32':>7}")
    for rows in args.rows:
        model = {}
        for name, (n, k) in {**SHAPES, **KQ_SHAPES}.items():
            kq = name in KQ_SHAPES
            fns = variants(n, k, rows, kq)
            times = time_variants(fns, args.repeats)
            for var, (med, t) in times.items():
                nbytes = fns[var][1]
                rec = {"shape": name, "n": n, "k": k, "rows": rows, "variant": var, "median_us": med * 1e6,
                       "us": t * 1e6, "bytes": nbytes, "bpw": nbytes * 8 / (n * k), "limit_us": nbytes / bw / 1e3,
                       "gbs": nbytes / t / 1e9,
                       "speedup_vs_fp32": float("nan") if kq else times["fp32"][1] / t}
                out["results"].append(rec)
                _row(rec)
                if not kq:
                    m = model.setdefault(var, [0.0, 0, 0.0, 0])
                    m[0] += PER_MODEL[name] * t
                    m[1] += PER_MODEL[name] * nbytes
                    m[2] += PER_MODEL[name] * med
                    m[3] += PER_MODEL[name] * n * k
        for var, (t, nbytes, med, weights) in model.items():
            rec = {"shape": "model pass", "rows": rows, "variant": var, "median_us": med * 1e6, "us": t * 1e6,
                   "bytes": nbytes, "bpw": nbytes * 8 / weights, "limit_us": nbytes / bw / 1e3,
                   "gbs": nbytes / t / 1e9, "speedup_vs_fp32": model["fp32"][0] / t}
            out["results"].append(rec)
            _row(rec)
        for rec in distinct_passes(["q4_1+q8_0", "q4_k_m", "q4_k_m-int8"], rows, args.repeats, bw):
            out["results"].append(rec)
            _row(rec)
    name = args.out or ("quant_matmul-t1.json" if args.threads == 1 else "quant_matmul.json")
    print("wrote", write_json(name, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
