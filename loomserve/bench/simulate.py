"""`loomserve bench simulate`: replay traces through loomserve's own KV cache manager, offline.

    loomserve bench simulate TRACE_OR_DIR... --capacity-tokens N [--block-size B]
        [--policy lru|optimal|infinite[,...]] [--sweep [FRACTIONS] | --sweep-capacities LIST]
        [--semantics loomserve|kvcache-sim] [--stagger S] [--append-outputs] [--plot PNG] [--json]

No model runs: every request of every trace goes, one at a time, through the real
`loomserve.kv.cache_manager.KVCacheManager` (block pool, chained hashing, prefix lookup, LRU free
queue) sized to a capacity in tokens, and the simulator counts prefix-hit tokens.

Replay order. All requests of all traces are merged in time order: a request's replay time is
its session time (`TraceRequest.t`, subagents already normalised by the parser) plus its
session's offset, which is 0 for every trace (all start together) unless `--stagger S` starts
trace i at i*S seconds. Ties go to the earlier trace on the command line, then to the trace's
own order (`Session.all_requests()`). Requests run strictly one after another (no overlap): a
request's blocks are all held while it runs and freed before the next one starts.

Prompt synthesis. Each trace hash id (one per `block_size`-token block of the trace, chained)
becomes a fixed run of token ids: the trace block with id h is `block_size` copies of a small
int interned for (scope, h), so two prompts share exactly as many leading tokens as their
leading hash ids agree. The trace's tail past its last full block (`in` - 64 * len(hash_ids))
is filled with a marker unique to the request, so it never hits. The simulator block size B
(`--block-size`, default: the traces' block size) need not match the trace's 64: a trace block
then covers 64/B simulator blocks (or B/64 trace blocks make one), and loomserve's chained
hashes over the synthesized tokens reproduce the recorded sharing at that granularity. Each
trace is its own cache scope: its requests carry `cache_salt` = the trace id (a
`hash_id_scope` of "global" on the session, if the parser ever exposes one, drops the salt).
The hasher's per-session memo is keyed by (trace, agent), so a new turn hashes only its suffix.

Per request (LRU): `get_computed_blocks` gives the hit; `allocate_slots` for the rest. If the
pool cannot hold the whole prompt (prompt larger than the free + evictable blocks), the hit is
claimed and as much of the prompt as fits is allocated (a truncated prefill, counted in
`truncated_requests`): the cached part is the prefix that fit, as in kvcache-simulator.
Then `free`. Outputs are NOT appended by default: the next turn's hash ids already contain this
turn's output as it was recorded, and in a live replay the generated tokens differ from the
recorded ones, so their blocks could never be hit; `--append-outputs` allocates `out` extra
tokens (unique filler) before the free, to model the cache space those blocks take.

Semantics (`--semantics`):
* `loomserve` (default): denominator = the request's `in` tokens; hit = loomserve's prefix hit
  (whole blocks, capped at `in` - 1 tokens so the last token is computed); every request counts.
* `kvcache-sim`: KVCache.AI kvcache-simulator's accounting. The prompt is only the trace's full
  blocks (64 * len(hash_ids) tokens, the tail past them is not part of the request) and is the
  denominator; the hit is the longest continuously cached prefix with no "- 1" cap (the
  synthesized prompt gets one extra marker token so loomserve's cap lands after the last full
  block; that token's block is never hashed, and the pool gets one extra block for it, so the
  cached blocks still number capacity / B); only the last 50% of requests are measured
  (`--warmup-fraction`, default 0.5 here and 0 for loomserve); `filled_before_window` says
  whether the cache filled (first eviction) before the window -- kvcache-simulator omits points
  where it did not. (A request larger than the whole cache is the one case where the extra
  block shows: it is truncated, takes no marker block, and the pool keeps capacity + 1 blocks.)
  benchmarks/simulator_check.py runs kvcache-simulator itself on the same traces: LRU hit
  tokens agree exactly.
  What stays loomserve's own is the eviction order: a free queue in which a request's blocks
  are freed tail first (so a chain is evicted leaf first, a shared head last), against
  kvcache-simulator's prefix trie evicting its least recently touched leaf.

Policies:
* `lru`: the manager as described (its free queue is LRU over whole requests, tail first).
* `optimal`: Belady's offline optimum over blocks (loomserve.bench.belady), its own small cache
  model on block keys, same hit semantics; an upper bound for any eviction policy at that
  capacity (cache of capacity / B blocks after each request; it needs no room for the running
  request, which only helps it).
* `infinite`: unlimited capacity = the theoretical hit rate (per trace, count leading blocks
  already seen, within the same cap).
Block keys for `optimal`/`infinite` come from loomserve's own BlockHasher over the same
synthesized prompts, so all three policies see the identical blocks.

Working set = unique cacheable blocks (full blocks of all prompts) * B. `--sweep` runs the
capacities at the given fractions of it (default 0.1, 0.2, ..., 1.0) with lru, optimal and
infinite (or `--policy`'s list) and prints the hit-rate-vs-capacity table (`--plot` draws it).
At 100% LRU can stay a little below infinite: the running request's partial block and a
request's own blocks must fit beside the cache.

Reported per run: token_hit_rate (hit tokens / denominator tokens over measured requests),
per-request hit-rate percentiles, for lru the manager's CPU time per request (process CPU time
around get_computed_blocks + allocate_slots + free, hashing included, prompt synthesis not) as
median / p99 / mean in microseconds, and requests/s (all requests / wall time of the run).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from itertools import chain, count, repeat

import numpy as np

from loomserve.bench.belady import belady_hits, infinite_hits, next_uses
from loomserve.bench.trace import Session, TraceError, load_traces

__all__ = ["SEMANTICS", "POLICIES", "Workload", "RunResult", "run_lru", "run_optimal",
           "run_infinite", "run_policy", "simulate", "add_arguments", "main"]

SEMANTICS = ("loomserve", "kvcache-sim")
POLICIES = ("lru", "optimal", "infinite")
DEFAULT_SWEEP = tuple(round(0.1 * i, 1) for i in range(1, 11))
PERCENTILES = (10, 25, 50, 75, 90)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class SimRequest:
    index: int              # position in the merged replay order
    trace: str              # session id
    agent: str              # "main" or the subagent's agent_id
    t: float                # replay time: session time + the session's offset
    in_tokens: int
    out_tokens: int
    block_tids: tuple[int, ...]  # interned trace blocks (token id of each trace block)
    trace_block_size: int
    salt: str | None        # cache scope
    num_tokens: int         # length of the synthesized prompt
    counted_tokens: int     # hit-rate denominator
    measured: bool


class _KVReq:
    """Satisfies loomserve.kv.cache_manager.KVRequest."""

    __slots__ = ("request_id", "all_token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "cache_salt", "session_id", "block_hashes")

    def __init__(self, request_id: str, tokens: list[int], salt: str | None,
                 session_id: str | None) -> None:
        self.request_id = request_id
        self.all_token_ids = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.cache_salt = salt
        self.session_id = session_id
        self.block_hashes: list[bytes] = []


class Workload:
    """The merged request stream of a set of sessions, with prompt synthesis and block keys."""

    def __init__(self, sessions: list[Session], *, block_size: int | None = None,
                 semantics: str = "loomserve", stagger_s: float = 0.0,
                 append_outputs: bool = False, warmup_fraction: float | None = None) -> None:
        if semantics not in SEMANTICS:
            raise ValueError(f"unknown semantics {semantics!r}")
        if not sessions:
            raise ValueError("no sessions")
        self.semantics = semantics
        self.kvsim = semantics == "kvcache-sim"
        self.block_size = int(block_size or sessions[0].block_size)
        if self.block_size < 1:
            raise ValueError("block size must be >= 1")
        self.stagger_s = float(stagger_s)
        self.append_outputs = append_outputs
        if warmup_fraction is None:
            warmup_fraction = 0.5 if self.kvsim else 0.0
        if not 0.0 <= warmup_fraction < 1.0:
            raise ValueError("warmup fraction must be in [0, 1)")
        self.warmup_fraction = warmup_fraction
        self.num_traces = len(sessions)
        tids: dict[tuple[str | None, int], int] = {}
        raw = []
        for i, s in enumerate(sessions):
            scope = getattr(s, "hash_id_scope", "local")
            salt = None if scope == "global" else s.id
            offset = i * self.stagger_s
            for k, r in enumerate(s.all_requests()):
                bt = tuple(tids.setdefault((salt, h), len(tids) + 1) for h in r.hash_ids)
                raw.append((r.t + offset, i, k, s, r, bt, salt))
        raw.sort(key=lambda x: (x[0], x[1], x[2]))
        self.num_trace_blocks = len(tids)
        n = len(raw)
        self.warmup_requests = math.floor(n * warmup_fraction)
        reqs = []
        for idx, (t, _i, _k, s, r, bt, salt) in enumerate(raw):
            full = len(bt) * s.block_size
            if self.kvsim:
                num_tokens, counted = full + 1, full
            else:
                num_tokens = counted = r.in_tokens
            reqs.append(SimRequest(idx, s.id, r.agent, t, r.in_tokens, r.out_tokens, bt,
                                   s.block_size, salt, num_tokens, counted,
                                   idx >= self.warmup_requests))
        self.requests: list[SimRequest] = reqs
        self.num_agents = len({(r.trace, r.agent) for r in reqs})
        self._keys: list[list[int]] | None = None
        self._last_tokens: dict[tuple[str, str], tuple[tuple[int, ...], list[int]]] = {}
        self._caps: list[int] | None = None
        self._nus: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def tokens(self, r: SimRequest) -> list[int]:
        """The synthesized prompt of a request (a fresh list). The previous prompt of the same
        agent is reused for the leading trace blocks the two share (a slice copy is cheaper
        than rebuilding)."""
        tb = r.trace_block_size
        bt = r.block_tids
        agent = (r.trace, r.agent)
        prev = self._last_tokens.get(agent)
        toks = None
        if prev is not None:
            pbt, ptoks = prev
            m = len(pbt)
            if m <= len(bt) and bt[:m] == pbt and m * tb <= len(ptoks):
                toks = ptoks[:m * tb]
                toks.extend(chain.from_iterable(map(repeat, bt[m:], repeat(tb, len(bt) - m))))
        if toks is None:
            toks = list(chain.from_iterable(map(repeat, bt, repeat(tb, len(bt)))))
        self._last_tokens[agent] = (bt, toks)
        n = r.num_tokens
        if len(toks) > n:
            del toks[n:]
        elif len(toks) < n:
            toks.extend(repeat(-1 - r.index, n - len(toks)))  # unique to the request
        return toks

    def output_tokens(self, r: SimRequest) -> list[int]:
        return [-1 - len(self.requests) - r.index] * r.out_tokens

    # -- block keys (for optimal / infinite / the working set) ------------------------------
    def _compute_keys(self) -> None:
        from loomserve.kv.hashing import BlockHasher
        bs = self.block_size
        hasher = BlockHasher(bs, max_sessions=max(1024, 2 * self.num_agents),
                             max_memo_tokens=1 << 62)
        intern: dict[bytes, int] = {}
        setdefault = intern.setdefault
        fresh = count()  # a new key's id: unique, not dense (only equality matters)
        keys, caps = [], []
        for r in self.requests:
            req = _KVReq("", self.tokens(r), r.salt, f"{r.trace}\x00{r.agent}")
            hashes = hasher.ensure(req)
            hasher.remember(req)
            keys.append(list(map(setdefault, hashes, fresh)))
            caps.append((r.num_tokens - 1) // bs)
        self._keys, self._caps = keys, caps

    @property
    def keys(self) -> list[list[int]]:
        """Per request, interned keys of its full blocks (loomserve's chained hashes)."""
        if self._keys is None:
            self._compute_keys()
        return self._keys  # type: ignore[return-value]

    @property
    def caps(self) -> list[int]:
        """Per request, the most leading blocks a hit may cover."""
        if self._caps is None:
            self._compute_keys()
        return self._caps  # type: ignore[return-value]

    @property
    def next_uses(self) -> list[list[int]]:
        if self._nus is None:
            self._nus = next_uses(self.keys, self.caps)
        return self._nus

    @property
    def unique_blocks(self) -> int:
        return len({k for ks in self.keys for k in ks})

    @property
    def working_set_tokens(self) -> int:
        return self.unique_blocks * self.block_size


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


def run_lru(w: Workload, capacity_tokens: int, progress: bool = False) -> RunResult:
    """Replay w through loomserve's KVCacheManager with capacity_tokens of KV."""
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
               progress: bool = False) -> RunResult:
    if policy == "lru":
        return run_lru(w, capacity_tokens, progress)  # type: ignore[arg-type]
    if policy == "optimal":
        return run_optimal(w, capacity_tokens)  # type: ignore[arg-type]
    if policy == "infinite":
        return run_infinite(w)
    raise ValueError(f"unknown policy {policy!r}")


