"""`loomserve bench simulate` against brute-force models on small random traces.

* LRU through loomserve's KVCacheManager == an independent LRU over block keys in plain Python
  (OrderedDict as the recency list), under both hit semantics, token for token;
* infinite == the theoretical hit (count leading blocks already seen, per trace scope), and
  == LRU with a pool too big to evict;
* Belady >= LRU, Belady == exhaustive search over every cache schedule on tiny cases;
* hit rate is monotone in capacity for LRU (a stack algorithm), Belady and infinite.

The command line is tested in test_simulate_cli.py.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from itertools import combinations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from loomserve.bench.belady import belady_hits, infinite_hits, next_uses
from loomserve.bench.simulate import Workload, run_infinite, run_lru, run_optimal
from loomserve.bench.trace import Session, TraceRequest

FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- random traces ----------------------------------------------------------------------------

@st.composite
def sessions_st(draw, max_sessions: int = 3, max_requests: int = 8, max_new: int = 5):
    """Sessions with chained, locally scoped hash ids (every session counts from 1, so only the
    per-trace salt keeps them apart): a request continues or branches off an earlier one of
    the session (keeps a prefix of its ids) and appends fresh ids, plus a partial tail."""
    tb = draw(st.sampled_from([2, 4]))
    out = []
    for s in range(draw(st.integers(1, max_sessions))):
        next_id = 1
        earlier: list[list[int]] = []
        reqs = []
        t = 0.0
        for _ in range(draw(st.integers(1, max_requests))):
            ids: list[int] = []
            if earlier and draw(st.integers(0, 3)):
                base = draw(st.sampled_from(earlier))
                ids = list(base[:draw(st.integers(0, len(base)))])
            add = draw(st.integers(0, max_new))
            ids += range(next_id, next_id + add)
            next_id += add
            tail = draw(st.integers(0, tb - 1))
            in_tokens = max(1, len(ids) * tb + tail)
            t += draw(st.sampled_from([0.0, 0.5, 2.0]))
            reqs.append(TraceRequest(t=t, in_tokens=in_tokens,
                                     out_tokens=draw(st.integers(0, 2 * tb)),
                                     hash_ids=tuple(ids),
                                     agent=draw(st.sampled_from(["main", "main", "sub"]))))
            earlier.append(ids)
        out.append(Session(id=f"trace{s}", path="", block_size=tb, models=[], main=reqs,
                           groups=[]))
    return out


def workload(sessions, draw_bs: int = 0, **kw) -> Workload:
    tb = sessions[0].block_size
    bs = {0: tb, 1: max(1, tb // 2), 2: 2 * tb}[draw_bs]
    return Workload(sessions, block_size=bs, **kw)


# -- independent models -----------------------------------------------------------------------

def prefix_keys(w: Workload, r, toks: list[int]) -> list[tuple]:
    """A block's identity: its cache scope and every token up to its end."""
    bs = w.block_size
    return [(r.salt, tuple(toks[:(i + 1) * bs])) for i in range(len(toks) // bs)]


def reference_lru(w: Workload, num_blocks: int) -> tuple[int, int]:
    """(hit tokens, counted tokens) of an LRU cache of num_blocks blocks, one request at a time:
    the hit is the longest cached prefix within (n - 1) // bs blocks; the request then needs
    ceil(n / bs) blocks at once (its hit blocks plus new ones, taken from unused blocks first,
    then least recently used cached ones; if they do not all fit it gets what is there and
    caches only that prefix); it offers each full block to the cache once, when it is
    computed (a key already cached elsewhere keeps that copy, in place, and the new block
    stays unhashed even if that copy is evicted later, as the manager does); when it ends
    its blocks become free tail first, so its head ends up most recent. With append_outputs
    it then grows by its output tokens the same way."""
    bs = w.block_size
    cache: OrderedDict[tuple, None] = OrderedDict()  # cached free blocks, LRU first
    unused = num_blocks  # free blocks holding nothing
    hit_tokens = counted = 0
    for r in w.requests:
        toks = w.tokens(r)
        n = len(toks)
        keys = prefix_keys(w, r, toks)
        h = 0
        while h < (n - 1) // bs and keys[h] in cache:
            h += 1
        for k in keys[:h]:
            del cache[k]
        held: list[tuple | None] = list(keys[:h])  # the request's blocks; None = unhashed
        done = h  # full blocks already offered to the cache (a duplicate stays unhashed)

        def grow(base: int, target: int) -> bool:
            """Cover `target` tokens (base already computed); False if truncated."""
            nonlocal unused, done
            want = -(-target // bs) - len(held)
            room = unused + len(cache)
            covered = target if want <= room else base + min(target - base, room * bs)
            take = -(-covered // bs) - len(held)
            from_unused = min(unused, take)
            unused -= from_unused
            for _ in range(take - from_unused):
                cache.popitem(last=False)
            held.extend([None] * take)
            all_keys = prefix_keys(w, r, toks)
            full = min(covered, len(toks)) // bs
            for i in range(done, full):
                if held[i] is None and all_keys[i] not in cache and all_keys[i] not in held:
                    held[i] = all_keys[i]
            done = max(done, full)
            return want <= room

        ok = grow(h * bs, n)
        if ok and w.append_outputs and r.out_tokens:
            toks = toks + w.output_tokens(r)
            grow(n, len(toks))
        for b in reversed(held):
            if b is None:
                unused += 1
            else:
                cache[b] = None
        if r.measured:
            hit_tokens += min(h * bs, r.counted_tokens)
            counted += r.counted_tokens
    return hit_tokens, counted


def reference_infinite(w: Workload) -> int:
    """Theoretical hit: leading blocks (within the cap) already seen in the same scope."""
    bs = w.block_size
    seen: set[tuple] = set()
    total = 0
    for r in w.requests:
        toks = w.tokens(r)
        keys = prefix_keys(w, r, toks)
        h = 0
        while h < (len(toks) - 1) // bs and keys[h] in seen:
            h += 1
        seen.update(keys)
        if r.measured:
            total += min(h * bs, r.counted_tokens)
    return total


def brute_force_best(keys: list[list[int]], caps: list[int], capacity: int) -> int:
    """Most hit blocks over every schedule: after each request keep any `capacity` blocks of
    (cache + the request's blocks) (keeping more never hurts, so exactly that many)."""
    @lru_cache(maxsize=None)
    def best(i: int, cache: frozenset) -> int:
        if i == len(keys):
            return 0
        ks = keys[i]
        h = 0
        while h < caps[i] and ks[h] in cache:
            h += 1
        cands = sorted(cache | set(ks))
        keep = min(capacity, len(cands))
        return h + max(best(i + 1, frozenset(c)) for c in combinations(cands, keep))
    return best(0, frozenset())


# -- LRU: manager vs reference ----------------------------------------------------------------

@FAST
@given(sessions_st(), st.integers(1, 24), st.integers(0, 2),
       st.sampled_from(["loomserve", "kvcache-sim"]), st.booleans())
def test_lru_manager_matches_reference(sessions, blocks, draw_bs, semantics, outputs):
    w = workload(sessions, draw_bs, semantics=semantics, append_outputs=outputs)
    res = run_lru(w, blocks * w.block_size)
    assert (res.hit_tokens, res.counted_tokens) == reference_lru(w, res.num_blocks)


def test_lru_duplicate_stays_unhashed_after_its_original_is_evicted():
    """Found by the property above: a re-computed block whose key another block holds stays
    unhashed, even when growing for the outputs evicts that other block (the manager offers
    each block to the cache once); the next turn then hits 3 of [1, 1, 2, 2, -7], not 4."""
    def req(t, i, o, h):
        return TraceRequest(t=t, in_tokens=i, out_tokens=o, hash_ids=h, think_time=0.0,
                            api_time=None, streaming=False, stop=None, agent="main")
    sessions = [Session("trace0", "", 2, [], [req(2.0, 1, 0, ()), req(2.0, 1, 3, ())], []),
                Session("trace1", "", 2, [], [req(0.5, 4, 0, (1, 2)), req(0.5, 2, 0, (1,)),
                                              req(2.5, 4, 1, (1, 2)), req(2.5, 5, 0, (1, 2))],
                        []),
                Session("trace2", "", 2, [], [req(0.0, 1, 0, ())], [])]
    w = workload(sessions, 1, semantics="loomserve", append_outputs=True)
    res = run_lru(w, 10 * w.block_size)
    assert (res.hit_tokens, res.counted_tokens) == reference_lru(w, res.num_blocks) == (7, 18)


def test_lru_reference_sanity():
    """Hand-checked: one trace, blocks of 2 tokens, pool of 3 blocks."""
    reqs = [TraceRequest(t=0, in_tokens=5, out_tokens=0, hash_ids=(1, 2)),      # A B + tail
            TraceRequest(t=1, in_tokens=7, out_tokens=0, hash_ids=(1, 2, 3)),   # hits A B
            TraceRequest(t=2, in_tokens=5, out_tokens=0, hash_ids=(4, 5))]      # evicts
    w = Workload([Session("t", "", 2, [], reqs, [])])
    res = run_lru(w, 6)
    # req 2 hits A B (4 tokens) but needs 4 blocks: truncated, caches C only; req 3 needs
    # all 3 blocks, so A B C go.
    assert res.hit_tokens == 4 and reference_lru(w, 3) == (4, 17)
    assert res.request_hit_rates == [0.0, 4 / 7, 0.0]


# -- infinite ---------------------------------------------------------------------------------

@FAST
@given(sessions_st(), st.integers(0, 2), st.sampled_from(["loomserve", "kvcache-sim"]))
def test_infinite_is_theoretical(sessions, draw_bs, semantics):
    w = workload(sessions, draw_bs, semantics=semantics)
    inf = run_infinite(w)
    assert inf.hit_tokens == reference_infinite(w)
    total_blocks = sum(-(-r.num_tokens // w.block_size) for r in w.requests)
    big = run_lru(w, (total_blocks + 1) * w.block_size)
    assert big.evictions == 0 and big.hit_tokens == inf.hit_tokens


def test_infinite_matches_bench_stats():
    """With the trace's own block size and no request ending on a block boundary, the
    simulator's infinite policy equals `bench stats`' theoretical hit."""
    from loomserve.bench.stats import theoretical_hits
    reqs = [TraceRequest(t=i, in_tokens=4 * n + 1, out_tokens=3, hash_ids=tuple(range(1, n + 1)))
            for i, n in enumerate([3, 5, 2, 6])]
    s = Session("t", "", 4, [], reqs, [])
    assert run_infinite(Workload([s])).hit_tokens == sum(h for _, h in theoretical_hits(s))


# -- Belady -----------------------------------------------------------------------------------

@st.composite
def tiny_streams(draw):
    """Chained key lists: a request continues a prefix of an earlier one, adds fresh keys."""
    keys: list[list[int]] = []
    caps = []
    nxt = 0
    for _ in range(draw(st.integers(1, 5))):
        ks: list[int] = []
        if keys and draw(st.booleans()):
            base = draw(st.sampled_from(keys))
            ks = base[:draw(st.integers(0, len(base)))]
        add = draw(st.integers(0 if ks else 1, 3))
        ks = ks + list(range(nxt, nxt + add))
        nxt += add
        keys.append(ks)
        caps.append(draw(st.sampled_from([len(ks), max(0, len(ks) - 1)])))
    return keys, caps, draw(st.integers(1, 4))


@settings(max_examples=150, deadline=None)
@given(tiny_streams())
def test_belady_equals_brute_force(case):
    keys, caps, capacity = case
    assume(len({k for ks in keys for k in ks}) <= 8)  # brute force: 2^keys subsets
    assert sum(belady_hits(keys, caps, capacity)) == brute_force_best(keys, caps, capacity)


@FAST
@given(sessions_st(), st.integers(1, 20), st.integers(0, 2),
       st.sampled_from(["loomserve", "kvcache-sim"]), st.booleans())
def test_belady_at_least_lru(sessions, blocks, draw_bs, semantics, outputs):
    w = workload(sessions, draw_bs, semantics=semantics, append_outputs=outputs)
    cap = blocks * w.block_size
    lru, inf = run_lru(w, cap), run_infinite(w)
    # Belady as large as the pool: with kvcache-sim semantics the pool has one extra block (for
    # the marker token), which a request too large for the cache fills with a cached block.
    opt = run_optimal(w, lru.num_blocks * w.block_size)
    assert lru.hit_tokens <= opt.hit_tokens <= inf.hit_tokens
    if semantics == "loomserve":
        assert opt.hit_tokens == run_optimal(w, cap).hit_tokens


@FAST
@given(sessions_st(max_requests=10), st.integers(0, 2),
       st.sampled_from(["loomserve", "kvcache-sim"]), st.booleans())
def test_capacity_monotone(sessions, draw_bs, semantics, outputs):
    """Belady never loses hits with more capacity. LRU through the manager is not a stack
    algorithm: a hit stops at the first missing block and the last prompt token is never a hit,
    so which blocks a request touches depends on the capacity, and hypothesis (CI's derandomized
    run) found a case where 7 blocks hit less than 4. For LRU only the infinite bound holds."""
    w = workload(sessions, draw_bs, semantics=semantics, append_outputs=outputs)
    prev = -1
    inf = run_infinite(w).hit_tokens
    for blocks in range(1, 26, 3):
        cap = blocks * w.block_size
        assert run_lru(w, cap).hit_tokens <= inf, ("lru", blocks)
        h = run_optimal(w, cap).hit_tokens
        assert prev <= h <= inf, ("optimal", blocks)
        prev = h


def test_belady_next_uses_and_bypass():
    keys = [[0, 1, 2], [0, 3], [0, 1, 2], [0, 3]]
    caps = [3, 2, 3, 2]
    assert next_uses(keys, caps) == [[1, 2, 2], [2, 3], [3, 4, 4], [4, 4]]
    assert infinite_hits(keys, caps) == [0, 1, 3, 2]
    # 3 blocks: after request 1, keys 0 1 2 (next use 2) beat 3 (next use 3), which is
    # bypassed; request 2 hits all three, request 3 only 0. Five blocks, the optimum.
    assert belady_hits(keys, caps, 3) == [0, 1, 3, 1]
    assert sum(belady_hits(keys, caps, 3)) == brute_force_best(keys, caps, 3)
    assert belady_hits(keys, caps, 0) == [0, 0, 0, 0]


# -- ordering, scope and truncation -----------------------------------------------------------

def test_time_order_scope_and_stagger():
    a = Session("a", "", 2, [], [TraceRequest(t=0, in_tokens=4, out_tokens=0, hash_ids=(1, 2)),
                                 TraceRequest(t=5, in_tokens=6, out_tokens=0,
                                              hash_ids=(1, 2, 3))], [])
    b = Session("b", "", 2, [], [TraceRequest(t=1, in_tokens=4, out_tokens=0, hash_ids=(1, 2))],
                [])
    w = Workload([a, b])
    assert [(r.trace, r.t) for r in w.requests] == [("a", 0), ("b", 1), ("a", 5)]
    assert run_infinite(w).hit_tokens == 4  # b's ids 1 2 are its own (salted), a's third hits 2
    w2 = Workload([a, b], stagger_s=10)
    assert [(r.trace, r.t) for r in w2.requests] == [("a", 0), ("a", 5), ("b", 11)]


def test_block_recomputed_under_the_cap_keeps_the_old_copy_in_place():
    """A prompt ending on a block boundary recomputes its last block (hit capped at n - 1):
    the new block is a duplicate and the cached copy keeps its place in the LRU order. Random
    traces rarely reach this; a reference that moved the key to the new block instead gives
    6 hit tokens here."""
    reqs = [TraceRequest(t=0, in_tokens=4, out_tokens=0, hash_ids=(1, 2)),
            TraceRequest(t=1, in_tokens=3, out_tokens=0, hash_ids=(3,)),
            TraceRequest(t=2, in_tokens=4, out_tokens=0, hash_ids=(1, 2)),
            TraceRequest(t=3, in_tokens=3, out_tokens=0, hash_ids=(4,)),
            TraceRequest(t=4, in_tokens=5, out_tokens=0, hash_ids=(1, 2)),
            TraceRequest(t=5, in_tokens=3, out_tokens=0, hash_ids=(3,))]
    w = Workload([Session("t", "", 2, [], reqs, [])])
    assert run_lru(w, 10).hit_tokens == reference_lru(w, 5)[0] == 8


def test_oversize_request_is_truncated_not_dropped():
    reqs = [TraceRequest(t=0, in_tokens=40, out_tokens=0, hash_ids=tuple(range(1, 11))),
            TraceRequest(t=1, in_tokens=41, out_tokens=0, hash_ids=tuple(range(1, 11)))]
    w = Workload([Session("t", "", 4, [], reqs, [])])
    res = run_lru(w, 16)  # 4 blocks: the 10-block prompt caches its first 4
    assert res.truncated_requests == 2
    assert res.hit_tokens == 16 == reference_lru(w, 4)[0]
