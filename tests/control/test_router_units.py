"""The router's parts without servers: the KV index, the policies, PD (prompt keys:
test_router_prompt_keys.py)."""

from __future__ import annotations

import pytest

from loomserve.control.router.instances import (
    LOAD_WINDOW_S,
    Instance,
    Lease,
    LoadAverage,
    events_address,
)
from loomserve.control.router.kv_index import PRESSURE_HALF_LIFE_S, KVIndex
from loomserve.control.router.live import LIVE_SESSION_S, LiveSessions
from loomserve.control.router.pd import (
    decode_body,
    prefill_body,
    should_disaggregate,
    uncached_tokens,
)
from loomserve.control.router.policies import (
    OVERLOAD_MIN_REQUESTS,
    Decision,
    DefaultPolicy,
    HashRing,
    KVAware,
    RouteRequest,
)
from loomserve.control.router.routing import session_of
from loomserve.kv.event_wire import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from loomserve.kv.hashing import hash_chain


def up(url: str, blocks: float = 0.0, requests: int = 0) -> Instance:
    inst = Instance(url, info={"role": "both", "block_size": 4})
    inst.up, inst.active_blocks, inst.active_requests = True, blocks, requests
    return inst


def stored(hashes, medium=MEDIUM_GPU, group=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[],
                       block_size=4, lora_id=None, medium=medium, lora_name=None, group_idx=group)


def batch(*events):
    return KVEventBatch(ts=0.0, events=list(events))


# --- KV index -------------------------------------------------------------------------------

def test_index_longest_prefix_per_instance_in_one_walk():
    idx = KVIndex()
    chain = [b"h%d" % i for i in range(6)]
    idx.apply("a", batch(stored(chain[:4])))
    idx.apply("b", batch(stored(chain[:2])))
    idx.apply("c", batch(stored(chain[1:6])))  # no block 0: no prefix at all
    assert idx.overlaps(chain) == {"a": 4, "b": 2}
    assert idx.overlaps([b"x"] + chain) == {}
    assert idx.overlaps(chain[:3]) == {"a": 3, "b": 2}


def test_index_removal_clear_and_media():
    idx = KVIndex()
    chain = [b"h%d" % i for i in range(4)]
    idx.apply("a", batch(stored(chain), stored([b"zz"], medium=MEDIUM_CPU),
                         stored([b"g1"], group=1)))
    assert idx.blocks_of("a") == 4  # host tier copies and other KV groups are not indexed
    idx.apply("a", batch(BlockRemoved(block_hashes=[chain[2]], medium=MEDIUM_GPU)))
    assert idx.overlaps(chain) == {"a": 2}
    idx.apply("a", batch(BlockRemoved(block_hashes=[chain[0]], medium=MEDIUM_CPU)))
    assert idx.overlaps(chain) == {"a": 2}  # a tier copy going away leaves the device block
    idx.apply("b", batch(stored(chain)))
    idx.apply("a", batch(AllBlocksCleared()))
    assert idx.overlaps(chain) == {"b": 4}
    idx.clear("b")
    assert idx.overlaps(chain) == {} and idx.stats()["blocks"] == 0


# --- policies -------------------------------------------------------------------------------

