"""Why a prompt missed the prefix cache: each uncached prompt token attributed to one cause.

At a request's first admission (the one its usage's cached_tokens reports), its uncached
tokens [cached, n) are split exactly by cause (they sum to n - cached):
- partial_block: the tokens past the last hittable block boundary (a hit is capped at
  (n - 1) // bs blocks: the tail that never fills a block and the last token, always computed);
- the missed full blocks that were held once: dropped from the device (`DropRecord`: evicted
  / evicted_tier, pin_expired, preempted), or live but unreachable (state_missing on a hybrid
  model: no state checkpoint at a usable boundary; else the cause of the first missed block,
  whose loss broke the chain);
- the blocks never held: block hashes are chained, so they follow all the held ones; they
  are split without lookups into diverged (the session's previous request held other tokens
  there), salt (the same tokens were held under another cache_salt) and first_sight.

Cost: the boundary between held and never held is found by bisection (a few probes); the
held-but-missed blocks (real evictions) take C-level maps and list passes; diverged one
bisection of the two hash chains; nothing per step. The design: docs/design/miss-causes.md.

Invariants:
- attribute() returns counts that sum to n - cached, each > 0 (zero causes omitted).
- DropRecord holds at most `capacity` hashes (LRU); one it forgot is still "ever dropped"
  through its filter (which may also say so, rarely, of one never dropped).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

# Engine-side causes, in report order; the router adds ROUTER_CAUSES.
CAUSES = ("first_sight", "diverged", "evicted", "evicted_tier", "pin_expired",
          "state_missing", "partial_block", "salt", "preempted")
ROUTER_CAUSES = ("placed_elsewhere", "session_moved", "index_stale")
ALL_CAUSES = CAUSES + ROUTER_CAUSES

# Why a hashed block went back to the free queue (Block.release), read when it is evicted.
RELEASE_PIN_TTL = "pin_ttl"
RELEASE_PIN_BUDGET = "pin_budget"
RELEASE_PREEMPTED = "preempted"
# Dropped by reset_prefix_cache (an operator's or a weight update's): evicted, with release
# "reset" in the detail, so the next miss is not read as first_sight.
RELEASE_RESET = "reset"
_CAUSE_OF_RELEASE = {None: "evicted", RELEASE_PIN_TTL: "pin_expired",
                     RELEASE_PIN_BUDGET: "pin_expired", RELEASE_PREEMPTED: "preempted",
                     RELEASE_RESET: "evicted"}


class DropRecord:
    """Block hashes dropped from the device. A bounded LRU keeps the latest `capacity` with
    why and when: hash -> (release, time dropped); release None is a plain eviction by the
    pool's policy, else why the block was last freed (pin_ttl, pin_budget, preempted). Past
    it, a one-hash Bloom filter of `filter_bits` bits answers "ever dropped" (a false
    positive reads a never-held block as evicted: about n / filter_bits of them after n
    drops)."""

    __slots__ = ("capacity", "clock", "_d", "_bits", "_mask")

    def __init__(self, capacity: int = 1 << 16, clock: Callable[[], float] = time.monotonic,
                 filter_bits: int = 1 << 25) -> None:
        if filter_bits & (filter_bits - 1):
            raise ValueError("filter_bits must be a power of two")
        self.capacity = capacity
        self.clock = clock
        self._d: OrderedDict[bytes, tuple[str | None, float]] = OrderedDict()
        self._bits = bytearray(filter_bits >> 3)
        self._mask = filter_bits - 1

    def note(self, block_hash: bytes, release: str | None) -> None:
        d = self._d
        d[block_hash] = (release, self.clock())
        d.move_to_end(block_hash)
        if len(d) > self.capacity:
            d.popitem(last=False)
        i = int.from_bytes(block_hash[:8], "little") & self._mask  # hashes are uniform
        self._bits[i >> 3] |= 1 << (i & 7)

    def get(self, block_hash: bytes) -> tuple[str | None, float] | None:
        return self._d.get(block_hash)

    def ever(self, block_hash: bytes) -> bool:
        """Whether the hash was ever dropped (the record, or the filter: maybe)."""
        i = int.from_bytes(block_hash[:8], "little") & self._mask
        return bool(self._bits[i >> 3] & (1 << (i & 7)))

    def __len__(self) -> int:
        return len(self._d)

    def clear(self) -> None:
        self._d.clear()
        self._bits[:] = bytes(len(self._bits))


class SaltIndex:
    """Bounded LRU: the tokens of a request's first block -> (its cache_salt, its tokens), so
    a request that never hit can tell whether another salt held the same prefix."""

    __slots__ = ("capacity", "_d")

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._d: OrderedDict[tuple, tuple[str | None, list[int]]] = OrderedDict()

    def other_salt(self, key: tuple, salt: str | None) -> list[int] | None:
        """Tokens of the latest request with the same first block under another salt."""
        e = self._d.get(key)
        return e[1] if e is not None and e[0] != salt else None

    def note(self, key: tuple, salt: str | None, tokens: list[int]) -> None:
        d = self._d
        d[key] = (salt, tokens)
        d.move_to_end(key)
        if len(d) > self.capacity:
            d.popitem(last=False)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most limit (bisection over C compares)."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class MissAttribution:
    """One request's attribution: tokens per cause, plus details for the log and the usage
    extension (diverged: first differing token; evicted: policy and age of the first loss)."""

    __slots__ = ("causes", "detail")

    def __init__(self) -> None:
        self.causes: dict[str, int] = {}
        self.detail: dict = {}

    def add(self, cause: str, tokens: int) -> None:
        if tokens > 0:
            self.causes[cause] = self.causes.get(cause, 0) + tokens

    @property
    def total(self) -> int:
        return sum(self.causes.values())


class MissAttributor:
    """Attributes the misses of a KV manager's requests. live: the hash map of a token
    (attention) group; state_groups: whether the model has recurrent state groups."""

    def __init__(self, block_size: int, live: dict, state_groups: bool, policy: str,
                 record: DropRecord, salts: SaltIndex | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.live = live
        self.state_groups = state_groups
        self.policy = policy
        self.record = record
        self.salts = salts if salts is not None else SaltIndex()
        self.clock = clock

    def attribute(self, tokens: list[int], num_prompt: int, hashes: list[bytes], cached: int,
                  salt: str | None, prev: tuple | None, tiers: bool = False,
                  own: list = ()) -> MissAttribution:
        """tokens: the prompt (at least num_prompt ids); hashes: its block hashes (at least
        the full blocks below the hit cap); cached: prompt tokens served (device + tiers);
        own: the request's own blocks of the live group (cached by its allocation: not live
        before it);
        prev: the session's previous request (cache_salt, all_token_ids, block_hashes) or
        None; tiers: a tier was asked too (a device eviction is then also a tier miss)."""
        out = MissAttribution()
        n = num_prompt
        bs = self.block_size
        key = tuple(tokens[:bs]) if n >= bs else None
        cap = (n - 1) // bs * bs if n > 0 else 0  # hittable tokens
        if cached >= cap:
            out.add("partial_block", n - cached)
            self._note_salt(key, salt, tokens)
            return out
        out.add("partial_block", n - cap)
        i = cached // bs
        end = cap // bs
        seg = hashes[i:end]
        mine = own[i:end] if own else ()
        stop = self._first_never_held(seg, mine)
        # The held blocks: live on the device (the request's own new blocks excepted) or
        # dropped; classified with C-level maps and one Python pass.
        lv = list(map(self.live.get, seg[:stop]))
        if mine:
            k = min(len(mine), stop)
            lv[:k] = [None if b is o else b for b, o in zip(lv, mine[:k])]
        rc = list(map(self.record._d.get, seg[:stop]))
        if stop > 0:
            self._held_blocks(out, lv, rc, i, cached - i * bs, tiers)
        if stop < len(seg):
            self._never_held(out, tokens, hashes, cached, i + stop, cap, salt, prev, key)
        self._note_salt(key, salt, tokens)
        return out

    def _first_never_held(self, seg: list[bytes], mine: list) -> int:
        """Index of the first block of seg never held on the device. Bisection: a block held
        once means its whole prefix was held once (chained hashes), so "held" is true on a
        prefix of seg (up to the filter's rare false positives)."""
        live = self.live.get
        rec = self.record._d
        ever = self.record.ever
        n_mine = len(mine)

        def held(k: int) -> bool:
            h = seg[k]
            b = live(h)
            if b is not None and not (k < n_mine and mine[k] is b):
                return True
            return h in rec or ever(h)

        lo, hi = 0, len(seg)
        while lo < hi:
            mid = (lo + hi) // 2
            if held(mid):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _held_blocks(self, out: MissAttribution, lv: list, rc: list, first: int,
                     skip: int, tiers: bool) -> None:
        """Missed blocks that were held: dropped ones by why (the record, or only the
        ever-dropped filter for ones it forgot); live ones by state_missing (hybrid) or the
        cause of the first missed block, whose loss broke the chain. skip: tokens of the first
        block already cached (a decode leg's tail)."""
        bs = self.block_size
        releases = [r[0] for r in rc if r is not None]
        by = {k: releases.count(k) for k in set(releases)}  # a few distinct values
        unrecorded = [a for a, r in zip(lv, rc) if r is None]
        forgotten = unrecorded.count(None)  # dropped, only the filter remembers
        live = len(unrecorded) - forgotten
        first_cause = None
        for k, c in by.items():
            cause = _CAUSE_OF_RELEASE.get(k, "evicted")
            if cause == "evicted" and tiers:
                cause = "evicted_tier"
            out.add(cause, c * bs)
        r0 = rc[0]
        if r0 is not None:
            first_cause = _CAUSE_OF_RELEASE.get(r0[0], "evicted")
            if first_cause == "evicted" and tiers:
                first_cause = "evicted_tier"
            out.detail["evicted"] = {"policy": self.policy, "release": r0[0] or "policy",
                                     "age_s": round(self.clock() - r0[1], 3), "block": first}
        evicted = "evicted_tier" if tiers else "evicted"
        if live:
            out.add("state_missing" if self.state_groups else first_cause or evicted,
                    live * bs)
        if forgotten:
            out.add(evicted, forgotten * bs)
        if skip:
            self._take(out, skip, "state_missing" if lv[0] is not None and self.state_groups
                       else first_cause or evicted)

    @staticmethod
    def _take(out: MissAttribution, n: int, cause: str) -> None:
        """Remove n tokens, from `cause` first (the first block's cause), then any."""
        for c in (cause, *list(out.causes)):
            have = out.causes.get(c, 0)
            t = min(have, n)
            if t:
                out.causes[c] = have - t
                if not out.causes[c]:
                    del out.causes[c]
                n -= t
            if n <= 0:
                return

    def _never_held(self, out: MissAttribution, tokens: list[int], hashes: list[bytes],
                    cached: int, i: int, cap: int, salt: str | None, prev: tuple | None,
                    key) -> None:
        """Blocks [i, cap/bs) were never held: diverged / salt up to how far the session's
        previous request (or another salt's request) shared tokens, first_sight after."""
        bs = self.block_size
        start = max(i * bs, cached)
        upto = start
        if prev is not None:
            psalt, ptokens = prev[0], prev[1]
            # The previous request held its full blocks; past them its content is unknown.
            reach = min(cap, len(ptokens) // bs * bs)
            if reach > start:
                same = (self._same_prefix(tokens, ptokens, hashes, prev[2], reach)
                        if psalt == salt else common_prefix(tokens, ptokens, reach))
                shared = max(start, same // bs * bs)  # blocks with the previous' content
                if psalt != salt:
                    out.add("salt", shared - start)
                else:  # same hashes, never held: the previous request never computed them
                    out.add("first_sight", shared - start)
                if reach > shared:
                    out.detail["diverged"] = {"token": same, "block": same // bs}
                    out.add("diverged", reach - shared)
                upto = reach
        if upto == start and key is not None:
            other = self.salts.other_salt(key, salt)
            if other is not None:
                same = common_prefix(tokens, other, cap) // bs * bs
                if same > start:
                    out.add("salt", same - start)
                    upto = same
        out.add("first_sight", cap - upto)

    def _same_prefix(self, tokens: list[int], ptokens: list[int], hashes: list[bytes],
                     phashes: list[bytes], reach: int) -> int:
        """common_prefix of two prompts under one salt, at most reach: leading equal block
        hashes by bisection (chained: equal at k means equal before k), then tokens."""
        bs = self.block_size
        lo, hi = 0, min(reach // bs, len(hashes), len(phashes))  # hashes[:lo] all equal
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] == phashes[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        at = lo * bs
        end = reach if lo == min(len(hashes), len(phashes)) else min(reach, at + bs)
        return at + common_prefix(tokens[at:end], ptokens[at:end], end - at)

    def _note_salt(self, key, salt: str | None, tokens: list[int]) -> None:
        if key is not None:
            self.salts.note(key, salt, tokens)
