"""Grouped MoE expert products against the per-expert loop, one Qwen3-30B-A3B layer (issue 44).

The layer: qwen3_moe.SparseMoE at Qwen3-30B-A3B's shape (hidden 2048, moe_intermediate 768,
128 experts, top-8, softmax routing renormalized over the top 8), random weights and inputs
(the router spreads tokens over the experts much as a trained one does on average). Per dtype
and tokens per step, the block's forward (router included) with the grouped products
(layers/grouped_experts.py: one C call, also where loomserve's fp32 dispatch would keep the
loop: FP32_LOOP_ROWS) and with the loop (one expert() call per routed expert), calls
interleaved, median of --repeats. Reported: ms, tokens/s, and the roofline:
the experts' weight bytes the step touches (distinct routed experts x 3 x hidden x inter) at
the measured read bandwidth (benchmarks/membw.py), or the FLOPs (2 x pairs x 3 x hidden x
inter) at a measured fp32 GEMM rate (torch.mm, 2048^3, best of 5), whichever takes longer.

    python benchmarks/moe_grouped.py [--dtypes bfloat16 float32] [--tokens 1 8 32 128 512]
        [--repeats 5] [--threads N (torch's default)] [--out moe_grouped.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.host import torch_threads  # noqa: E402
from common.results import write_json  # noqa: E402
from membw import measure_read_bandwidth  # noqa: E402

from loomserve.execution.layers import grouped_experts  # noqa: E402
from loomserve.execution.models.qwen3_moe import Qwen3MoeConfig, SparseMoE  # noqa: E402

# Qwen3-30B-A3B's config.json, the fields the MoE block reads (and the ones a config needs).
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "moe_intermediate_size": 768,
                 "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                 "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960}


def build(dtype: torch.dtype) -> SparseMoE:
    torch.manual_seed(0)
    block = SparseMoE(Qwen3MoeConfig.from_hf(QWEN3_30B_A3B))
    with torch.no_grad():
        for p in block.parameters():  # ~N(0, 0.02) as trained layers roughly are
            p.normal_(0, 0.02)
    return block.to(dtype).eval()


def gemm_gflops() -> float:
    """torch's fp32 GEMM rate here (2048^3, best of 5: a ceiling): the roofline's FLOP rate."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t0)
    return 2 * 2048 ** 3 / min(ts) / 1e9


def _call(block: SparseMoE, x: torch.Tensor, grouped: bool) -> float:
    """One forward, the kernel at every size (grouped; FP32_LOOP_ROWS lifted) or the loop."""
    rows = grouped_experts.FP32_LOOP_ROWS
    grouped_experts.USE, grouped_experts.FP32_LOOP_ROWS = grouped, 1 << 40
    try:
        t0 = time.perf_counter()
        block(x)
        return time.perf_counter() - t0
    finally:
        grouped_experts.USE, grouped_experts.FP32_LOOP_ROWS = True, rows


def step(block: SparseMoE, dtype: torch.dtype, tokens: int, repeats: int, read_gbs: float,
         gflops: float) -> dict:
    cfg_h, inter = block.experts.down_proj.shape[1], block.experts.inter
    x = torch.randn(tokens, cfg_h).to(dtype)
    with torch.no_grad():
        ids = torch.topk(block.gate(x).float(), block.top_k, dim=-1)[1]
        times = {"grouped": [], "loop": []}
        for v in times:  # warm-up (and the kernel's first build)
            _call(block, x, v == "grouped")
        for _ in range(repeats):
            for v in times:
                times[v].append(_call(block, x, v == "grouped"))
    experts = int(torch.unique(ids).numel())
    nbytes = experts * 3 * cfg_h * inter * block.experts.down_proj.element_size()
    flops = 2 * tokens * block.top_k * 3 * cfg_h * inter
    limit = max(nbytes / read_gbs / 1e9, flops / gflops / 1e9)
    ms = {v: statistics.median(t) * 1e3 for v, t in times.items()}
    return {"dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
            "experts_touched": experts, "weight_bytes": nbytes, "flops": flops,
            "ms": ms, "ms_all": {v: [round(s * 1e3, 3) for s in t] for v, t in times.items()},
            "tokens_per_s": {v: tokens / m * 1e3 for v, m in ms.items()},
            "gbs": {v: nbytes / m / 1e6 for v, m in ms.items()},
            "limit_ms": limit * 1e3,
            "limit_by": "bytes" if nbytes / read_gbs >= flops / gflops else "flops"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch and kernel threads")
    ap.add_argument("--out", default="moe_grouped.json")
    a = ap.parse_args()
    with torch_threads(a.threads):
        run(a)


def run(a: argparse.Namespace) -> None:
    if not grouped_experts.usable("swiglu", torch.empty(1, 16, 8), torch.empty(1, 8, 8)):
        sys.exit("the grouped kernel did not build (no C compiler?)")
    read_gbs, gflops = measure_read_bandwidth(), gemm_gflops()
    print(f"read {read_gbs:.1f} GB/s, fp32 GEMM {gflops:.0f} GFLOP/s, "
          f"threads {torch.get_num_threads()}")
    print("| dtype | tokens | experts | grouped ms (tok/s) | loop ms (tok/s) | limit ms |")
    print("|---|---|---|---|---|---|")
    results = []
    for dt in a.dtypes:
        block = build(getattr(torch, dt))
        for n in a.tokens:
            r = step(block, getattr(torch, dt), n, a.repeats, read_gbs, gflops)
            results.append(r)
            ms, tps = r["ms"], r["tokens_per_s"]
            print(f"| {dt} | {n} | {r['experts_touched']} | {ms['grouped']:.1f} "
                  f"({tps['grouped']:.0f}) | {ms['loop']:.1f} ({tps['loop']:.0f}) | "
                  f"{r['limit_ms']:.1f} ({r['limit_by']}) |", flush=True)
        del block
    path = write_json(a.out, {"layer": "Qwen3-30B-A3B MoE block (qwen3_moe.SparseMoE)",
                              "shape": {k: QWEN3_30B_A3B[k] for k in (
                                  "hidden_size", "moe_intermediate_size", "num_experts",
                                  "num_experts_per_tok")},
                              "read_gbs": read_gbs, "gemm_gflops": gflops,
                              "threads": torch.get_num_threads(), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
