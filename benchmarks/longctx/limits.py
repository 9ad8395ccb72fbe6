"""Physical limits beside the long-context figures: memory bandwidth and an fp32 matmul rate.

Decode at context n reads the whole KV cache once per token (n x 512 B here) plus the weights:
    KV limit ms/token      = n * KV bytes/token / read bandwidth
    KV+weights ms/token    = (n * KV bytes/token + weight bytes) / read bandwidth
A prefill of m new tokens over a cached prefix of p does, per layer and query head, a QK^T and a
PV product over every earlier position (causal):
    attention FLOPs = layers * heads * 2 (QK, PV) * 2 * head_dim * sum_{i<m} (p + i + 1)
plus the linear layers' 2 * (non-embedding parameters) per token; FLOP limit = FLOPs / the
measured fp32 torch.mm rate on this machine's threads.

Invariant: rates are measured on this host in this run (bandwidth via benchmarks/membw.py,
cached per host) and stored beside the limits they produce.
"""

from __future__ import annotations

import time

__all__ = ["matmul_gflops", "decode_limits_ms", "prefill_flops", "layer_params"]


def matmul_gflops(n: int = 2048, repeats: int = 7, threads: int | None = None) -> float:
    """Best fp32 torch.mm rate (GFLOP/s) over ``repeats`` n x n x n products."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def layer_params(cfg: dict) -> int:
    """Parameters of the linear layers one token passes through (no embedding, no LM head)."""
    h, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return cfg["num_hidden_layers"] * (h * q + 2 * h * kv + q * h + 3 * h * i)


def prefill_flops(cfg: dict, prefix: int, new: int) -> dict[str, float]:
    """FLOPs of prefilling ``new`` tokens over a cached ``prefix`` (last token's LM head only)."""
    positions = new * prefix + new * (new + 1) / 2  # sum of (p + i + 1) over the new tokens
    attn = (cfg["num_hidden_layers"] * cfg["num_attention_heads"] * 2 * 2 * cfg["head_dim"]
            * positions)
    linear = 2 * layer_params(cfg) * new + 2 * cfg["hidden_size"] * cfg["vocab_size"]
    return {"attention_flops": attn, "linear_flops": linear, "total_flops": attn + linear}


def decode_limits_ms(ctx: int, kv_bytes_per_token: int, weight_bytes: int,
                     read_gbs: float) -> dict[str, float]:
    kv = ctx * kv_bytes_per_token
    return {"kv_bytes": kv, "kv_limit_ms": 1e3 * kv / (read_gbs * 1e9),
            "kv_plus_weights_limit_ms": 1e3 * (kv + weight_bytes) / (read_gbs * 1e9)}
