"""The simulator's policies: one replay of a `Workload` at one capacity, and its `RunResult`.

* `lru`: every request goes, one at a time, through the real
  `loomserve.kv.cache_manager.KVCacheManager` (block pool, chained hashing, prefix lookup, LRU
  free queue in which a request's blocks are freed tail first). Per request:
  `get_computed_blocks` gives the hit, `allocate_slots` the rest; if the pool cannot hold the
  whole prompt, the hit is claimed and as much as fits is allocated (a truncated prefill, counted
  in `truncated_requests`: the cached part is the prefix that fit, as in kvcache-simulator).
  Then `free`. (With kvcache-sim semantics a request larger than the whole cache is truncated,
  takes no marker block, and the pool keeps capacity + 1 blocks.) Outputs are NOT appended
  unless `--append-outputs` (generated tokens differ from the recorded ones in a live replay,
  so their blocks could never be hit; the option models the cache space they take).
* `optimal`: Belady's offline optimum over blocks (loomserve.bench.belady) with capacity / B
  blocks after each request: an upper bound for any eviction policy at that capacity.
* `infinite`: unlimited capacity = the theoretical hit rate.

Invariants: requests never overlap (a request's blocks are all held while it runs and freed
before the next); manager CPU time is process time around get_computed_blocks + allocate_slots
+ free (hashing included, prompt synthesis not); at 100% of the working set LRU can stay a
little below infinite (the running request's blocks must fit beside the cache).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

from loomserve.bench.belady import belady_hits, infinite_hits
from loomserve.bench.miss_gap import attribute_gap
from loomserve.bench.simulate.workload import Workload, _KVReq

__all__ = ["POLICIES", "PERCENTILES", "RunResult", "run_lru", "run_optimal", "run_infinite",
           "run_policy"]

POLICIES = ("lru", "optimal", "infinite")
PERCENTILES = (10, 25, 50, 75, 90)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class RunResult:
    policy: str
    capacity_tokens: int | None       # None for infinite
    num_blocks: int | None            # pool blocks (lru) / cache blocks (optimal)
    hit_tokens: int = 0
    counted_tokens: int = 0
    request_hit_rates: list[float] = field(default_factory=list)  # measured requests
    cpu_ns: list[int] = field(default_factory=list)               # lru: every request
    wall_s: float = 0.0
    num_requests: int = 0
    truncated_requests: int = 0
    evictions: int | None = None
    filled_before_window: bool | None = None
    capacity_fraction: float | None = None
    # lru with the infinite cache's keys at hand: the gap to it by miss cause
    # (loomserve.bench.miss_gap), and the attribution's CPU per measured request
    miss_gap: dict | None = None
    attribution_ns: list[int] = field(default_factory=list)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.counted_tokens if self.counted_tokens else 0.0

    def to_dict(self) -> dict:
        rates = np.asarray(self.request_hit_rates, dtype=np.float64)
        per_req = {"n": int(rates.size), "mean": float(rates.mean()) if rates.size else None}
        for q, v in zip(PERCENTILES, np.percentile(rates, PERCENTILES) if rates.size
                        else [None] * len(PERCENTILES)):
            per_req[f"p{q}"] = None if v is None else float(v)
        d = {"policy": self.policy, "capacity_tokens": self.capacity_tokens,
             "capacity_fraction": self.capacity_fraction, "num_blocks": self.num_blocks,
             "token_hit_rate": self.token_hit_rate, "hit_tokens": self.hit_tokens,
             "counted_tokens": self.counted_tokens, "measured_requests": int(rates.size),
             "per_request_hit_rate": per_req, "requests": self.num_requests,
             "wall_s": self.wall_s,
             "requests_per_s": self.num_requests / self.wall_s if self.wall_s > 0 else None}
        if self.cpu_ns:
            c = np.asarray(self.cpu_ns, dtype=np.float64) / 1e3
            d["manager_cpu_us"] = {"median": float(np.median(c)),
                                   "p99": float(np.percentile(c, 99)), "mean": float(c.mean())}
        if self.miss_gap is not None:
            d["miss_gap"] = self.miss_gap
        if self.attribution_ns:
            a = np.asarray(self.attribution_ns, dtype=np.float64) / 1e3
            d["attribution_cpu_us"] = {"median": float(np.median(a)),
                                       "p99": float(np.percentile(a, 99)),
                                       "mean": float(a.mean())}
        if self.policy == "lru":
            d["truncated_requests"] = self.truncated_requests
            d["evictions"] = self.evictions
            d["filled_before_window"] = self.filled_before_window
        return d


def _make_manager(num_blocks: int, block_size: int, num_agents: int):
    import torch

    from loomserve.kv.cache_manager import KVCacheManager
    from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
    # Token-level spec: the bytes per block never matter here.
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_dim=1,
                             dtype=torch.float16)
    config = KVCacheConfig(num_blocks=num_blocks, groups=(KVCacheGroup(spec, (0,)),))
    kv = KVCacheManager(config, max_sessions=max(1024, 2 * num_agents))
    kv.hasher.max_memo_tokens = 1 << 62  # keep every agent's chain: hash only new suffixes
    return kv


def _allocate(kv, req: _KVReq, n_new: int, hit=None, n_hit: int = 0) -> bool:
    """allocate_slots for n_new tokens; if the pool is too small, claim the hit and allocate
    what fits. Returns False when the request was truncated."""
    if kv.allocate_slots(req, n_new, hit, n_hit):
        return True
    if n_hit:
        if not kv.allocate_slots(req, 0, hit, n_hit):  # cannot fail: hit blocks are in the pool
            raise RuntimeError("claiming a prefix hit failed")
        req.num_computed_tokens += n_hit
    fit = min(n_new, kv.num_free_blocks * kv.block_size)
    if fit > 0 and not kv.allocate_slots(req, fit):
        raise RuntimeError("allocation of the free blocks failed")
    return False


def _counted_causes(causes: dict[str, int], excess: int) -> dict[str, int]:
    """causes less the `excess` prompt tokens beyond the counted ones (a trailing marker
    token: partial_block first)."""
    out = dict(causes)
    for c in ("partial_block", "first_sight", *sorted(out)):
        take = min(out.get(c, 0), excess)
        if take:
            out[c] -= take
            excess -= take
    return {k: v for k, v in out.items() if v > 0}


def run_lru(w: Workload, capacity_tokens: int, progress: bool = False,
            attribute: bool = False) -> RunResult:
    """Replay w through loomserve's KVCacheManager with capacity_tokens of KV. attribute:
    also split each measured request's misses by cause (kv.miss_causes, not timed as manager
    CPU) and attribute the gap to the infinite cache (res.miss_gap)."""
    bs = w.block_size
    cache_blocks = capacity_tokens // bs
    if cache_blocks < 1:
        raise ValueError(f"capacity {capacity_tokens} tokens is less than one block of {bs}")
    num_blocks = cache_blocks + (1 if w.kvsim else 0)
    kv = _make_manager(num_blocks, bs, w.num_agents)
    pool = kv.pool
    res = RunResult("lru", capacity_tokens, num_blocks, num_requests=len(w))
    cpu = [0] * len(w)
    rates = res.request_hit_rates
    clock = time.process_time_ns
    hit_tokens = counted = truncated = 0
    filled = False
    full_at = num_blocks - (1 if w.kvsim else 0)
    inf = infinite_hits(w.keys, w.caps) if attribute else None
    gap_items: list[tuple[int, int, int, dict]] = []
    attr_ns = res.attribution_ns
    start = time.perf_counter()
    last_log = start
    for r in w.requests:
        toks = w.tokens(r)
        req = _KVReq(str(r.index), toks, r.salt, f"{r.trace}\x00{r.agent}")
        n = len(toks)
        t0 = clock()
        hit, n_hit = kv.get_computed_blocks(req)
        if not _allocate(kv, req, n - n_hit, hit, n_hit):
            truncated += 1
        elif w.append_outputs and r.out_tokens:
            req.num_computed_tokens = n
            toks.extend(w.output_tokens(r))  # append-only, as KVRequest requires
            if not _allocate(kv, req, r.out_tokens):
                truncated += 1
        if inf is not None and r.measured:
            ta = clock()
            miss = kv.explain_miss(req, n_hit)
            t_attr = clock() - ta
            attr_ns.append(t_attr)
            t0 += t_attr
            c = r.counted_tokens
            gap_items.append((c, min(n_hit, c), min(inf[r.index] * bs, c),
                              _counted_causes(miss.causes, n - c) if n > c else miss.causes))
        kv.free(req)
        cpu[r.index] = clock() - t0
        if r.measured:
            h = min(n_hit, r.counted_tokens)
            hit_tokens += h
            counted += r.counted_tokens
            rates.append(h / r.counted_tokens if r.counted_tokens else 0.0)
        elif not filled:
            filled = pool.eviction_epoch > 0 or len(pool.cached[0]) >= full_at
        if progress and time.perf_counter() - last_log > 5:
            last_log = time.perf_counter()
            _log(f"  lru {capacity_tokens} tokens: {r.index + 1}/{len(w)} requests")
    res.wall_s = time.perf_counter() - start
    res.hit_tokens, res.counted_tokens, res.truncated_requests = hit_tokens, counted, truncated
    res.cpu_ns = cpu
    res.evictions = pool.eviction_epoch
    res.filled_before_window = filled if w.warmup_requests else None
    if inf is not None:
        res.miss_gap = attribute_gap(gap_items)
    return res


def _block_result(w: Workload, policy: str, capacity_tokens: int | None,
                  num_blocks: int | None, hits: list[int], wall_s: float) -> RunResult:
    bs = w.block_size
    res = RunResult(policy, capacity_tokens, num_blocks, num_requests=len(w), wall_s=wall_s)
    for r, h in zip(w.requests, hits):
        if r.measured:
            ht = min(h * bs, r.counted_tokens)
            res.hit_tokens += ht
            res.counted_tokens += r.counted_tokens
            res.request_hit_rates.append(ht / r.counted_tokens if r.counted_tokens else 0.0)
    return res


def run_optimal(w: Workload, capacity_tokens: int) -> RunResult:
    """Belady's offline optimum over blocks at capacity_tokens."""
    nus = w.next_uses  # shared across capacities; not timed
    start = time.perf_counter()
    cap = capacity_tokens // w.block_size
    hits = belady_hits(w.keys, w.caps, cap, nus)
    return _block_result(w, "optimal", capacity_tokens, cap, hits, time.perf_counter() - start)


def run_infinite(w: Workload) -> RunResult:
    keys, caps = w.keys, w.caps
    start = time.perf_counter()
    hits = infinite_hits(keys, caps)
    return _block_result(w, "infinite", None, None, hits, time.perf_counter() - start)


def run_policy(w: Workload, policy: str, capacity_tokens: int | None,
               progress: bool = False, attribute: bool = False) -> RunResult:
    if policy == "lru":
        return run_lru(w, capacity_tokens, progress, attribute)  # type: ignore[arg-type]
    if policy == "optimal":
        return run_optimal(w, capacity_tokens)  # type: ignore[arg-type]
    if policy == "infinite":
        return run_infinite(w)
    raise ValueError(f"unknown policy {policy!r}")