def simulate(w: Workload, policies: list[str], capacities: list[int] | None = None,
             fractions: list[float] | None = None, progress: bool = False) -> dict:
    """Run policies at capacities (tokens) or at fractions of the working set; returns the
    JSON-ready result (runs, and a curve when more than one capacity)."""
    info: dict = {"command": "simulate", "traces": w.num_traces, "requests": len(w),
                  "semantics": w.semantics, "block_size": w.block_size,
                  "stagger_s": w.stagger_s, "append_outputs": w.append_outputs,
                  "warmup_requests": w.warmup_requests, "policies": list(policies)}
    need_keys = fractions is not None or "optimal" in policies or "infinite" in policies
    if need_keys:
        t = time.perf_counter()
        info["unique_blocks"] = w.unique_blocks
        info["working_set_tokens"] = w.working_set_tokens
        if progress:
            _log(f"block keys: {info['unique_blocks']} unique blocks "
                 f"({time.perf_counter() - t:.1f} s)")
    points: list[tuple[int, float | None]] = []
    if fractions is not None:
        ws = info["working_set_tokens"]
        points = [(max(w.block_size, int(round(f * ws / w.block_size)) * w.block_size), f)
                  for f in fractions]
    elif capacities:
        points = [(c, None) for c in capacities]
    runs: list[RunResult] = []
    inf = None
    if "infinite" in policies:
        inf = run_infinite(w)
        runs.append(inf)
    bounded = [p for p in policies if p != "infinite"]
    if bounded and not points:
        raise ValueError("lru and optimal need a capacity (--capacity-tokens or a sweep)")
    for cap, frac in points:
        for p in bounded:
            r = run_policy(w, p, cap, progress)
            if frac is None and "working_set_tokens" in info and info["working_set_tokens"]:
                frac = cap / info["working_set_tokens"]
            r.capacity_fraction = frac
            runs.append(r)
            if progress:
                _log(f"{p:8} capacity {cap:>11,} tokens: hit rate {r.token_hit_rate:.4f} "
                     f"({r.wall_s:.1f} s)")
    info["runs"] = [r.to_dict() for r in runs]
    if len(points) > 1 or (points and inf is not None):
        curve = []
        for cap, _frac in points:
            row = {"capacity_tokens": cap}
            for r in runs:
                if r.capacity_tokens == cap:
                    row["capacity_fraction"] = r.capacity_fraction
                    row[r.policy] = r.token_hit_rate
            if inf is not None:
                row["infinite"] = inf.token_hit_rate
            curve.append(row)
        info["curve"] = curve
    return info


