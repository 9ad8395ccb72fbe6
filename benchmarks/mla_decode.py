"""MLA decode attention, one layer: absorbed (the latent rows read once for all heads) vs
decompressed (every context row through kv_b_proj into per-head K and V, then attention), and
the cache bytes per token beside the MHA layout of the same model.

Shape: DeepSeek-V3's per-layer MLA dims (kv_lora_rank 512, rope 64, qk_nope 128, v 128, hidden
7168, q_lora_rank 1536) with 16 heads instead of 128 (a 2-core host), fp32, block 16, one
sequence. Limits printed beside each time: absorbed = max(latent bytes / read bandwidth,
FLOPs / matmul rate) with FLOPs = heads * ctx * 2 * (2 * rank + rope); decompressed adds the
up-projection, ctx * rank * heads * (nope + v) * 2 FLOPs.

    nice -n -15 python benchmarks/mla_decode.py [--repeats 5] [--threads 1] [--out benchmarks/results/mla_decode.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common.host import host_info  # noqa: E402
from benchmarks.common.results import write_json  # noqa: E402
from loomserve.execution.attention.metadata import PrefillChunk  # noqa: E402
from loomserve.execution.layers.attention import build_metadata  # noqa: E402
from loomserve.execution.layers.mla import MultiHeadLatentAttention  # noqa: E402
from loomserve.kv.spec import MLAAttentionSpec  # noqa: E402

BS, HEADS, RANK, ROPE, NOPE, V, HIDDEN, QR = 16, 16, 512, 64, 128, 128, 7168, 1536


def timed(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def limits() -> tuple[float, float]:
    x = torch.ones(256 << 20)
    bw = x.numel() * 4 / timed(lambda: x.sum(), 3)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return bw, 2 * 2048 ** 3 / timed(lambda: a @ b, 3)


def layer(ctx: int) -> tuple[MultiHeadLatentAttention, torch.Tensor]:
    torch.manual_seed(0)
    attn = MultiHeadLatentAttention(HIDDEN, HEADS, QR, RANK, NOPE, ROPE, V, False, (NOPE + ROPE) ** -0.5)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.02)
    blocks = (ctx + BS - 1) // BS
    attn.latent_cache = torch.randn(blocks, BS, RANK + ROPE)
    return attn, torch.arange(blocks)


def run(ctx: int, repeats: int, bw: float, rate: float, decompressed: bool) -> dict:
    attn, table = layer(ctx)
    q_nope, q_pe = torch.randn(1, HEADS, NOPE), torch.randn(1, HEADS, ROPE)
    meta, _ = build_metadata([(ctx - 1, table.tolist())], [], BS, torch.device("cpu"), backend="torch")
    absorbed = timed(lambda: attn._decode(q_nope, q_pe, meta), repeats)
    flops = HEADS * ctx * 2 * (2 * RANK + ROPE)
    row = {"context": ctx, "absorbed_ms": round(absorbed * 1e3, 3),
           "absorbed_limit_ms": round(max(ctx * (RANK + ROPE) * 4 / bw, flops / rate) * 1e3, 3)}
    if decompressed:
        chunk = PrefillChunk(0, 1, ctx - 1, table.numpy().astype("int32"))
        meta.prefills, meta.num_decode = [chunk], 0
        t = timed(lambda: attn._prefill(q_nope, q_pe, None, chunk, meta), repeats)
        up = ctx * RANK * HEADS * (NOPE + V) * 2
        row |= {"decompressed_ms": round(t * 1e3, 3), "decompressed_limit_ms": round((up + flops) / rate * 1e3, 3)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/mla_decode.json")
    ap.add_argument("--threads", type=int, default=1, help="1 on a shared 2-core host (spinning siblings)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bw, rate = limits()
    rows = [run(c, args.repeats, bw, rate, c <= 4096) for c in (1024, 4096, 16384)]
    spec = MLAAttentionSpec.for_latent(BS, RANK + ROPE, torch.bfloat16)
    ds_layers, ds_heads = 61, 128
    cache = {"deepseek_v3_bf16_mla_bytes_per_token": ds_layers * spec.bytes_per_block_per_layer() // BS,
             "deepseek_v3_bf16_mha_bytes_per_token": ds_layers * ds_heads * (NOPE + ROPE + V) * 2}
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv), "host": host_info(), "threads": torch.get_num_threads(),
           "read_bandwidth_gbs": round(bw / 1e9, 2), "matmul_gflops": round(rate / 1e9, 1),
           "shape": {"heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE, "nope": NOPE, "v": V, "dtype": "float32"},
           "decode_one_layer": rows, "cache": cache}
    print(json.dumps(res, indent=1))
    write_json(args.out, res)


if __name__ == "__main__":
    main()
