"""Tensor parallelism for the Llama family (Llama, Mistral, Qwen2, Qwen3) and Gemma 3: how a
model is built, split and loaded on one rank of N (gpt-oss, Qwen3-Next, Nemotron-H, DeepSeek-V3:
tp_families.py).

Rank r of N builds the single-rank model from a per-rank config (num_heads/N query heads, its
KV heads, intermediate/N MLP columns, a vocabulary slice of ceil(V/N) rows), swaps o_proj and
down_proj for RowParallelLinear and the embedding for VocabParallelEmbedding, and loads only its
slices of each checkpoint tensor, so it holds 1/N of the weights (norms are replicated).
KV heads: with num_kv_heads >= N each rank owns num_kv_heads/N of them; with fewer (GQA with
N > num_kv_heads) each rank holds the one KV head its query heads read, replicated N/kv times.
So a rank's KV page is 1/N of the single-rank page (1/kv when replicated), every rank plans the
same number of blocks from the same budget, and the driver's block ids mean the same
everywhere. Other model classes (a registered plugin) and quantized weights are refused at
N > 1 with a clear error.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

import torch

from loomserve.execution.layers.parallel_linear import (
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_per_rank,
)
from loomserve.execution.parallel import tp_families
from loomserve.execution.parallel.state import TPGroup

# The Llama class serves Llama, Mistral, Qwen2 and Qwen3; Gemma 3 is the same split (its extra
# norms are replicated, its soft-cap applies after the logits are gathered).
SUPPORTED = {"LlamaForCausalLM": "loomserve.execution.models.llama",
             "Gemma3ForCausalLM": "loomserve.execution.models.gemma3"}
SUPPORTED_NAMES = ("the Llama family (Llama, Mistral, Qwen2, Qwen3), Gemma 3, gpt-oss, Qwen3-Next, "
                   "Nemotron-H and DeepSeek-V3")


def check_supported(model_cls: type, cfg, size: int, quantization: str) -> None:
    """Raise a clear error for what this rank split cannot serve."""
    fam = tp_families.family(model_cls)
    if fam is None and SUPPORTED.get(model_cls.__name__) != model_cls.__module__:
        raise NotImplementedError(
            f"tensor parallelism supports {SUPPORTED_NAMES} so far, "
            f"not {model_cls.__name__}: serve it with --tensor-parallel-size 1")
    if quantization != "none":
        raise NotImplementedError(f"--quantization {quantization} with --tensor-parallel-size "
                                  f"{size} is not supported yet")
    if fam is not None:
        return tp_families.check(fam, cfg, size)
    h, kv = cfg.num_heads, cfg.num_kv_heads
    if h % size or cfg.intermediate_size % size or (kv % size and size % kv):
        raise ValueError(f"tensor_parallel_size={size} must divide num_heads={h} and "
                         f"intermediate_size={cfg.intermediate_size}, and divide or be a "
                         f"multiple of num_kv_heads={kv}")


def preflight(config) -> None:
    """check_supported from the checkpoint's config.json alone, before any process starts."""
    import json
    import os

    from loomserve.execution.models.loading.loader import resolve_model
    from loomserve.execution.models.registry import resolve
    mcfg = config.model
    folder, _ = resolve_model(mcfg.model, mcfg.resolved_cache_dir)
    with open(os.path.join(folder, "config.json")) as f:
        model_cls, cfg = resolve(json.load(f))
    check_supported(model_cls, cfg, config.parallel.tensor_parallel_size, mcfg.quantization)


def kv_heads_of(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """(first KV head, count) rank `rank` holds."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, per
    return rank // (size // num_kv_heads), 1


def shard_config(cfg, tp: TPGroup):
    """The config a rank builds its slice of the model from."""
    fam = tp_families.family_of_cfg(cfg)
    if fam is not None:
        return tp_families.shard_config(fam, cfg, tp)
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // tp.size,
        num_kv_heads=kv_heads_of(tp.rank, tp.size, cfg.num_kv_heads)[1],
        intermediate_size=cfg.intermediate_size // tp.size,
        vocab_size=vocab_per_rank(cfg.vocab_size, tp.size))


def parallelize(model: torch.nn.Module, cfg, tp: TPGroup) -> None:
    """Swap in the communicating layers (on the meta device, before the weights load)."""
    fam = tp_families.family(type(model))
    if fam is not None:
        return tp_families.parallelize(fam, model, cfg, tp)
    inner = model.model
    for layer in inner.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, tp)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, tp)
    inner.embed_tokens = VocabParallelEmbedding(vocab_per_rank(cfg.vocab_size, tp.size),
                                                cfg.hidden_size, cfg.vocab_size, tp)
    model.tp = tp


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], cfg, tp: TPGroup
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named full tensors -> the same names with this rank's slices (the names the
    parallelized model's load_weights expects: RowParallelLinear's inner `.linear.`)."""
    fam = tp_families.family_of_cfg(cfg)
    if fam is not None:
        yield from tp_families.shard_weights(fam, weights, cfg, tp)
        return
    r, n, d = tp.rank, tp.size, cfg.head_dim
    heads = cfg.num_heads // n
    kv_first, kv_count = kv_heads_of(r, n, cfg.num_kv_heads)
    inter = cfg.intermediate_size // n
    vocab = vocab_per_rank(cfg.vocab_size, n)
    for name, t in weights:
        leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        if leaf == "q_proj":
            t = t.narrow(0, r * heads * d, heads * d)
        elif leaf in ("k_proj", "v_proj"):
            t = t.narrow(0, kv_first * d, kv_count * d)
        elif leaf in ("gate_proj", "up_proj"):
            t = t.narrow(0, r * inter, inter)
        elif leaf == "o_proj":
            t = t.narrow(1, r * heads * d, heads * d)
            name = name.replace(".o_proj.", ".o_proj.linear.")
        elif leaf == "down_proj":
            t = t.narrow(1, r * inter, inter)
            name = name.replace(".down_proj.", ".down_proj.linear.")
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = _vocab_rows(t, r * vocab, vocab)
        yield name, t.contiguous()


def _vocab_rows(t: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of t, zero rows past its end (the padding of the last rank)."""
    out = torch.zeros(rows, *t.shape[1:], dtype=t.dtype)
    got = t[start:start + rows]
    out[:got.shape[0]] = got
    return out