# -- output ---------------------------------------------------------------------------------

def format_result(res: dict) -> str:
    lines = [f"simulate: {res['traces']} traces, {res['requests']} requests, block "
             f"{res['block_size']} tokens, semantics {res['semantics']}"
             + (f", measured from request {res['warmup_requests']}"
                if res["warmup_requests"] else "")]
    if "working_set_tokens" in res:
        lines.append(f"working set    {res['working_set_tokens']:,} tokens "
                     f"({res['unique_blocks']:,} blocks)")
    if "curve" in res:
        pols = [p for p in ("lru", "optimal", "infinite") if p in res["policies"]]
        lines.append("")
        lines.append(f"{'capacity tokens':>16} {'of WS':>6} " + " ".join(f"{p:>9}" for p in pols))
        for row in res["curve"]:
            frac = row.get("capacity_fraction")
            lines.append(f"{row['capacity_tokens']:>16,} "
                         + (f"{frac:>6.0%} " if frac is not None else f"{'':>6} ")
                         + " ".join(f"{row[p]:>9.4f}" if p in row else f"{'-':>9}"
                                    for p in pols))
        lines.append("")
    for run in res["runs"]:
        cap = run["capacity_tokens"]
        pr = run["per_request_hit_rate"]
        head = (f"{run['policy']:8} " + (f"capacity {cap:,} tokens" if cap is not None
                                         else "unlimited capacity"))
        lines.append(f"{head}: token hit rate {run['token_hit_rate']:.4f}")
        if pr["n"]:
            lines.append("    per-request hit rate " + " ".join(
                f"p{q} {pr[f'p{q}']:.3f}" for q in PERCENTILES) + f" mean {pr['mean']:.3f}")
        if "manager_cpu_us" in run:
            c = run["manager_cpu_us"]
            lines.append(f"    manager CPU per request: median {c['median']:.0f} us, "
                         f"p99 {c['p99']:.0f} us, mean {c['mean']:.0f} us; "
                         f"{run['requests_per_s']:.0f} requests/s; "
                         f"{run['truncated_requests']} truncated, {run['evictions']:,} evictions"
                         + ("" if run["filled_before_window"] is None else
                            f", filled before window: {run['filled_before_window']}"))
    return "\n".join(lines)