def test_consistent_hashing_moves_about_one_nth_of_sessions():
    ring = HashRing()
    three = [up(f"http://h{i}:1") for i in range(3)]
    four = three + [up("http://h3:1")]
    keys = [f"session-{i}" for i in range(4000)]
    before = {k: ring.lookup(k, three).name for k in keys}
    after = {k: ring.lookup(k, four).name for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert 0.15 < len(moved) / len(keys) < 0.35  # ~1/4 with 4 instances
    assert all(after[k] == "h3:1" for k in moved)  # only onto the new instance
    shares = [sum(1 for v in after.values() if v == i.name) / len(keys) for i in four]
    assert min(shares) > 0.15


def _kv_request(idx: KVIndex, n_blocks: int, session=None, parent=None):
    ids = list(range(n_blocks * 4))
    hashes = hash_chain(ids, 4)
    return RouteRequest("chat", session, parent, lambda: (ids, hashes)), hashes


def test_kv_aware_prefers_overlap_until_load_outweighs_it():
    idx = KVIndex()
    a, b = up("http://a:1"), up("http://b:1")
    policy = KVAware(idx, lambda: 4)
    req, hashes = _kv_request(idx, 10)
    idx.store("b:1", hashes[:6])
    d = policy.choose(req, [a, b])
    assert (d.instance, d.reason, d.overlap) == (b, "overlap", 6)
    b.active_blocks = 7.0  # cost b = 4 + 7 > cost a = 10 + 0
    req, _ = _kv_request(idx, 10)
    d = policy.choose(req, [a, b])
    assert (d.instance, d.reason, d.overlap) == (a, "load", 0)
    d = policy.choose(RouteRequest("chat"), [a, b])  # prompt unknown
    assert d.reason == "fallback" and d.overlap is None


def test_default_sticks_then_moves_only_when_overloaded():
    idx = KVIndex()
    now = [0.0]
    a, b = up("http://a:1"), up("http://b:1")
    for inst in (a, b):
        inst.load = LoadAverage(LOAD_WINDOW_S, clock=lambda: now[0])
    policy = DefaultPolicy(KVAware(idx, lambda: 4))
    req, hashes = _kv_request(idx, 8, session="s1")
    idx.store("a:1", hashes)
    assert policy.choose(req, [a, b]).reason == "overlap"
    sticky, _ = _kv_request(idx, 8, session="s1")
    d = policy.choose(sticky, [a, b])
    assert (d.instance, d.reason) == (a, "stickiness")
    a.active_blocks = b.active_blocks = 20.0
    now[0] += 5 * LOAD_WINDOW_S  # both have held 20 blocks for long
    a.active_blocks, a.active_requests = 100.0, OVERLOAD_MIN_REQUESTS
    now[0] += 1.0  # a 1 s burst: 100 > 1.5 x 60 now, but a averages ~22.6 against b's 20
    assert policy.choose(sticky, [a, b]).instance is a
    now[0] += 3 * LOAD_WINDOW_S  # sustained: a averages ~96 > 1.5 x mean ~58
    a.active_requests = OVERLOAD_MIN_REQUESTS - 1
    assert policy.choose(sticky, [a, b]).instance is a  # few requests: not an overload
    a.active_requests = OVERLOAD_MIN_REQUESTS
    req, _ = _kv_request(idx, 8, session="s1")
    d = policy.choose(req, [a, b])
    assert (d.instance, d.reason, d.moved_from) == (b, "overload", a)
    a.active_blocks, a.active_requests = 0.0, 0
    assert policy.choose(RouteRequest("chat", "s1"), [a, b]).instance is b  # new home sticks


def test_default_subagent_starts_on_parent_and_dead_home_falls_back():
    idx = KVIndex()
    a, b = up("http://a:1"), up("http://b:1")
    policy = DefaultPolicy(KVAware(idx, lambda: 4))
    policy.sticky["parent"] = "b:1"
    d = policy.choose(RouteRequest("chat", "child", "parent"), [a, b])
    assert (d.instance, d.reason) == (b, "stickiness")
    assert policy.sticky["child"] == "b:1"
    d = policy.choose(RouteRequest("chat", "child", "parent"), [a])  # b is down
    assert (d.instance, d.reason) == (a, "fallback")
    assert policy.sticky["child"] == "a:1"


def test_lease_takes_back_exactly_what_it_added():
    a = up("http://a:1")
    first, second = Lease(a, 64, 16), Lease(a, 16, 16)
    first.on_tokens(32)
    assert (a.active_requests, a.active_blocks) == (2, 7.0)
    first.release()
    first.release()
    assert (a.active_requests, a.active_blocks) == (1, 1.0)
    second.release()
    assert (a.active_requests, a.active_blocks) == (0, 0.0)


def test_events_address_replaces_wildcard_host():
    assert events_address("tcp://*:5557", "http://10.1.2.3:8000") == "tcp://10.1.2.3:5557"
    assert events_address("tcp://0.0.0.0:1", "http://h:8000") == "tcp://h:1"
    assert events_address("tcp://127.0.0.1:9", "http://h:8000") == "tcp://127.0.0.1:9"
    assert events_address(None, "http://h:1") is None


def test_session_of_follows_the_instances_order():
    assert session_of("chat", {"prompt_cache_key": "k"}, {"x-session-id": "h"}) == "h"
    assert session_of("chat", {"prompt_cache_key": "k"}, {"session_id": "c"}) == "k"
    assert session_of("messages", {"metadata": {"user_id": "u"}}, {}) == "u"
    assert session_of("responses", {}, {"x-claude-code-session-id": "cc"}) == "cc"
    assert session_of("completions", {}, {}) is None


# --- prefill/decode -------------------------------------------------------------------------

def test_pd_bodies_and_threshold():
    body = {"messages": [], "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}}
    pre = prefill_body("chat", body)
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "stream_options" not in pre
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body  # a copy
    pre = prefill_body("responses", {"input": "x", "max_output_tokens": 9})
    assert pre["max_output_tokens"] == 1 and pre["store"] is False
    assert decode_body(body, {"k": 1})["kv_transfer_params"] == {"k": 1}
    assert not should_disaggregate(None, 10) and not should_disaggregate(10, 10)
    assert should_disaggregate(11, 10)


def test_uncached_tokens_counts_the_chosen_instance_overlap():
    idx = KVIndex()
    a = up("http://a:1")
    req, hashes = _kv_request(idx, 10)
    idx.store("a:1", hashes[:7])
    assert uncached_tokens(req, Decision(a, "stickiness"), idx, 4) == 12
    assert uncached_tokens(req, Decision(a, "overlap", 10), idx, 4) == 0
    assert uncached_tokens(RouteRequest("chat"), Decision(a, "load"), idx, 4) is None


def test_default_places_new_sessions_by_overlap_and_live_sessions():
    """In-flight load is zero while agents think: a new session goes where missing prompt
    blocks + its prompt x live sessions is lowest, not to the instance idle this instant."""
    idx = KVIndex()
    a, b = up("http://a:1"), up("http://b:1")
    policy = DefaultPolicy(KVAware(idx, lambda: 4))
    policy.live.clock = lambda: 1000.0
    for s in ("s1", "s2"):
        policy.choose(RouteRequest("chat", s), [a])  # two sessions live on a (b was down)
    b.active_requests, b.active_blocks = 1, 5.0  # b is busier right now, a idle
    req, hashes = _kv_request(idx, 8, session="s3")
    assert (policy.choose(req, [a, b]).instance, req.known_tokens) == (b, 32)
    idx.store("a:1", hashes[:6])  # a system prompt cached on both: it decides nothing
    idx.store("b:1", hashes[:6])
    req, _ = _kv_request(idx, 8, session="s4")
    d = policy.choose(req, [a, b])  # a: 2 + 8 x 2 live, b: 2 + 8 x 1
    assert (d.instance, d.reason, d.overlap) == (b, "overlap", 6)
    idx.store("a:1", hashes)  # the whole prompt cached on a only (a fork without its parent)
    req, _ = _kv_request(idx, 8, session="s5")
    assert policy.choose(req, [a, b]).instance is a  # a: 0 + 8 x 2, b: 8 + 8 x 2
    for s in ("s6", "s7"):
        policy.choose(RouteRequest("chat", s), [a])  # a now has two live sessions more
    req, _ = _kv_request(idx, 8, session="s8")
    assert policy.choose(req, [a, b]).instance is b  # a: 0 + 8 x 5, b: 8 + 8 x 2
    policy.live.clock = lambda: 1000.0 + LIVE_SESSION_S + 1  # everyone went quiet
    assert policy.live.counts() == {"a:1": 0, "b:1": 0}
    policy.forget("s3")
    assert not policy.live.tracked("s3") and policy.live.tracked("s4")


def test_live_sessions_end_after_a_few_of_their_own_gaps():
    now = [0.0]
    live = LiveSessions(window_s=300.0, clock=lambda: now[0], gaps=4.0, min_s=5.0)
    for t in (0.0, 2.0, 4.0):  # a session turning every 2 s
        now[0] = t
        live.seen("fast", "a")
    live.seen("once", "a")  # one request: no gap known, live for the whole window
    now[0] = 4.0 + 7.9
    assert live.counts() == {"a": 2}
    now[0] = 4.0 + 8.1  # silent for over 4 gaps of 2 s
    assert live.counts() == {"a": 1}
    live.seen("fast", "b")  # it came back (to another instance): counted once, there
    assert live.counts() == {"a": 1, "b": 1}
    assert live.ttl(0.1) == 5.0 and live.ttl(1e4) == 300.0 and live.ttl(None) == 300.0
    now[0] = 4.0 + 8.1 + 15.0  # its mean gap grew to 0.7 x 2 + 0.3 x 8.1 s: ttl 15.3 s
    assert live.counts() == {"a": 1, "b": 1}
    now[0] = 4.0 + 300.1  # "once" ends with the window
    assert live.counts() == {"a": 0, "b": 0} and live.tracked("once")
    live.drop("fast")
    live.drop("fast")
    assert not live.tracked("fast")


def test_index_pressure_counts_evicted_device_blocks_and_decays():
    now = [100.0]
    idx = KVIndex(clock=lambda: now[0])
    chain = [b"p%d" % i for i in range(8)]
    assert not idx.tracks("a") and idx.pressure("a") == 0.0
    idx.apply("a", batch(stored(chain)))
    assert idx.tracks("a")
    idx.apply("a", batch(BlockRemoved(block_hashes=chain[4:] + [b"never-held"], medium=MEDIUM_GPU),
                         BlockRemoved(block_hashes=chain[:2], medium=MEDIUM_CPU)))
    assert idx.pressure("a") == 4.0  # held device blocks only: not a tier copy, not unknowns
    now[0] += PRESSURE_HALF_LIFE_S
    assert idx.pressure("a") == pytest.approx(2.0)
    idx.apply("a", batch(BlockRemoved(block_hashes=chain[:2], medium=MEDIUM_GPU)))
    assert idx.pressure("a") == pytest.approx(4.0) and idx.stats()["pressure"] == {"a": 4.0}
    idx.apply("a", batch(AllBlocksCleared()))
    assert not idx.tracks("a")  # a restarted instance: its zero overlaps mean nothing yet
    assert idx.pressure("a") == 0.0


def test_default_moves_a_session_whose_home_lost_its_context():
    """The home's pool turned over and the session's prefix is gone from it: its prefill is a
    recompute anywhere, so it goes where eviction pressure is lowest, and stays there."""
    idx = KVIndex(clock=lambda: 0.0)
    a, b = up("http://a:1"), up("http://b:1")
    policy = DefaultPolicy(KVAware(idx, lambda: 4))
    req, hashes = _kv_request(idx, 8, session="s1")
    idx.store("a:1", hashes)
    idx.store("b:1", [b"other"])
    assert policy.choose(req, [a, b]).instance is a
    idx.apply("a:1", batch(BlockRemoved(block_hashes=hashes[2:], medium=MEDIUM_GPU)))
    c = up("http://c:1")  # no KV events from c: its zero pressure means nothing
    req, _ = _kv_request(idx, 8, session="s1")  # 2 of 8 blocks left at home
    d = policy.choose(req, [c, a, b])
    assert (d.instance, d.reason, d.moved_from) == (b, "evicted", a)
    idx.store("b:1", hashes)
    req, _ = _kv_request(idx, 8, session="s1")
    assert (policy.choose(req, [a, b]).reason, policy.sticky["s1"]) == ("stickiness", "b:1")


def test_default_keeps_a_lost_session_home_when_no_pool_has_more_room():
    idx = KVIndex(clock=lambda: 0.0)
    a, b = up("http://a:1"), up("http://b:1")
    policy = DefaultPolicy(KVAware(idx, lambda: 4))
    req, hashes = _kv_request(idx, 8, session="s1")
    idx.store("a:1", hashes + [b"x%d" % i for i in range(8)])
    idx.store("b:1", [b"y%d" % i for i in range(8)])
    policy.choose(req, [a, b])
    idx.apply("a:1", batch(BlockRemoved(block_hashes=hashes, medium=MEDIUM_GPU)))
    idx.apply("b:1", batch(BlockRemoved(block_hashes=[b"y%d" % i for i in range(5)],
                                        medium=MEDIUM_GPU)))
    req, _ = _kv_request(idx, 8, session="s1")  # b evicted 5 > half of a's 8: no move
    assert (policy.choose(req, [a, b]).instance, policy.sticky["s1"]) == (a, "a:1")
    idx.apply("a:1", batch(BlockRemoved(block_hashes=[b"x%d" % i for i in range(8)],
                                        medium=MEDIUM_GPU)))
    idx.store("a:1", hashes)  # the context is back at home: stickiness whatever the pressure
    req, _ = _kv_request(idx, 8, session="s1")
    assert policy.choose(req, [a, b]).reason == "stickiness"


def test_default_sticky_turn_tokenizes_only_when_a_move_could_follow():
    """Without KV events, or with pools turning over evenly, a sticky turn tokenizes nothing."""
    idx = KVIndex(clock=lambda: 0.0)
    a, b = up("http://a:1"), up("http://b:1")
    policy = DefaultPolicy(KVAware(idx, lambda: 4))
    policy.sticky["s1"] = "a:1"
    calls = []
    sticky = RouteRequest("chat", "s1", None, lambda: calls.append(1))
    assert not policy.needs_keys(sticky)
    assert (policy.choose(sticky, [a, b]).reason, calls) == ("stickiness", [])  # a not indexed
    idx.store("a:1", [b"a%d" % i for i in range(8)])
    idx.store("b:1", [b"b%d" % i for i in range(8)])
    idx.apply("a:1", batch(BlockRemoved(block_hashes=[b"a0", b"a1"], medium=MEDIUM_GPU)))
    idx.apply("b:1", batch(BlockRemoved(block_hashes=[b"b0"], medium=MEDIUM_GPU)))
    sticky = RouteRequest("chat", "s1", None, lambda: calls.append(1))
    assert not policy.needs_keys(sticky)  # b evicts half of what a does: not less
    assert (policy.choose(sticky, [a, b]).reason, calls) == ("stickiness", [])
    idx.apply("a:1", batch(BlockRemoved(block_hashes=[b"a2"], medium=MEDIUM_GPU)))
    assert policy.needs_keys(RouteRequest("chat", "s1"))  # 1 < 0.5 x 3: worth a look


def test_live_sessions_heap_stays_bounded_by_the_sessions():
    now = [0.0]
    live = LiveSessions(window_s=300.0, clock=lambda: now[0])
    for i in range(2000):  # two sessions, many turns: each turn supersedes a heap entry
        now[0] = i * 0.5
        live.seen(f"s{i % 2}", "a")
    assert len(live._heap) <= 2 * 2 + 64 and live.counts() == {"a": 2}
    now[0] = 2000.0  # both silent for far more than 4 gaps of 1 s
    assert live.counts() == {"a": 0}
