"""Weight layout vs matmul speed on the CPU: what loomserve.execution.models.loading.weight_layout chooses, and why.

For the default model's matrix shapes (SmolLM2-135M: per layer qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536, times 30 layers, plus the 49152x576 LM head), one pass of
F.linear over all 121 matrices at R rows (R = sequences decoding at once, or prefill tokens):

  fp32  default [out, in] storage   vs  input-major ([in, out] storage, same tensor values)
  bf16  default (oneDNN reorders the weight inside every call)  vs  weights packed once by
        torch.ops.mkldnn._reorder_linear_weight and run by _linear_pointwise

Median of --repeats passes, the two variants interleaved so machine noise hits both alike.
Beside each: GB/s of weight bytes streamed, next to the machine's read bandwidth
(benchmarks/membw.py), the roofline of a one-row pass.

Run:  python benchmarks/matmul_layout.py [--rows 1 8 32 256] [--repeats 9]
Output: a table, and benchmarks/results/matmul_layout.json.
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

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def _time(fns: dict, repeats: int) -> dict[str, float]:
    for f in fns.values():
        f()
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            runs[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in runs.items()}


def variants(dtype: torch.dtype, rows: int):
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g).to(dtype) for o, i in SHAPES]
    xs = {i: torch.randn(rows, i, generator=g).to(dtype) for _, i in SHAPES}
    default = lambda: [F.linear(xs[w.shape[1]], w) for w in ws]  # noqa: E731
    if dtype == torch.float32:
        alt = [w.t().contiguous().t() for w in ws]
        return {"default": default, "input-major": lambda: [F.linear(xs[w.shape[1]], w) for w in alt]}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws]
    run = torch.ops.mkldnn._linear_pointwise
    return {"default": default,
            "packed": lambda: [run(xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(ws, packed)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default="matmul_layout.json", help="result file")
    args = ap.parse_args(argv)
    from membw import measure_read_bandwidth
    bw = measure_read_bandwidth()
    out = {"host": host_info(), "read_gbs": bw, "threads": torch.get_num_threads(), "results": []}
    print(f"read bandwidth {bw:.1f} GB/s, {torch.get_num_threads()} threads")
    print(f"{'dtype':9} {'rows':>5} {'variant':12} {'ms':>8} {'GB/s':>6} {'speed-up':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        nbytes = sum(o * i for o, i in SHAPES) * dtype.itemsize
        for rows in args.rows:
            times = _time(variants(dtype, rows), args.repeats if rows < 256 else max(3, args.repeats // 3))
            base = times["default"]
            for name, t in times.items():
                rec = {"dtype": str(dtype).split(".")[-1], "rows": rows, "variant": name, "ms": t * 1e3,
                       "gbs": nbytes / t / 1e9, "speedup": base / t}
                out["results"].append(rec)
                print(f"{rec['dtype']:9} {rows:>5} {name:12} {rec['ms']:8.2f} {rec['gbs']:6.1f} {rec['speedup']:8.2f}")
    print("wrote", write_json(args.out, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
