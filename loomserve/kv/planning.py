"""KV planning: which layers share a KV group, and how many blocks the pool gets.

Layers with equal KV specs form a group, ordered full attention, then sliding window, then
linear state (within a kind, by first layer). Every page is as large as the largest group's
block; the pool is as many pages as the budget holds. Under decode context parallelism
(plan_context_parallel) a rank's page holds block_size / D tokens of each block.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from loomserve.config import DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_KV_FRACTION, MemoryBudget
from loomserve.kv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    LinearStateSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

_KIND_ORDER = {"full_attention": 0, "sliding_window": 1, "linear_state": 2}


def group_layers(specs: list[KVCacheSpec | None]) -> tuple[KVCacheGroup, ...]:
    """Layers with equal specs -> one group each; full attention, then sliding, then state.

    Every page is as large as the largest group's block, so attention groups with more layers
    than others are split into groups of the smallest attention group's layer count: Gemma 3's
    five sliding layers per full one would otherwise leave 4/5 of every full-attention page
    empty. Splitting costs a block per token in each extra group, no extra bytes."""
    layers: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec is not None:
            layers.setdefault(spec, []).append(i)
    if not layers:
        raise ValueError("the model declares no KV cache layers")
    order = sorted(layers, key=lambda s: (_KIND_ORDER.get(s.kind, 3), layers[s][0]))
    attn = [len(layers[s]) for s in order if isinstance(s, FullAttentionSpec)]
    size = min(attn) if len(attn) > 1 else None
    groups = []
    for spec in order:
        ids = layers[spec]
        step = size if size is not None and isinstance(spec, FullAttentionSpec) else len(ids)
        groups += [KVCacheGroup(spec, tuple(ids[i:i + step])) for i in range(0, len(ids), step)]
    return tuple(groups)


def kv_budget_bytes(budget: MemoryBudget | None, device: torch.device) -> int:
    """Bytes for the pool: as given, or a fraction of the memory left after the weights (GPU)
    or of physical memory (CPU); without a budget, 1 GiB on a CPU and 85% on a GPU."""
    cuda = device.type == "cuda"
    if budget is None:
        if not cuda:
            return DEFAULT_CPU_KV_BYTES
        budget = MemoryBudget(fraction=DEFAULT_GPU_KV_FRACTION)
    if budget.bytes is not None:
        return budget.bytes
    if cuda:
        free, _ = torch.cuda.mem_get_info(device)  # measured after the weights are in
        return budget.resolve(free)
    return budget.resolve(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan_kv_cache(specs: list[KVCacheSpec | None], block_size: int,
                  budget_bytes: int) -> KVCacheConfig:
    """The pool's groups and block count for one spec per layer (None: a layer without KV)."""
    groups = group_layers(specs)
    for grp in groups:
        if grp.spec.block_size != block_size:
            raise ValueError(f"layer spec {grp.spec} has block_size != {block_size}")
        if isinstance(grp.spec, SlidingWindowSpec) and grp.spec.sliding_window < 1:
            raise ValueError(f"sliding-window spec without a window: {grp.spec}")
    num_blocks = KVCacheConfig.num_blocks_for(budget_bytes, groups)
    if num_blocks < 1:
        raise ValueError("kv-cache-memory is too small to hold one block")
    return KVCacheConfig(num_blocks, groups)


def plan_context_parallel(local_specs: list[KVCacheSpec | None], block_size: int, dcp: int,
                          budget_bytes: int) -> tuple[KVCacheConfig, KVCacheConfig]:
    """(this rank's pool, the scheduler's view) under decode context parallelism of size dcp.
    local_specs: the model's specs at block_size // dcp tokens per page, what a rank stores of
    each block; the pool gets as many pages as the budget holds. The scheduler's view is the
    same block count with block_size-token blocks (hashing, hits and tiers unchanged), so its
    capacity_tokens is dcp x what one rank stores."""
    for spec in local_specs:
        if spec is not None and type(spec) not in (FullAttentionSpec, MLAAttentionSpec,
                                                   SlidingWindowSpec, LinearStateSpec):
            raise NotImplementedError(f"decode context parallelism supports attention, MLA "
                                      f"and linear-state layers only so far, not {spec.kind} "
                                      f"({type(spec).__name__})")
    local = plan_kv_cache(local_specs, block_size // dcp, budget_bytes)
    groups = tuple(KVCacheGroup(dataclasses.replace(g.spec, block_size=block_size), g.layer_ids)
                   for g in local.groups)
    return local, KVCacheConfig(local.num_blocks, groups)
