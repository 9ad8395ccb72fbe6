"""KV planning: which layers share a KV group, and how many blocks the pool gets.

Layers with equal KV specs form a group, ordered full attention, then sliding window, then
linear state (within a kind, by first layer). Every page is as large as the largest group's
block; the pool is as many pages as the budget holds. Under decode context parallelism
(plan_context_parallel) a rank's page holds block_size / D tokens of each block.

Hybrid models (attention + linear-state layers): a state page holds whole recurrent states, an
attention page block_size tokens, so at real dimensions one is hundreds of times the other.
`size_pages` picks a larger block size and splits the state layers into groups of a few layers
so that both pages hold about the same bytes (docs/design/kv-cache.md, "Page sizing").
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from loomserve.config import DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_KV_FRACTION, MemoryBudget
from loomserve.config.cache import DEFAULT_HYBRID_MAX_BLOCK
from loomserve.kv.spec import (
    FullAttentionSpec,
    IndexerKeySpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    LinearStateSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

_KIND_ORDER = {"full_attention": 0, "sliding_window": 1, "linear_state": 2}


def group_layers(specs: list[KVCacheSpec | None],
                 state_layers: int | None = None) -> tuple[KVCacheGroup, ...]:
    """Layers with equal specs -> one group each; full attention, then sliding, then state.

    Every page is as large as the largest group's block, so attention groups with more layers
    than others are split into groups of the smallest attention group's layer count: Gemma 3's
    five sliding layers per full one would otherwise leave 4/5 of every full-attention page
    empty. Splitting costs a block per token in each extra group, no extra bytes.
    state_layers: split linear-state groups into groups of this many layers (size_pages)."""
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
        if state_layers is not None and isinstance(spec, LinearStateSpec):
            step = state_layers
        groups += [KVCacheGroup(spec, tuple(ids[i:i + step])) for i in range(0, len(ids), step)]
    return tuple(groups)


# The most tokens size_pages lets a hybrid model's block grow to by default (the config's
# max_hybrid_block_size): prefix hits and state checkpoints land on block boundaries, so a hit
# recomputes on average half a block more.
HYBRID_MAX_BLOCK_TOKENS = DEFAULT_HYBRID_MAX_BLOCK
# The share of every page's bytes in use size_pages aims for before it settles for more groups.
PAGE_USE_GOAL = 0.9


@dataclass(frozen=True)
class PageSizing:
    """What size_pages chose: the block size every group uses, and how many linear-state layers
    share a group (None: one group per state spec, as group_layers does by default)."""

    block_size: int
    state_layers: int | None = None
    page_use: float = 1.0  # the smallest share of a page's bytes any group uses


def page_use(groups: tuple[KVCacheGroup, ...]) -> float:
    """The smallest share of a page's bytes that any group's block fills."""
    page = max(g.bytes_per_block() for g in groups)
    return min(g.bytes_per_block() for g in groups) / page


def size_pages(specs: list[KVCacheSpec | None], block_size: int,
               max_block_tokens: int = HYBRID_MAX_BLOCK_TOKENS) -> PageSizing:
    """The block size and state-group size that let attention and state pages hold the same
    bytes (specs: one per layer at `block_size`, the configured block size).

    The block size stays a multiple of `block_size`, never below it nor above
    `max_block_tokens`. Candidates: every number of state layers per group dividing each state
    group's layer count (groups of equal pages), with the multiples of `block_size` just below
    and above the size where one attention block's bytes equal one state group's. Chosen: the
    fewest state groups with every page at least PAGE_USE_GOAL in use (then the fullest pages);
    failing that, the fullest pages. Models without both kinds, a limit below two blocks, or no
    candidate fuller than today's pages: `block_size` and one group per spec."""
    base = group_layers(specs)
    old = PageSizing(block_size, None, page_use(base))
    attn = [g for g in base if isinstance(g.spec, FullAttentionSpec)]
    state = [g for g in base if isinstance(g.spec, LinearStateSpec)]
    if not attn or not state or max_block_tokens < 2 * block_size:
        return old
    top = max_block_tokens // block_size  # the most blocks of block_size one block may span
    counts = [len(g.layer_ids) for g in state]
    common = math.gcd(*counts)
    cands: list[PageSizing] = []
    for n in (d for d in range(1, common + 1) if common % d == 0):
        groups = group_layers(specs, n)
        state_bytes = max(g.bytes_per_block() for g in groups if isinstance(g.spec, LinearStateSpec))
        per_block = max(g.bytes_per_block() for g in groups if isinstance(g.spec, FullAttentionSpec))
        k = max(1, state_bytes // per_block)  # blocks of block_size per attention block
        for m in sorted({min(k, top), min(k + 1, top)}):
            size = m * block_size
            use = page_use(group_layers(_at_block_size(specs, size), n))
            cands.append(PageSizing(size, n, use))
    good = [c for c in cands if c.page_use >= PAGE_USE_GOAL]
    if good:
        best = max(good, key=lambda c: (c.state_layers, c.page_use, -c.block_size))
    else:
        best = max(cands, key=lambda c: (c.page_use, -c.block_size))
    if best.page_use <= old.page_use:  # e.g. a state smaller than one attention block
        return old
    if best.state_layers == common and len(set(counts)) == 1:
        best = dataclasses.replace(best, state_layers=None)  # the groups are the default ones
    return best


def _at_block_size(specs: list[KVCacheSpec | None], size: int) -> list[KVCacheSpec | None]:
    return [None if s is None else dataclasses.replace(s, block_size=size) for s in specs]


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
                  budget_bytes: int, state_layers: int | None = None) -> KVCacheConfig:
    """The pool's groups and block count for one spec per layer (None: a layer without KV).
    state_layers: linear-state layers per group (size_pages); None: one group per spec."""
    groups = group_layers(specs, state_layers)
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
                                                   IndexerKeySpec, SlidingWindowSpec,
                                                   LinearStateSpec):
            raise NotImplementedError(f"decode context parallelism supports attention, MLA "
                                      f"and linear-state layers only so far, not {spec.kind} "
                                      f"({type(spec).__name__})")
    local = plan_kv_cache(local_specs, block_size // dcp, budget_bytes)
    groups = tuple(KVCacheGroup(dataclasses.replace(g.spec, block_size=block_size), g.layer_ids)
                   for g in local.groups)
    return local, KVCacheConfig(local.num_blocks, groups)
