"""Scheduling policies over a real KVCacheManager with a fake step cost model: admission order
(cache_aware, priority, fcfs), the aging bound, the step-time budget, the preemption victim,
and a property test that every admitted request finishes under random arrivals."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomserve.engine.sched.preemption import choose_victim
from loomserve.engine.sched.request import Request, RequestStatus
from loomserve.engine.sched.scheduler import Scheduler
from loomserve.engine.sched.step_budget import AUTO_TARGET_MULT
from loomserve.kv.cache_manager import KVCacheManager, RetentionConfig
from loomserve.sampling_params import SamplingParams
from tests.engine.sched.fakes import FakeRunner, step
from tests.kv.conftest import make_config

BS = 4


class FakeCost:
    """Seconds = fixed + per_token x new tokens + per_pair x attention pairs (exact, fixed)."""

    def __init__(self, fixed: float = 1.0, per_token: float = 1.0, per_pair: float = 0.0):
        self.w = np.array([fixed, per_token, per_pair, 0.0, 0.0, 0.0])

    def predict(self, v) -> float:
        return float(self.w @ v)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def req(rid, prompt, max_tokens=4, priority=0, session=None) -> Request:
    if isinstance(prompt, int):
        base = 1000 * (sum(map(ord, rid)) % 97)
        prompt = [base + i for i in range(prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens,
                   priority=priority, session_id=session)


def make(num_blocks=64, budget=64, seqs=8, policy="cache_aware", target_ms=0, cost=None,
         postpone_ms=10_000.0, kv=None, threshold=0):
    kv = kv or KVCacheManager(make_config(num_blocks, BS))
    clock = Clock()
    sched = Scheduler(kv, budget, seqs, threshold, policy=policy, cost_model=cost,
                      target_step_ms=target_ms, max_postpone_ms=postpone_ms, clock=clock)
    return sched, kv, clock


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def drain(sched, runner, clock=None, max_steps=500) -> int:
    for n in range(max_steps):
        if not sched.has_work():
            return n
        step(sched, runner)
        if clock is not None:
            clock.t += 1
    raise AssertionError("did not drain")


SYSTEM = list(range(5000, 5040))  # a 40-token cached context (10 blocks)


# -- admission order -------------------------------------------------------------------------
def warm_then_cold(policy):
    sched, kv, clock = make(seqs=1, budget=16, policy=policy)
    runner = FakeRunner(BS)
    sched.add(req("w0", SYSTEM + [1, 2], max_tokens=1))
    drain(sched, runner)  # SYSTEM is now cached
    sched.add(req("cold", 42, max_tokens=1))
    sched.add(req("warm", SYSTEM + [7, 8], max_tokens=1))
    out, _ = step(sched, runner)
    return [r.request_id for r, _ in out.scheduled]


def test_cache_aware_admits_the_warm_turn_before_an_earlier_cold_prefill():
    assert warm_then_cold("cache_aware") == ["warm"]
    assert warm_then_cold("fcfs") == ["cold"]
    assert warm_then_cold("priority") == ["cold"]  # priority alone ignores the cache


def test_priority_field_orders_before_the_cache_and_arrival():
    for policy, want in (("cache_aware", ["hi", "lo", "mid"]), ("priority", ["hi", "lo", "mid"]),
                         ("fcfs", ["lo", "mid", "hi"])):
        sched, _, _ = make(policy=policy)
        sched.add(req("lo", 8, priority=0))
        sched.add(req("mid", 4, priority=5))
        sched.add(req("hi", 12, priority=-1))
        assert ids(sched.waiting.order()) == want, policy


def test_cache_aware_prefers_less_uncached_work_then_arrival():
    sched, _, _ = make()
    sched.add(req("big", 40))
    sched.add(req("small", 8))
    sched.add(req("small2", 8))
    assert ids(sched.waiting.order()) == ["small", "small2", "big"]


def test_aging_puts_a_postponed_request_first_whatever_its_priority_or_work():
    sched, _, clock = make(postpone_ms=5_000)
    sched.add(req("cold", 40, priority=3))
    clock.t = 4.0
    sched.add(req("warm", 4, priority=0))
    assert ids(sched.waiting.order()) == ["warm", "cold"]
    clock.t = 5.0  # cold has waited the bound
    assert ids(sched.waiting.order()) == ["cold", "warm"]
    clock.t = 9.5  # both aged: oldest first
    assert ids(sched.waiting.order()) == ["cold", "warm"]


def test_aging_bounds_postponement_under_a_stream_of_warm_turns():
    """One cold request, a warm one arriving every step: the cold one is admitted by the step
    at which it has waited max_postpone (clock = steps)."""
    sched, kv, clock = make(seqs=1, budget=64, postpone_ms=6_000)
    runner = FakeRunner(BS)
    sched.add(req("cold", 40, max_tokens=1))
    admitted_at = None
    for k in range(20):
        sched.add(req(f"w{k}", 4, max_tokens=1))
        out, _ = step(sched, runner)
        if any(r.request_id == "cold" for r, _ in out.scheduled):
            admitted_at = clock.t
            break
        clock.t += 1
    assert admitted_at == 6.0


def test_sessions_with_a_recent_turn_or_a_pin_count_as_warm():
    sched, kv, clock = make()
    runner = FakeRunner(BS)
    sched.add(req("a1", 8, max_tokens=1, session="S"))
    drain(sched, runner)
    a2, other = req("a2", 30, session="S"), req("x", 30, session="T")
    assert sched.waiting.is_warm(a2) and not sched.waiting.is_warm(other)
    clock.t = 61.0  # past the warm window
    assert not sched.waiting.is_warm(a2)
    pinned_kv = KVCacheManager(make_config(64, BS),
                               retention=RetentionConfig(pin_ttl_s=600, pin_budget_bytes=10**9))
    sched, kv, clock = make(kv=pinned_kv)
    sched.add(req("p1", 9, max_tokens=1, session="P"))
    drain(sched, runner)
    clock.t = 1000.0
    assert kv.pins.blocks("P") and sched.waiting.is_warm(req("p2", 9, session="P"))


# -- the step-time budget --------------------------------------------------------------------
def test_fixed_target_cuts_a_prefill_to_whole_blocks_after_the_decodes():
    # cost = 1 + tokens; target 15: 8 decodes (9) leave 6 tokens -> one whole block of 4
    sched, kv, clock = make(budget=256, seqs=16, target_ms=0, cost=FakeCost(), threshold=16)
    runner = FakeRunner(BS)
    for k in range(8):
        sched.add(req(f"d{k}", 4, max_tokens=50))
    step(sched, runner)  # all prefilled in one step (no time limit yet)
    sched.target_step_ms = 15_000
    sched.add(req("long", 100, max_tokens=1))
    out, _ = step(sched, runner)
    assert dict((r.request_id, n) for r, n in out.scheduled)["long"] == 4
    assert out.target_s == 15.0 and FakeCost().predict(out.features) <= 15.0


def test_auto_target_is_a_multiple_of_the_decodes_and_keeps_one_block_of_prefill():
    sched, kv, clock = make(budget=512, target_ms=None, cost=FakeCost(), threshold=8)
    runner = FakeRunner(BS)
    for k in range(4):
        sched.add(req(f"d{k}", 4, max_tokens=50))
    step(sched, runner)
    sched.add(req("long", 200, max_tokens=1))
    out, _ = step(sched, runner)
    sizes = dict((r.request_id, n) for r, n in out.scheduled)
    assert out.target_s == AUTO_TARGET_MULT * (1 + 4)  # x (fixed + 4 decode tokens)
    assert sizes["long"] == 4  # 12.5 - 5 leaves 7.5 tokens: cut to a whole block
    # a target smaller than the decodes alone still admits one block (no starvation)
    sched.target_step_ms = 1.0
    out, _ = step(sched, runner)
    assert dict((r.request_id, n) for r, n in out.scheduled)["long"] == BS


def test_a_warm_turn_takes_the_spare_time_before_a_running_cold_prefill():
    sched, kv, clock = make(num_blocks=256, budget=512, target_ms=None, cost=FakeCost(),
                            threshold=8)
    runner = FakeRunner(BS)
    sched.add(req("w0", SYSTEM + [1, 2], max_tokens=1))
    drain(sched, runner)  # SYSTEM cached
    for k in range(4):
        sched.add(req(f"d{k}", 4, max_tokens=60))
    step(sched, runner)
    sched.add(req("cold", 200, max_tokens=1))
    out, _ = step(sched, runner)
    assert ("cold", 4) in [(r.request_id, n) for r, n in out.scheduled]  # running, chunked
    sched.add(req("warm", SYSTEM + [7, 8, 9], max_tokens=1))
    out, _ = step(sched, runner)
    sizes = dict((r.request_id, n) for r, n in out.scheduled)
    # warm first and whole (short): 5 + 3 leaves 4.5 tokens of the target (12.5) for cold
    assert sizes["warm"] == 3 and sizes["cold"] == 4
    cold = sched.requests["cold"]
    while cold.num_computed_tokens < 200:  # still at least a block per step
        out, _ = step(sched, runner)
        assert dict((r.request_id, n) for r, n in out.scheduled)["cold"] >= 2
    assert not out.preempted and sched.num_preemptions == 0


def test_a_running_prefill_ages_from_its_last_chunk_not_its_arrival():
    """A cold prefill served for longer than max_postpone still yields the step's spare time to
    a later warm turn (it is not postponed while it gets chunks); one that got nothing for
    max_postpone goes first."""
    sched, kv, clock = make(num_blocks=256, budget=512, target_ms=None, cost=FakeCost(),
                            postpone_ms=5_000, threshold=8)
    runner = FakeRunner(BS)
    sched.add(req("w0", SYSTEM + [1, 2], max_tokens=1))
    drain(sched, runner)
    for k in range(4):
        sched.add(req(f"d{k}", 4, max_tokens=60))
    step(sched, runner)
    sched.add(req("cold", 200, max_tokens=1))
    for _ in range(12):  # served every step for 12 s, past the 5 s bound
        step(sched, runner)
        clock.t += 1
    sched.add(req("warm", SYSTEM + [7, 8, 9], max_tokens=1))
    out, _ = step(sched, runner)
    assert dict((r.request_id, n) for r, n in out.scheduled)["warm"] == 3
    cold = sched.requests["cold"]
    assert sched.waiting.key(cold, 1)[0] == 1  # just progressed: not aged
    clock.t += 5
    assert sched.waiting.key(cold, 1) == (0, clock.t - 5)  # 5 s without a chunk: first


def test_a_short_prefill_goes_whole_and_a_long_one_is_cut_to_the_target():
    """Long or short is decided at admission from the uncached work against the long-prefill
    threshold (8): a warm turn with 7 new tokens over a cached context goes whole past a 6 s
    target; a 40-token cold prompt gets one block per step (the floor of the step's first long
    chunk), its last 8 tokens too."""
    sched, kv, clock = make(num_blocks=256, budget=512, target_ms=0, cost=FakeCost(),
                            threshold=8)
    runner = FakeRunner(BS)
    sched.add(req("w0", SYSTEM + [1, 2], max_tokens=1))
    drain(sched, runner)
    sched.add(req("d", 4, max_tokens=60))
    step(sched, runner)
    sched.target_step_ms = 6_000  # fixed 1 + 1 decode leaves 4 tokens
    warm, cold = req("warm", SYSTEM + list(range(7)), max_tokens=1), req("cold", 40, max_tokens=1)
    sched.add(warm)
    sched.add(cold)
    out, _ = step(sched, runner)
    sizes = dict((r.request_id, n) for r, n in out.scheduled)
    assert sizes["warm"] == 7 and sizes["cold"] == BS  # past the target: cold gets the floor
    assert not warm.long_prefill and cold.long_prefill
    chunks = []
    while cold.num_output_tokens == 0:
        out, _ = step(sched, runner)
        chunks += [n for r, n in out.scheduled if r.request_id == "cold"]
    assert chunks == [BS] * 9  # one block per step to the end, never a whole 8-token chunk


def test_short_prefills_go_whole_together_and_a_long_one_gets_what_is_left():
    sched, kv, clock = make(num_blocks=256, budget=512, target_ms=0, cost=FakeCost(),
                            threshold=8)
    runner = FakeRunner(BS)
    sched.add(req("d", 4, max_tokens=60))
    step(sched, runner)
    sched.target_step_ms = 12_000  # fixed 1 + 1 decode leaves 10 tokens
    for rid, n in (("a", 7), ("b", 5), ("long", 40)):
        sched.add(req(rid, n, max_tokens=1))
    out, _ = step(sched, runner)
    # b and a (short) whole, past the target; long: nothing fits, the floor block
    assert dict((r.request_id, n) for r, n in out.scheduled) == {"d": 1, "b": 5, "a": 7,
                                                                  "long": BS}
    out, _ = step(sched, runner)
    assert dict((r.request_id, n) for r, n in out.scheduled) == {"d": 1, "long": 8}


def test_target_zero_is_the_token_budget_alone():
    sched, kv, clock = make(budget=64, target_ms=0, cost=FakeCost())
    runner = FakeRunner(BS)
    sched.add(req("d", 4, max_tokens=50))
    step(sched, runner)
    sched.add(req("long", 200, max_tokens=1))
    out, _ = step(sched, runner)
    assert [n for _, n in out.scheduled] == [1, 63] and out.target_s is None


# -- the preemption victim -------------------------------------------------------------------
def running_with(kv, specs):
    """Requests admitted and computed to the given token counts (cached as they fill)."""
    reqs = []
    for rid, n, extra in specs:
        r = req(rid, n + extra, **({} if rid[0] != "p" else {"session": "P"}))
        assert kv.allocate_slots(r, n)
        r.num_computed_tokens = n
        reqs.append(r)
    return reqs


def test_victim_is_the_cheapest_recompute_given_what_stays_cached():
    kv = KVCacheManager(make_config(32, BS))
    a, b = running_with(kv, [("a", 17, 3), ("b", 23, 3)])  # 5 and 6 blocks held
    # deficit 1: a keeps 4 blocks (recomputes 1 token), b keeps 5 (recomputes 3)
    assert choose_victim(None, [a, b], kv, 1) is a
    # deficit 3: a keeps 2 blocks (recomputes 9 tokens), b keeps 3 (recomputes 11)
    assert choose_victim(None, [a, b], kv, 3) is a
    # deficit 6: only b's blocks suffice alone
    assert choose_victim(None, [a, b], kv, 6) is b
    # the cost model decides, not the token count: here a kept context of 20+ is free
    cheap_long = lambda ctx, new: 0.0 if ctx >= 20 else float(new)  # noqa: E731
    assert choose_victim(None, [a, b], kv, 1, cheap_long) is b
    assert choose_victim("me", [], kv, 1) == "me"  # no candidate: the requester


def test_victim_prefers_lower_priority_and_spares_pinned_sessions():
    kv = KVCacheManager(make_config(64, BS),
                        retention=RetentionConfig(pin_ttl_s=600, pin_budget_bytes=10**9))
    a, b = running_with(kv, [("a", 17, 3), ("b", 40, 3)])
    b.priority = 2
    assert choose_victim(None, [a, b], kv, 1) is b  # lower priority first, however costly
    b.priority = 0
    p, c = running_with(kv, [("p", 9, 3), ("c", 30, 3)])
    protect = lambda r: r.request_id == "p"  # noqa: E731
    assert choose_victim(None, [p, c], kv, 1) is p  # cheapest
    assert choose_victim(None, [p, c], kv, 1, protected=protect) is c
    (s,) = running_with(kv, [("s", 5, 3)])  # 2 blocks
    assert choose_victim(None, [p, s], kv, 2, protected=protect) is s
    # the unprotected together cannot free 3 blocks: the pinned one (3 blocks) goes
    assert choose_victim(None, [p, s], kv, 3, protected=protect) is p


def test_scheduler_preempts_the_cheapest_and_counts_the_cause():
    sched, kv, clock = make(num_blocks=12, budget=64, policy="cache_aware")
    runner = FakeRunner(BS)
    sched.add(req("a", 8, max_tokens=20))  # 2 blocks, grows
    sched.add(req("b", 24, max_tokens=12))  # 6 blocks, grows to 9: both cannot finish at once
    step(sched, runner)
    preempted = []
    for _ in range(30):
        out, _ = step(sched, runner)
        preempted += ids(out.preempted)
        if preempted:
            break
    assert preempted and sched.preemptions_by_cause["decode_blocks"] == len(preempted)
    assert sum(sched.preemptions_by_cause.values()) == sched.num_preemptions
    drain(sched, runner)
    assert kv.num_free_blocks == kv.num_usable_blocks


# -- property: no starvation, invariants -----------------------------------------------------
ARRIVALS = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40), st.integers(0, 3),
                              st.integers(1, 6), st.integers(-1, 2)), min_size=1, max_size=14)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=ARRIVALS, num_blocks=st.integers(15, 30),
       policy=st.sampled_from(["cache_aware", "priority", "fcfs"]),
       target=st.sampled_from([None, 0, 6_000, 30_000]), budget=st.integers(4, 32))
def test_every_admitted_request_finishes_and_invariants_hold(arrivals, num_blocks, policy,
                                                             target, budget):
    """(arrival step, prompt tokens, cached share in blocks of SYSTEM, max tokens, priority):
    every request finishes within a bound of steps of its arrival, each sits in exactly one
    queue, and every block is free at the end."""
    sched, kv, clock = make(num_blocks=num_blocks, budget=budget, seqs=4, policy=policy,
                            target_ms=target, cost=FakeCost(), postpone_ms=8_000, threshold=8)
    runner = FakeRunner(BS)
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    reqs, arrived, done = [], {}, {}
    total = sum(a[1] + a[3] for a in arrivals) + 1
    for t in range(5000):
        clock.t = float(t)
        while pending and pending[0][1][0] <= t:
            i, (_, n, share, max_tokens, prio) = pending.pop(0)
            prompt = SYSTEM[:share * BS] + [10_000 * (i + 1) + k for k in range(n)]
            r = req(f"r{i}", prompt, max_tokens=max_tokens, priority=prio)
            reqs.append(r)
            arrived[r.request_id] = t
            sched.add(r)
        if not pending and not sched.has_work():
            break
        step(sched, runner)
        waiting, running = set(ids(sched.waiting)), set(ids(sched.running))
        assert not waiting & running and len(waiting) == len(sched.waiting)
        for r in reqs:
            if r.status.finished:
                done.setdefault(r.request_id, t)
                assert r.request_id not in waiting | running
            else:
                assert (r.request_id in waiting) != (r.request_id in running)
    assert not sched.has_work() and not pending
    assert kv.num_free_blocks == kv.num_usable_blocks
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert done[r.request_id] - arrived[r.request_id] <= 8 + 2 * total
