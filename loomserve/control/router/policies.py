"""Routing policies: which instance serves a request, and why.

Every policy returns a `Decision`: the instance, the reason (one of REASONS) and the overlap
(blocks of the prompt cached there, None when the policy did not look).
  stickiness  the session's (or its parent's) instance
  overlap     the instance with the lowest KV cost, which holds part of the prompt
  load        the least loaded instance (nothing cached anywhere)
  overload    the session's home was overloaded: where the KV cost is lowest elsewhere
  fallback    the prompt could not be known (or the session's home is down): least loaded
  evicted     the session's home no longer holds its context: where eviction pressure is lowest

Policies:
- round_robin: each instance in turn. Load testing, identical short requests.
- least_loaded: fewest in-flight requests, then fewest active blocks. Stateless traffic.
- session: consistent hashing of the session key (a subagent's is its parent's) onto a ring of
  VNODES virtual nodes per healthy instance: adding an instance moves ~1/N of the sessions,
  removing one moves only its own. No tokenization at all.
- kv_aware: Dynamo's cost, lowest wins: OVERLAP_WEIGHT x new prefill blocks (prompt blocks not
  cached there) + active blocks (what its in-flight requests hold). Weight 1.0 (Dynamo's
  default) prices one block to prefill like one block already decoding; raise it to chase
  cache hits harder (long prompts), lower it to spread load (short prompts, long outputs).
- default: sessions stick to their instance (no tokenization on a sticky turn). A new session
  goes where the KV cost with P x live sessions as its load is lowest (P: its prompt in
  blocks; live: router/live.py, silent for under a few of its own gaps), then fewest in-flight
  requests: the sessions between turns are the KV each instance must keep (in-flight load is
  ~0 while agents think), so an instance with one live session more must be P blocks worse
  on overlap to lose the session: a system prompt cached on every instance decides nothing,
  a context cached on one instance only (a fork sent without its parent) keeps it there
  unless its live sessions exceed the others' by two. A session whose home is gone, and a
  request without session, are placed by the kv_aware cost;
  a subagent's first request (X-Parent-Session-ID) starts on its parent's instance. A session
  moves only when its home is down, or overloaded: its active blocks exceed OVERLOAD_FACTOR
  (1.5) x the mean over healthy instances, now AND averaged over the last ~30 s
  (instances.LoadAverage), AND it has at least OVERLOAD_MIN_REQUESTS (4) requests in flight.
  One long request alone is not an overload, nor is a burst: a move costs the session's whole
  context (recomputed on its new instance, a full miss), while a burst drains by itself in
  seconds; in a 30-session closed loop over three instances, moving on the present blocks
  alone cost ~20 full misses and 2.5 points of hit rate per 300 s. The router then ends
  the session on the home it left (DELETE /v1/sessions/{id} there: its pinned blocks become
  evictable, which is what the overloaded instance needs).
  A session also moves when its home lost its context: the KV index (KV events on) shows the
  home holding less than LOST_FRACTION (1/2) of a prompt of at least LOST_MIN_BLOCKS blocks.
  Its prefill is a recompute wherever it runs, so it goes where that evicts least: the
  instance with the lowest eviction pressure (KVIndex.pressure, blocks evicted lately; only
  instances whose events the index follows), provided that is under RELOCATE_RATIO (1/2) of
  the home's (else it stays: no ping-pong between equally busy pools). Partitioned pools then
  share their slack the way one pooled cache would, instead of one pool recomputing its
  sessions while another idles.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from loomserve.control.router.instances import Instance
from loomserve.control.router.kv_index import KVIndex
from loomserve.control.router.live import LIVE_SESSION_S, LiveSessions

REASONS = ("stickiness", "overlap", "load", "overload", "fallback", "evicted")
POLICIES = ("default", "round_robin", "least_loaded", "session", "kv_aware")
OVERLAP_WEIGHT = 1.0
OVERLOAD_FACTOR = 1.5
OVERLOAD_MIN_REQUESTS = 4
VNODES = 128
MAX_STICKY_SESSIONS = 100_000
LOST_FRACTION = 0.5
LOST_MIN_BLOCKS = 4
RELOCATE_RATIO = 0.5


@dataclass
class RouteRequest:
    """What a policy may look at. keys_fn computes (prompt ids, block hashes) or None; it runs
    at most once, and only if a policy asks (a sticky turn never does)."""

    api: str
    session: str | None = None
    parent: str | None = None
    keys_fn: Callable[[], tuple[list[int], list] | None] | None = None
    _keys: tuple | None = field(default=None, repr=False)
    _done: bool = field(default=False, repr=False)

    def keys(self) -> tuple[list[int], list] | None:
        if not self._done:
            self._done = True
            self._keys = self.keys_fn() if self.keys_fn is not None else None
        return self._keys

    @property
    def known_tokens(self) -> int | None:
        """Prompt length if the prompt was tokenized (no tokenization happens here)."""
        return len(self._keys[0]) if self._done and self._keys else None


@dataclass
class Decision:
    instance: Instance
    reason: str
    overlap: int | None = None  # prompt blocks cached on `instance`, None: not looked up
    moved_from: Instance | None = None  # the overloaded home a session just left


def least_loaded(candidates: list[Instance], start: int = 0) -> Instance:
    """Fewest in-flight requests, then fewest active blocks; ties go to the first at or after
    `start` (callers rotate it so equal instances share the work)."""
    n = len(candidates)
    return min(candidates, key=lambda i: (i.active_requests, i.active_blocks,
                                          (candidates.index(i) - start) % n))


class Policy:
    name = "?"

    def choose(self, req: RouteRequest, candidates: list[Instance]) -> Decision:
        raise NotImplementedError

    def needs_keys(self, req: RouteRequest) -> bool:
        """Whether choose() will likely look at the prompt (the router then computes its keys
        in a worker thread first, off the event loop). A wrong guess costs only that."""
        return False

    def forget(self, session: str) -> None:
        """The session ended (DELETE /v1/sessions/{id})."""

    def sessions(self) -> int:
        return 0


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, req, candidates):
        self._next += 1
        return Decision(candidates[self._next % len(candidates)], "load")


class LeastLoaded(Policy):
    name = "least_loaded"

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, req, candidates):
        self.turn += 1
        return Decision(least_loaded(candidates, self.turn), "load")


class HashRing:
    """Consistent hashing with virtual nodes, rebuilt when the set of instances changes."""

    def __init__(self, vnodes: int = VNODES) -> None:
        self.vnodes = vnodes
        self._names: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def lookup(self, key: str, candidates: list[Instance]) -> Instance:
        names = tuple(sorted(i.name for i in candidates))
        if names != self._names:
            self._build(names)
        k = bisect_right(self._points, xxhash.xxh64_intdigest(key.encode())) % len(self._points)
        owner = self._owners[k]
        return next(i for i in candidates if i.name == owner)

    def _build(self, names: tuple[str, ...]) -> None:
        ring = sorted((xxhash.xxh64_intdigest(f"{n}#{v}".encode()), n)
                      for n in names for v in range(self.vnodes))
        self._names = names
        self._points = [p for p, _ in ring]
        self._owners = [n for _, n in ring]


class SessionAffinity(Policy):
    name = "session"

    def __init__(self, vnodes: int = VNODES) -> None:
        self.ring = HashRing(vnodes)
        self.turn = 0

    def choose(self, req, candidates):
        key = req.parent or req.session
        if key is None:
            self.turn += 1
            return Decision(least_loaded(candidates, self.turn), "fallback")
        return Decision(self.ring.lookup(key, candidates), "stickiness")


class KVAware(Policy):
    name = "kv_aware"

    def __init__(self, index: KVIndex, block_size: Callable[[], int],
                 overlap_weight: float = OVERLAP_WEIGHT) -> None:
        self.index = index
        self.block_size = block_size
        self.weight = overlap_weight
        self.turn = 0

    def needs_keys(self, req):
        return True

    def choose(self, req, candidates, load: Callable[[Instance, int], tuple] | None = None):
        """Lowest weight x new prefill blocks + load; `load(instance, prompt blocks)` is the
        rest of the cost key, its first item in blocks (default: active blocks, then in-flight
        requests); ties rotate."""
        self.turn += 1
        keys = req.keys()
        if keys is None:
            return Decision(least_loaded(candidates, self.turn), "fallback")
        ids, hashes = keys
        prompt_blocks = math.ceil(len(ids) / self.block_size())
        overlaps = self.index.overlaps(hashes)
        load = load or _in_flight
        n = len(candidates)

        def cost(pair):
            j, inst = pair
            blocks, *rest = load(inst, prompt_blocks)
            new_blocks = prompt_blocks - overlaps.get(inst.name, 0)
            return (self.weight * new_blocks + blocks, *rest, (j - self.turn) % n)

        best = min(enumerate(candidates), key=cost)[1]
        ov = overlaps.get(best.name, 0)
        return Decision(best, "overlap" if ov else "load", ov)


def _in_flight(inst: Instance, prompt_blocks: int) -> tuple:
    return inst.active_blocks, inst.active_requests


def overloaded(inst: Instance, candidates: list[Instance], factor: float = OVERLOAD_FACTOR,
               min_requests: int = OVERLOAD_MIN_REQUESTS) -> bool:
    """The default policy's threshold for moving a session off its home (module doc): over
    factor x the mean both in present and in averaged active blocks."""
    if inst.active_requests < min_requests or len(candidates) < 2:
        return False
    n = len(candidates)
    if inst.active_blocks <= factor * sum(i.active_blocks for i in candidates) / n:
        return False
    return inst.load.average() > factor * sum(i.load.average() for i in candidates) / n


class DefaultPolicy(Policy):
    """Sticky sessions placed by KV cost, moved only when their home is down or overloaded.
    Invariant: `sticky` maps a session to the instance name its last request went to."""

    name = "default"

    def __init__(self, kv: KVAware, max_sessions: int = MAX_STICKY_SESSIONS,
                 overload_factor: float = OVERLOAD_FACTOR,
                 overload_min_requests: int = OVERLOAD_MIN_REQUESTS,
                 live_session_s: float = LIVE_SESSION_S) -> None:
        self.kv = kv
        self.max_sessions = max_sessions
        self.factor, self.min_requests = overload_factor, overload_min_requests
        self.sticky: OrderedDict[str, str] = OrderedDict()
        self.live = LiveSessions(live_session_s)

    def choose(self, req, candidates):
        by_name = {i.name: i for i in candidates}
        key, moved = req.session, None
        if key is not None and key in self.sticky:
            home = by_name.get(self.sticky[key])
            if home is not None and not self._overloaded(home, candidates):
                return self._keep(key, self._lost(req, home, candidates)
                                  or Decision(home, "stickiness"))
            moved = "overload" if home is not None else "fallback"
            left = home
            if home is not None:
                candidates = [i for i in candidates if i is not home]
        elif req.parent is not None and req.parent in self.sticky:
            home = by_name.get(self.sticky[req.parent])
            if home is not None and not self._overloaded(home, candidates):
                return self._keep(key, Decision(home, "stickiness"))
        if moved is None and key is not None and len(candidates) > 1:
            return self._keep(key, self._place(req, candidates))
        d = self.kv.choose(req, candidates)
        if moved is not None:
            d.reason, d.moved_from = moved, left
        return self._keep(key, d)

    def _place(self, req, candidates: list[Instance]) -> Decision:
        """A new session: the KV cost with P x live sessions there as the load, where P is its
        prompt in blocks (the resident KV a live session is taken to hold); ties by in-flight
        requests, then blocks (module doc)."""
        counts = self.live.counts()
        return self.kv.choose(req, candidates, lambda inst, prompt: (
            prompt * counts.get(inst.name, 0), inst.active_requests, inst.active_blocks))

    def _lost(self, req, home: Instance, candidates: list[Instance]) -> Decision | None:
        """A move for a sticky session whose home lost its context (module doc), else None.
        The prompt is looked at only when some instance is under RELOCATE_RATIO of the home's
        pressure: with pools turning over evenly a sticky turn tokenizes nothing."""
        pressure = self.kv.index.pressures()  # one snapshot; only instances the index tracks
        roomier = _roomier(pressure, home.name)
        eligible = [(j, c) for j, c in enumerate(candidates) if c.name in roomier]
        if not eligible or (keys := req.keys()) is None:
            return None
        hashes = keys[1]
        overlaps = self.kv.index.overlaps(hashes)
        if len(hashes) < LOST_MIN_BLOCKS or \
                overlaps.get(home.name, 0) >= LOST_FRACTION * len(hashes):
            return None
        counts, n = self.live.counts(), len(candidates)
        best = min(eligible, key=lambda p: (pressure[p[1].name], counts.get(p[1].name, 0),
                                            p[1].active_requests, (p[0] - self.kv.turn) % n))[1]
        return Decision(best, "evicted", overlaps.get(best.name, 0), moved_from=home)

    def needs_keys(self, req):
        if req.session in self.sticky:  # only when _lost could move it
            return bool(_roomier(self.kv.index.pressures(), self.sticky[req.session]))
        return req.parent not in self.sticky

    def _overloaded(self, home: Instance, candidates: list[Instance]) -> bool:
        return overloaded(home, candidates, self.factor, self.min_requests)

    def _keep(self, key: str | None, d: Decision) -> Decision:
        if key is not None:
            self.sticky[key] = d.instance.name
            self.sticky.move_to_end(key)
            if len(self.sticky) > self.max_sessions:
                self.live.drop(self.sticky.popitem(last=False)[0])
            self.live.seen(key, d.instance.name)
        return d

    def forget(self, session: str) -> None:
        self.sticky.pop(session, None)
        self.live.drop(session)

    def sessions(self) -> int:
        return len(self.sticky)


def _roomier(pressure: dict[str, float], home: str) -> set[str]:
    """Tracked instances evicting under RELOCATE_RATIO x home's pressure (strictly: a home
    that evicts nothing, or one the index does not track, keeps its sessions)."""
    if home not in pressure:
        return set()
    limit = RELOCATE_RATIO * pressure[home]
    return {name for name, p in pressure.items() if p < limit}


def make_policy(name: str, index: KVIndex, block_size: Callable[[], int],
                overlap_weight: float = OVERLAP_WEIGHT, overload_factor: float = OVERLOAD_FACTOR,
                overload_min_requests: int = OVERLOAD_MIN_REQUESTS) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "session":
        return SessionAffinity()
    kv = KVAware(index, block_size, overlap_weight)
    if name == "kv_aware":
        return kv
    if name == "default":
        return DefaultPolicy(kv, overload_factor=overload_factor,
                             overload_min_requests=overload_min_requests)
    raise ValueError(f"unknown policy {name!r}; one of {', '.join(POLICIES)}")
