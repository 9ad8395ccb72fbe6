"""DeepSeek Sparse Attention decode, one layer: the lightning indexer's pass plus MLA over the
top-k (index_topk 2048) latent rows, against dense (absorbed) MLA over the whole context, at
8K, 32K and 128K context.

Shape: DeepSeek-V3.2's per-layer dims (hidden 7168, q_lora_rank 1536, kv_lora_rank 512, rope
64, qk_nope 128, v 128; indexer 64 heads of 128) with 16 MLA heads instead of 128 (a 2-core
host; the indexer keeps its real 64 heads), fp32, block 16, one sequence. The paged caches
(latent rows and indexer keys, in their own pools as the two KV groups are) are filled with
random rows directly rather than by prefilling 128K tokens; the block table is scattered over
the pool. Times: median of --repeats (min kept too: the host is shared). Each part's roofline beside it: bytes it reads per step / read bandwidth (measured,
and at the host's nominal 30 GB/s), with the matmul limit where compute dominates:
  indexer   ctx * index_head_dim * 4 bytes (keys), FLOPs ctx * index_heads * index_head_dim * 2
  sparse    topk * (kv_lora_rank + rope) * 4 bytes, FLOPs heads * topk * 2 * (2 rank + rope)
  dense     ctx  * (kv_lora_rank + rope) * 4 bytes, FLOPs heads * ctx  * 2 * (2 rank + rope)

    nice -n -15 python benchmarks/sparse_mla_decode.py [--repeats 5] [--threads 1]
        [--out benchmarks/results/sparse_mla_decode.json]
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
from loomserve.execution.layers.attention import build_metadata  # noqa: E402
from loomserve.execution.layers.sparse_mla import SparseLatentAttention, select_decode  # noqa: E402

BS, HEADS, RANK, ROPE, NOPE, V, HIDDEN, QR = 16, 16, 512, 64, 128, 128, 7168, 1536
IDX_HEADS, IDX_DIM, TOPK = 64, 128, 2048
CONTEXTS = (8192, 32768, 131072)
NOMINAL_BW = 30e9


def timed(fn, repeats: int) -> float:
    return statistics.median(samples(fn, repeats))


def samples(fn, repeats: int) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def limits() -> tuple[float, float]:
    x = torch.ones(256 << 20)
    bw = x.numel() * 4 / timed(lambda: x.sum(), 3)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return bw, 2 * 2048 ** 3 / timed(lambda: a @ b, 3)


def layer(ctx: int):
    """The layer with random weights, its two caches filled with random rows, and the metadata
    of one decode at position ctx - 1 (the same scattered table for both pools)."""
    g = torch.Generator().manual_seed(0)
    attn = SparseLatentAttention(HIDDEN, HEADS, QR, RANK, NOPE, ROPE, V, False,
                                 (NOPE + ROPE) ** -0.5, IDX_HEADS, IDX_DIM, TOPK)
    for p in attn.parameters():
        p.data.normal_(0, 0.02, generator=g)
    blocks = (ctx + BS - 1) // BS
    attn.latent_cache = torch.randn(blocks + 8, BS, RANK + ROPE, generator=g)
    attn.indexer.key_cache = torch.randn(blocks + 8, BS, IDX_DIM, generator=g)
    table = (torch.randperm(blocks + 8, generator=g)[:blocks]).numpy().astype("int32")
    meta = [build_metadata([(ctx - 1, table)], [], BS, torch.device("cpu"), torch.float32,
                           backend="torch")[0] for _ in range(2)]
    return attn, meta


def run(ctx: int, repeats: int, bw: float, rate: float) -> dict:
    attn, (lat, idx) = layer(ctx)
    g = torch.Generator().manual_seed(1)
    q_nope, q_pe = torch.randn(1, HEADS, NOPE, generator=g), torch.randn(1, HEADS, ROPE, generator=g)
    iq, iw = torch.randn(1, IDX_HEADS, IDX_DIM, generator=g), torch.randn(1, IDX_HEADS, generator=g)
    slots, valid = select_decode(attn.indexer, iq, iw, lat, idx)
    assert slots.shape == (1, TOPK) and bool(valid.all())
    for m in (lat, idx):  # time every step's work, not a cached table
        m.derived.clear()
    got = {"indexer": samples(lambda: (idx.derived.clear(), lat.derived.clear(),
                                       select_decode(attn.indexer, iq, iw, lat, idx)), repeats),
           "sparse_attention": samples(lambda: attn._sparse_decode(q_nope, q_pe, slots, valid,
                                                                   False), repeats),
           "dense_mla": samples(lambda: (lat.derived.clear(), attn._decode(q_nope, q_pe, lat)),
                                repeats)}
    indexer, sparse, dense = (statistics.median(got[k]) for k in got)
    row_bytes = (RANK + ROPE) * 4
    parts = {"indexer": (ctx * IDX_DIM * 4, ctx * IDX_HEADS * IDX_DIM * 2),
             "sparse_attention": (TOPK * row_bytes, HEADS * TOPK * 2 * (2 * RANK + ROPE)),
             "dense_mla": (ctx * row_bytes, HEADS * ctx * 2 * (2 * RANK + ROPE))}
    row = {"context": ctx, "indexer_ms": indexer * 1e3, "sparse_attention_ms": sparse * 1e3,
           "sparse_total_ms": (indexer + sparse) * 1e3, "dense_mla_ms": dense * 1e3}
    for name, (nbytes, flops) in parts.items():
        row[f"{name}_min_ms"] = min(got[name]) * 1e3
        row[f"{name}_bytes"] = nbytes
        row[f"{name}_limit_ms"] = max(nbytes / bw, flops / rate) * 1e3
        row[f"{name}_roofline_30gbs_ms"] = nbytes / NOMINAL_BW * 1e3
    row["sparse_total_min_ms"] = row["indexer_min_ms"] + row["sparse_attention_min_ms"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/sparse_mla_decode.json")
    ap.add_argument("--threads", type=int, default=1, help="1 on a shared 2-core host (spinning siblings)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bw, rate = limits()
    rows = [run(c, args.repeats, bw, rate) for c in CONTEXTS]
    first, last = rows[0], rows[-1]
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join(sys.argv), "host": host_info(), "threads": torch.get_num_threads(),
           "read_bandwidth_gbs": round(bw / 1e9, 2), "nominal_bandwidth_gbs": NOMINAL_BW / 1e9,
           "matmul_gflops": round(rate / 1e9, 1),
           "shape": {"heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE, "nope": NOPE, "v": V,
                     "hidden": HIDDEN, "q_lora_rank": QR, "index_heads": IDX_HEADS,
                     "index_head_dim": IDX_DIM, "index_topk": TOPK, "dtype": "float32",
                     "block_size": BS, "note": "16 of DeepSeek-V3.2's 128 MLA heads; caches "
                     "filled with random rows, not prefilled"},
           "decode_one_layer": rows,
           "growth_8k_to_128k": {"context": last["context"] / first["context"],
                                 "sparse_attention": round(last["sparse_attention_ms"] / first["sparse_attention_ms"], 2),
                                 "indexer": round(last["indexer_ms"] / first["indexer_ms"], 2),
                                 "dense_mla": round(last["dense_mla_ms"] / first["dense_mla_ms"], 2)}}
    print(json.dumps(res, indent=1))
    write_json(args.out, res)


if __name__ == "__main__":
    main()
