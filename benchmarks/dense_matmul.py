"""Few-row dense products: the dense kernel (layers/dense.py) vs torch's CPU GEMMs (issue 12).

For each weight shape of a model (every linear layer once, plus its LM head), M rows of
activations times the weight, as one decode step of M sequences does; each figure the median
of --repeats calls, the variants interleaved call by call. Variants:
  kernel          DenseLinear: kernels/dense.c on the [out, in] weight (loomserve at <= DENSE_ROWS)
  torch           F.linear on the [out, in] weight (torch's default layout)
  torch-in-major  F.linear on an input-major copy (fp32 only: the layout loomserve used before)
Reported per model and dtype: the whole step's products in ms and GB/s of weights read, beside
the read bandwidth (benchmarks/membw.py, same host).

    python benchmarks/dense_matmul.py [--models default longctx] [--dtypes float32 bfloat16]
        [--rows 1 2 4 8 16 32 64] [--repeats 15] [--out benchmarks/results/dense_matmul.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.host import host_info  # noqa: E402
from common.results import write_json  # noqa: E402
from membw import measure_read_bandwidth  # noqa: E402

from loomserve.execution.layers import dense  # noqa: E402

# (out, in) of each distinct matrix, with how many times a step runs it.
SHAPES = {
    # SmolLM2-135M: 30 layers of q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536
    "default": [((576, 576), 60), ((192, 576), 60), ((1536, 576), 60), ((576, 1536), 30),
                ((49152, 576), 1)],
    # benchmarks/longctx/model.py: 2 layers, hidden 128, 4 x 32 heads over 1 x 32, mlp 512
    "longctx": [((128, 128), 4), ((32, 128), 4), ((512, 128), 4), ((128, 512), 2),
                ((49152, 128), 1)],
}


def _time(fns: dict, repeats: int) -> dict:
    """Median seconds per variant, calls interleaved so drift hits every variant alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def step(model: str, dtype: torch.dtype, rows: int, repeats: int) -> dict:
    """One decode step's products of `model` at `rows` rows, per variant (seconds)."""
    total = {}
    weight_bytes = 0
    for (n, k), count in SHAPES[model]:
        lin = nn.Linear(k, n, bias=False).to(dtype)
        w, layer = lin.weight, dense.DenseLinear(lin.weight, None, max_rows=1 << 30)
        x = torch.randn(rows, k).to(dtype)
        fns = {"kernel": lambda: layer.forward(x), "torch": lambda: F.linear(x, w)}
        if dtype == torch.float32:
            wi = w.t().contiguous().t()
            fns["torch-in-major"] = lambda: F.linear(x, wi)
        for name, sec in _time(fns, repeats).items():
            total[name] = total.get(name, 0.0) + sec * count
        weight_bytes += n * k * w.element_size() * count
    return {"model": model, "dtype": str(dtype).removeprefix("torch."), "rows": rows,
            "weight_bytes": weight_bytes, "ms": {k: v * 1e3 for k, v in total.items()},
            "gbs": {k: weight_bytes / v / 1e9 for k, v in total.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "dense_matmul.json"))
    a = ap.parse_args()
    if not dense.available():
        sys.exit("the dense kernel did not build (no C compiler?)")
    bw = measure_read_bandwidth()
    results = []
    print(f"read bandwidth {bw:.1f} GB/s; threads {torch.get_num_threads()}")
    print("| model | dtype | rows | kernel ms (GB/s) | torch ms (GB/s) | torch in-major ms |")
    print("|---|---|---|---|---|---|")
    for model in a.models:
        for dt in a.dtypes:
            for rows in a.rows:
                r = step(model, getattr(torch, dt), rows, a.repeats)
                results.append(r)
                ms, gbs = r["ms"], r["gbs"]
                im = f"{ms['torch-in-major']:.2f}" if "torch-in-major" in ms else "-"
                print(f"| {model} | {dt} | {rows} | {ms['kernel']:.2f} ({gbs['kernel']:.1f}) | "
                      f"{ms['torch']:.2f} ({gbs['torch']:.1f}) | {im} |", flush=True)
    write_json(a.out, {"host": host_info(), "read_gbs": bw, "threads": torch.get_num_threads(),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "results": results})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