def plot_curve(res: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib not installed: no plot")
        return False
    curve = res.get("curve") or []
    if not curve:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    use_frac = all(r.get("capacity_fraction") is not None for r in curve)
    xs = [r["capacity_fraction"] * 100 if use_frac else r["capacity_tokens"] for r in curve]
    labels = {"infinite": "infinite (theoretical)", "optimal": "Belady (offline optimum)",
              "lru": "LRU (loomserve KVCacheManager)"}
    for p, style in (("infinite", "k--"), ("optimal", "g-o"), ("lru", "b-o")):
        if any(p in r for r in curve):
            ax.plot(xs, [r.get(p) for r in curve], style, label=labels[p], markersize=4)
    ax.set_xlabel("capacity, % of working set" if use_frac else "capacity, tokens")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"{res['traces']} traces, {res['requests']} requests, "
                 f"semantics {res['semantics']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- CLI ------------------------------------------------------------------------------------

def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(float(x)) for x in s.split(",") if x.strip()]


def add_arguments(p) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE_OR_DIR",
                   help="Weka-format trace files or directories of *.json")
    p.add_argument("--capacity-tokens", type=int, help="KV capacity in tokens")
    p.add_argument("--block-size", type=int, default=None,
                   help="simulator KV block size in tokens (default: the traces' own)")
    p.add_argument("--policy", default=None,
                   help="lru, optimal, infinite or a comma list (default: lru; for a sweep "
                        "lru,optimal,infinite)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--sweep", nargs="?", const=",".join(map(str, DEFAULT_SWEEP)),
                   metavar="FRACTIONS",
                   help="capacities as fractions of the working set (unique blocks * block "
                        "size), comma separated (default 0.1,0.2,...,1.0)")
    g.add_argument("--sweep-capacities", metavar="LIST",
                   help="capacities in tokens, comma separated")
    p.add_argument("--semantics", choices=SEMANTICS, default="loomserve",
                   help="hit accounting: loomserve's or kvcache-simulator's (last 50%% of "
                        "requests, full trace blocks only, no last-token cap)")
    p.add_argument("--warmup-fraction", type=float, default=None,
                   help="leading fraction of requests not measured (default 0, 0.5 for "
                        "kvcache-sim semantics)")
    p.add_argument("--stagger", type=float, default=0.0, metavar="SECONDS",
                   help="start trace i at i*SECONDS (default 0: all traces start together)")
    p.add_argument("--append-outputs", action="store_true",
                   help="also allocate each request's output tokens before freeing it")
    p.add_argument("--plot", metavar="PNG", help="draw the sweep's hit-rate curve (matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def main(args) -> int:
    policies = [x.strip() for x in (args.policy or "").split(",") if x.strip()]
    sweeping = args.sweep is not None or args.sweep_capacities is not None
    if not policies:
        policies = list(POLICIES) if sweeping else ["lru"]
    bad = [x for x in policies if x not in POLICIES]
    if bad:
        print(f"error: unknown policy {bad[0]!r} (choose from {', '.join(POLICIES)})",
              file=sys.stderr)
        return 2
    fractions = capacities = None
    try:
        if args.sweep is not None:
            fractions = _floats(args.sweep)
            if not fractions or any(not 0 < f for f in fractions):
                raise ValueError("--sweep fractions must be > 0")
        elif args.sweep_capacities is not None:
            capacities = _ints(args.sweep_capacities)
        elif args.capacity_tokens is not None:
            capacities = [args.capacity_tokens]
        elif policies != ["infinite"]:
            raise ValueError("give --capacity-tokens, --sweep or --sweep-capacities")
        if capacities is not None and any(c < 1 for c in capacities):
            raise ValueError("capacities must be positive")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        t = time.perf_counter()
        sessions = load_traces(args.traces)
        w = Workload(sessions, block_size=args.block_size, semantics=args.semantics,
                     stagger_s=args.stagger, append_outputs=args.append_outputs,
                     warmup_fraction=args.warmup_fraction)
        _log(f"loaded {len(sessions)} traces, {len(w)} requests "
             f"({time.perf_counter() - t:.1f} s)")
        res = simulate(w, policies, capacities=capacities, fractions=fractions, progress=True)
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        if plot_curve(res, args.plot):
            res["plot"] = args.plot
            _log(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(res))
    else:
        print(format_result(res))
    return 0
