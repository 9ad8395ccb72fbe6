"""Scheduler invariants over randomized runs, and the tier connector's verdicts (GO/WAIT/FULL),
against the fakes in tests/engine/sched/fakes.py. CI runs hypothesis derandomized (CI=true)."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from loomserve.engine.sched.request import RequestStatus
from loomserve.engine.sched.scheduler import Scheduler
from loomserve.kv.connector import FULL, GO, WAIT
from tests.engine.sched.fakes import (
    FakeConnector,
    FakeKV,
    FakeRunner,
    make_request,
    scheduled,
    step,
)

ABORT = RequestStatus.FINISHED_ABORTED
BS = 4


def check_invariants(sched: Scheduler, kv: FakeKV, reqs: list) -> None:
    """The scheduler docstring's invariants, plus the pool's."""
    waiting = {r.request_id for r in sched.waiting}
    running = {r.request_id for r in sched.running}
    assert len(waiting) == len(sched.waiting) and len(running) == len(sched.running)
    assert len(running) <= sched.max_num_seqs
    for r in reqs:
        rid = r.request_id
        places = (rid in waiting, rid in running, r.status.finished)
        assert sum(places) == 1, (rid, places)
        if r.status.finished:
            assert rid not in sched.requests and kv.held(rid) == 0
        elif rid in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert kv.held(rid) == 0 and r.num_computed_tokens == 0
        else:
            assert r.status == RequestStatus.RUNNING and sched.requests[rid] is r
            assert r.num_computed_tokens <= kv.held(rid) * BS
    held = [b for blocks in kv.blocks.values() for b in blocks]
    assert len(held) == len(set(held)) <= kv.num_blocks


def run_step(sched: Scheduler, kv: FakeKV, runner: FakeRunner, reqs: list,
             abort_mid: int | None = None) -> None:
    """One step, checking what the step scheduled against the state before it; abort_mid
    aborts one of the scheduled requests while the step 'runs'."""
    before = [r.request_id for r in sched.running]
    was_running = set(before)
    out = sched.schedule()
    mi = out.model_input
    assert mi.num_tokens <= sched.max_num_batched_tokens
    got = [rid for rid, _ in scheduled(out)]
    old = [rid for rid in got if rid in was_running]
    assert got[:len(old)] == old == [rid for rid in before if rid in old]  # running first
    preempted = {r.request_id for r in out.preempted}
    assert preempted <= was_running and not preempted & set(got)
    if preempted:
        assert got == old, "admitted in a step that preempted"
    for seq, (req, n) in zip(mi.seqs, out.scheduled):
        assert seq.start_pos == req.num_computed_tokens and len(seq.token_ids) == n
        assert seq.sample == (seq.start_pos + n == req.num_tokens)
        if req.request_id not in was_running:  # admitted now: its cached prefix is claimed
            assert seq.start_pos == kv.hit_length(req.all_token_ids)
        if sched.long_prefill_threshold:
            assert n <= sched.long_prefill_threshold
    if abort_mid is not None and out.scheduled:
        victim = out.scheduled[abort_mid % len(out.scheduled)][0]
        sched.finish(victim, ABORT)
    sampled = runner.execute(mi).sampled if mi.seqs else {}
    output_counts = {r.request_id: r.num_output_tokens for r in reqs}
    produced = {r.request_id: t for r, t in sched.update(out, sampled)}
    for r in reqs:
        grew = r.num_output_tokens - output_counts[r.request_id]
        assert grew == len(produced.get(r.request_id, ()))
        assert grew == 0 or r.status != ABORT  # aborted while the step ran: no token
        if grew and not r.status.finished:  # only the token just sampled is left to compute
            assert r.num_computed_tokens == r.num_tokens - 1
    check_invariants(sched, kv, reqs)


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 24), st.integers(1, 6)),
    st.tuples(st.just("step"), st.none() | st.integers(0, 7)),
    st.tuples(st.just("abort"), st.integers(0, 63)),
    st.tuples(st.just("cache"), st.integers(1, 6)),
), max_size=50)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(8, 14), budget=st.integers(1, 20),
       max_seqs=st.integers(1, 5), threshold=st.sampled_from([0, 3, 8]))
# r1 preempts itself with a 5-token chunk after holding 2 blocks: it would fit right away
@example(ops=[("add", 15, 3), ("add", 13, 1)], num_blocks=8, budget=6, max_seqs=2, threshold=0)
def test_invariants_hold_after_every_step(ops, num_blocks, budget, max_seqs, threshold):
    kv, runner = FakeKV(num_blocks, BS), FakeRunner(BS)
    sched = Scheduler(kv, budget, max_seqs, threshold)
    reqs = []
    for op in ops:
        if op[0] == "add":  # prompts share a head, so cached prefixes hit several requests
            req = make_request(f"r{len(reqs)}", list(range(op[1])), max_tokens=op[2])
            reqs.append(req)
            sched.add(req)
        elif op[0] == "step":
            run_step(sched, kv, runner, reqs, abort_mid=op[1])
        elif op[0] == "abort":
            live = list(sched.requests.values())
            if live:
                sched.finish(live[op[1] % len(live)], ABORT)
        else:
            kv.cache_prefix(list(range(op[1] * BS)))
        check_invariants(sched, kv, reqs)
    for _ in range(2000):
        if not sched.has_work():
            break
        run_step(sched, kv, runner, reqs)
    assert not sched.has_work() and kv.num_held == 0
    for r in reqs:
        assert r.status in (ABORT, RequestStatus.FINISHED_LENGTH)
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens
    assert len(runner.finished) == len(set(runner.finished))


# -- tier verdicts ---------------------------------------------------------------------------
def tiered(num_blocks: int = 64, budget: int = 64, tier_tokens: int = 0):
    log: list[tuple] = []
    kv = FakeKV(num_blocks, BS, log=log)
    conn = FakeConnector(log=log, tier_tokens=tier_tokens)
    return Scheduler(kv, budget, 8, tiers=conn), kv, conn, log


def test_wait_skips_the_request_and_admits_the_ones_behind_it():
    sched, kv, conn, log = tiered()
    for rid in "abc":
        sched.add(make_request(rid, 4))
    conn.verdicts["a"] = WAIT
    out, _ = step(sched, FakeRunner())
    assert scheduled(out) == [("b", 4), ("c", 4)] and [r.request_id for r in sched.waiting] == ["a"]
    assert ("get_computed_blocks", "a") not in log and kv.held("a") == 0
    assert [c[1] for c in log if c[0] == "on_admit"] == ["b", "c"]
    conn.verdicts["a"] = GO
    out, _ = step(sched, FakeRunner())
    assert scheduled(out) == [("b", 1), ("c", 1), ("a", 4)] and not sched.waiting


def test_full_stops_admission_for_the_step():
    sched, _, conn, log = tiered()
    for rid in "abc":
        sched.add(make_request(rid, 4))
    conn.verdicts["b"] = FULL
    out, _ = step(sched, FakeRunner())
    assert scheduled(out) == [("a", 4)] and [r.request_id for r in sched.waiting] == ["b", "c"]
    assert ("prepare", "c") not in log and ("get_computed_blocks", "b") not in log
    del conn.verdicts["b"]
    out, _ = step(sched, FakeRunner())
    assert scheduled(out) == [("a", 1), ("b", 4), ("c", 4)]


def test_go_admits_and_tier_tokens_are_counted_once():
    sched, kv, _, log = tiered(num_blocks=4, tier_tokens=4)
    a, b = make_request("a", 7, max_tokens=3), make_request("b", 7, max_tokens=3)
    kv.cache_prefix(b.prompt_token_ids[:4])
    sched.add(a)
    sched.add(b)
    assert log == [("on_add", "a"), ("on_add", "b")]
    runner = FakeRunner()
    step(sched, runner)
    assert ("on_admit", "b", 4, True) in log and b.num_tier_cached_tokens == 4
    assert ("on_admit", "a", 0, True) in log and a.num_tier_cached_tokens == 0
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.preempted == [b]
    step(sched, runner)  # b's re-admission: not counted again
    assert ("on_admit", "b", 4, False) in log and b.num_tier_cached_tokens == 4
    assert sum(c[:2] == ("on_admit", "b") for c in log) == 2


def test_on_finish_comes_before_free_and_says_whether_aborted():
    sched, _, _, log = tiered()
    a, b = make_request("a", 4, max_tokens=1), make_request("b", 4, max_tokens=5)
    sched.add(a)
    sched.add(b)
    step(sched, FakeRunner())
    assert a.status == RequestStatus.FINISHED_LENGTH
    sched.finish(b, ABORT)
    ends = [c for c in log if c[0] in ("on_finish", "free")]
    assert ends == [("on_finish", "a", False), ("free", "a"),
                    ("on_finish", "b", True), ("free", "b")]
