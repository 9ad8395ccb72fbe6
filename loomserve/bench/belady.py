"""Block-level cache models for the simulator: the infinite cache and Belady's offline optimum.

Both work on a request stream given as, per request, the list of its full blocks' keys (ints,
in chain order: key i stands for the whole prefix up to block i, so a key always sits at the
same depth) and a hit cap (how many leading blocks may count as a hit; loomserve caps a hit at
prompt length - 1, i.e. (n - 1) // block_size blocks). A request's hit is the longest run of its
leading keys, within the cap, that the cache holds before the request; afterwards every key of
the request is offered to the cache.

Belady (MIN with bypass), per request: hits as above, then the cache keeps, out of what it held
plus the request's keys, the `capacity` blocks whose next *counted* use (the next request that
holds the key within its cap) comes soonest; ties go to the shallower block, keys never used
again are dropped. Why this is the optimum for the simulator's hit-rate model:

* Count model: score every counted position whose key is cached, prefix or not. After each
  request any subset of size <= capacity of (cache + request keys) may be kept; with unit
  weights, the classic exchange argument for MIN applies unchanged (swap a kept key x for a
  dropped y with next(y) <= next(x) and follow the old schedule with y in x's slot), so
  keeping the soonest-needed keys maximises the count.
* Prefix model (what is scored): never more than the count model for any schedule. Keys are
  chained, so a parent is counted in every request that counts its child: next(parent) <=
  next(child), and the depth tie-break keeps parents first, so Belady's cache is always
  prefix closed on every request's counted keys and its prefix score equals its count score.
  Hence Belady's prefix score is the maximum over all schedules.
* LRU through loomserve's pool is one such schedule (its cache after a request is a subset of
  size <= capacity of the same candidates), so Belady >= LRU, request by request in total.

All weights are one block here; the simulator multiplies by the block size.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from itertools import repeat, takewhile

__all__ = ["infinite_hits", "next_uses", "belady_hits"]


def infinite_hits(keys: list[list[int]], caps: list[int]) -> list[int]:
    """Hit blocks per request with an unlimited cache (the theoretical hit)."""
    seen: set[int] = set()
    contains = seen.__contains__
    update = seen.update
    out = []
    append = out.append
    for ks, cap in zip(keys, caps):
        append(sum(1 for _ in takewhile(contains, ks[:cap])))
        update(ks)
    return out


def next_uses(keys: list[list[int]], caps: list[int], never: int | None = None) -> list[list[int]]:
    """For every (request r, position i): the index of the next request after r that counts
    keys[r][i] (holds it within its cap), or `never` (default len(keys)) if none does."""
    if never is None:
        never = len(keys)
    nxt: dict[int, int] = {}
    get = nxt.get
    out: list[list[int]] = [None] * len(keys)  # type: ignore[list-item]
    for r in range(len(keys) - 1, -1, -1):
        ks = keys[r]
        out[r] = list(map(get, ks, repeat(never, len(ks))))
        nxt.update(zip(ks[:caps[r]], repeat(r)))
    return out


def belady_hits(keys: list[list[int]], caps: list[int], capacity: int,
                nus: list[list[int]] | None = None) -> list[int]:
    """Hit blocks per request under Belady's MIN with bypass, `capacity` blocks (see module doc).
    `nus` is next_uses(keys, caps) (computed if not given; pass it to reuse across capacities)."""
    n_req = len(keys)
    if nus is None:
        nus = next_uses(keys, caps, n_req)
    never = n_req
    if capacity <= 0:
        return [0] * n_req
    depth_span = max((len(ks) for ks in keys), default=0) + 1
    cache: dict[int, int] = {}  # key -> priority = next_use * depth_span + depth
    contains = cache.__contains__
    heap: list[tuple[int, int]] = []  # (-priority, key): max-heap, lazy deletion
    out = []
    for ks, cap, nu in zip(keys, caps, nus):
        out.append(sum(1 for _ in takewhile(contains, ks[:cap])))
        for d, (k, u) in enumerate(zip(ks, nu)):
            if u >= never:
                cache.pop(k, None)  # never needed again; its heap entries go stale
                continue
            p = u * depth_span + d
            if cache.get(k) != p:
                cache[k] = p
                heappush(heap, (-p, k))
        while len(cache) > capacity:
            negp, k = heappop(heap)
            if cache.get(k) == -negp:
                del cache[k]
        if len(heap) > 4 * len(cache) + 4096:  # drop stale entries
            heap = [(-p, k) for k, p in cache.items()]
            heapify(heap)
    return out
