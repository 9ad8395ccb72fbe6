"""Scheduler unit tests against a fake KV manager and a fake runner (tests/engine/sched/fakes.py):
continuous batching, chunked prefill, the long-prefill cap, prefix hits, preemption, finishing.
The randomized invariants and the tier verdicts are in test_scheduler_props.py."""

from __future__ import annotations

from loomserve.engine.sched.request import RequestStatus
from loomserve.engine.sched.scheduler import Scheduler
from tests.engine.sched.fakes import FakeKV, FakeRunner, make_request, scheduled, step

ABORT = RequestStatus.FINISHED_ABORTED


def ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


def drain(sched: Scheduler, runner: FakeRunner, before=(), max_steps: int = 200
          ) -> dict[str, list[int]]:
    """Step until no work is left; the tokens each request produced (before: the update()
    results of earlier steps), in order."""
    produced: dict[str, list[int]] = {}
    for req, tokens in before:
        produced.setdefault(req.request_id, []).extend(tokens)
    for _ in range(max_steps):
        if not sched.has_work():
            return produced
        for req, tokens in step(sched, runner)[1]:
            produced.setdefault(req.request_id, []).extend(tokens)
    raise AssertionError("the scheduler did not drain")


# -- continuous batching ---------------------------------------------------------------------
def test_running_first_in_admission_order_then_waiting_within_budget_and_max_num_seqs():
    kv, runner = FakeKV(64), FakeRunner()
    sched = Scheduler(kv, max_num_batched_tokens=10, max_num_seqs=3)
    for rid in "abcd":
        sched.add(make_request(rid, 4, max_tokens=8))
    out, _ = step(sched, runner)
    assert scheduled(out) == [("a", 4), ("b", 4), ("c", 2)]  # c is chunked by the budget
    assert [s.request_id for s in out.model_input.seqs] == ["a", "b", "c"]
    assert ids(sched.running) == ["a", "b", "c"] and ids(sched.waiting) == ["d"]
    out, _ = step(sched, runner)
    assert scheduled(out) == [("a", 1), ("b", 1), ("c", 2)]  # max_num_seqs keeps d out
    sched.finish(sched.requests["a"], ABORT)
    out, _ = step(sched, runner)
    assert scheduled(out) == [("b", 1), ("c", 1), ("d", 4)]
    assert ids(sched.running) == ["b", "c", "d"] and not sched.waiting


def test_budget_stops_the_running_pass_without_preempting():
    kv, runner = FakeKV(64), FakeRunner()
    sched = Scheduler(kv, max_num_batched_tokens=3, max_num_seqs=8)
    for rid in "abc":
        sched.add(make_request(rid, 1, max_tokens=5))
    step(sched, runner)
    sched.add(make_request("d", 1))
    sched.max_num_batched_tokens = 2
    out, _ = step(sched, runner)
    assert scheduled(out) == [("a", 1), ("b", 1)] and out.model_input.num_tokens == 2
    assert not out.preempted and ids(sched.running) == ["a", "b", "c"]
    assert ids(sched.waiting) == ["d"] and kv.held("c") == 1


def test_chunked_prefill_advances_one_chunk_per_step():
    kv, runner = FakeKV(64), FakeRunner()
    sched = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=4)
    req = make_request("a", 20, max_tokens=2)
    sched.add(req)
    prompt = list(req.prompt_token_ids)
    for start, n, held in ((0, 8, 2), (8, 8, 4), (16, 4, 5)):
        out, produced = step(sched, runner)
        (seq,) = out.model_input.seqs
        assert (seq.start_pos, seq.token_ids) == (start, prompt[start:start + n])
        assert seq.sample == (start + n == 20) and bool(produced) == seq.sample
        assert req.num_computed_tokens == start + n and kv.held("a") == held
    out, _ = step(sched, runner)
    assert scheduled(out) == [("a", 1)] and out.model_input.seqs[0].start_pos == 20
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 2


def test_long_prefill_cap_lets_short_requests_into_the_same_step():
    def first_step(threshold: int):
        sched = Scheduler(FakeKV(64), max_num_batched_tokens=16, max_num_seqs=8,
                          long_prefill_threshold=threshold)
        for rid, n in (("long", 40), ("s1", 3), ("s2", 6)):
            sched.add(make_request(rid, n))
        return sched, step(sched, FakeRunner())[0]

    _, out = first_step(0)
    assert scheduled(out) == [("long", 16)]  # without the cap the long prefill starves them
    sched, out = first_step(6)
    assert scheduled(out) == [("long", 6), ("s1", 3), ("s2", 6)]
    runner = FakeRunner()
    for _ in range(3):
        out, _ = step(sched, runner)
        assert dict(scheduled(out))["long"] == 6
        assert out.model_input.num_tokens <= 16


# -- prefix hits -----------------------------------------------------------------------------
def test_cached_prefix_is_claimed_and_only_the_rest_computed():
    kv, runner = FakeKV(64), FakeRunner()
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    req = make_request("a", 10)
    kv.cache_prefix(req.prompt_token_ids[:8])
    sched.add(req)
    out, _ = step(sched, runner)
    (seq,) = out.model_input.seqs
    assert (seq.start_pos, seq.token_ids, seq.sample) == (8, req.prompt_token_ids[8:], True)
    assert ("allocate_slots", "a", 2, 8, True) in kv.calls and kv.held("a") == 3
    assert req.num_cached_tokens == 8 and req.num_computed_tokens == 10
    assert (kv.stats.prefix_queried_tokens, kv.stats.prefix_hit_tokens) == (10, 8)


def test_a_fully_cached_prompt_still_computes_its_last_block():
    kv = FakeKV(64)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    req = make_request("a", 8)
    kv.cache_prefix(req.prompt_token_ids)
    sched.add(req)
    out, produced = step(sched, FakeRunner())
    assert scheduled(out) == [("a", 4)] and out.model_input.seqs[0].start_pos == 4
    assert req.num_cached_tokens == 4 and len(produced) == 1


def test_num_cached_tokens_is_set_at_first_admission_only():
    kv, runner = FakeKV(4), FakeRunner()
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    a, b = make_request("a", 7, max_tokens=3), make_request("b", 7, max_tokens=3)
    kv.cache_prefix(b.prompt_token_ids[:4])
    sched.add(a)
    sched.add(b)
    step(sched, runner)
    assert b.num_cached_tokens == 4 and kv.num_held == 4
    step(sched, runner)
    out, _ = step(sched, runner)  # a needs a third block: b, admitted last, goes
    assert out.preempted == [b] and b.status == RequestStatus.PREEMPTED
    assert a.status == RequestStatus.FINISHED_LENGTH
    kv.cache_prefix(b.all_token_ids[:8])  # b's recompute now hits more
    out, _ = step(sched, runner)
    assert scheduled(out) == [("b", 1)] and ("allocate_slots", "b", 1, 8, True) in kv.calls
    assert b.num_cached_tokens == 4 and b.num_preemptions == 1
    assert (kv.stats.prefix_queried_tokens, kv.stats.prefix_hit_tokens) == (14, 4)


def test_without_caching_stats_are_left_alone():
    kv = FakeKV(64, enable_caching=False)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    req = make_request("a", 10)
    kv.cache_prefix(req.prompt_token_ids)
    sched.add(req)
    out, _ = step(sched, FakeRunner())
    assert scheduled(out) == [("a", 10)] and req.num_cached_tokens == 0
    assert kv.stats.prefix_queried_tokens == 0


# -- preemption ------------------------------------------------------------------------------
def test_most_recently_admitted_is_preempted_and_requests_come_back():
    kv, runner = FakeKV(3), FakeRunner()
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8)
    reqs = {rid: make_request(rid, 4, max_tokens=m) for rid, m in (("a", 4), ("b", 3), ("c", 3))}
    for r in reqs.values():
        sched.add(r)
    _, first = step(sched, runner)
    assert kv.num_held == 3
    out, second = step(sched, runner)  # a needs a 2nd block: c goes, then b (preempts itself)
    assert scheduled(out) == [("a", 1)] and ids(out.preempted) == ["c", "b"]
    assert ids(sched.waiting) == ["b", "c"] and ids(sched.running) == ["a"]
    for r in (reqs["b"], reqs["c"]):
        assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
        assert kv.held(r.request_id) == 0 and ("free", r.request_id) in kv.calls
    assert sched.num_preemptions == 2
    produced = drain(sched, runner, first + second)
    for rid, r in reqs.items():
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert produced[rid] == r.output_token_ids and r.num_output_tokens == r.max_tokens
    # b's recompute was a prefill of its prompt plus the token it had already sampled
    redo = next(s for mi in runner.inputs[2:] for s in mi.seqs if s.request_id == "b")
    assert redo.start_pos == 0 and redo.token_ids == reqs["b"].all_token_ids[:5]


def test_self_preemption_and_no_admission_in_a_step_that_preempted():
    kv, runner = FakeKV(4), FakeRunner()
    sched = Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=8)
    a, b = make_request("a", 4, max_tokens=3), make_request("b", 12, max_tokens=2)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched, runner)
    assert scheduled(out) == [("a", 4), ("b", 4)]
    out, _ = step(sched, runner)  # b's 7-token chunk needs 2 more blocks; only 1 is free
    assert scheduled(out) == [("a", 1)] and out.preempted == [b]
    assert ids(sched.waiting) == ["b"] and b.status == RequestStatus.PREEMPTED
    assert kv.held("b") == 0 and b.num_computed_tokens == 0
    # b would have fit right after its preemption (same free blocks, same budget): the rule,
    # not the pool, kept it out; it gets in on the next step
    out, _ = step(sched, runner)
    assert scheduled(out) == [("a", 1), ("b", 7)] and not out.preempted
    drain(sched, runner)
    assert a.num_output_tokens == 3 and b.num_output_tokens == 2 and kv.num_held == 0


# -- finishing -------------------------------------------------------------------------------
def test_stop_token_finishes_and_is_reported_once():
    eos = 999
    runner = FakeRunner(token_fn=lambda s: eos if s.num_output_tokens == 1 else 5)
    kv = FakeKV(64)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    a = make_request("a", 4, max_tokens=10, eos=frozenset({eos}))
    b = make_request("b", 30, max_tokens=10)
    sched.add(a)
    sched.add(b)
    sched.max_num_batched_tokens = 5  # b prefills a chunk per step
    step(sched, runner)
    _, produced = step(sched, runner)
    assert (a, [eos]) in produced and a.status == RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids == [5, eos] and kv.held("a") == 0
    assert "a" not in sched.requests and a not in sched.running
    step(sched, runner)
    step(sched, runner)
    assert [mi.finished_request_ids for mi in runner.inputs] == [[], [], ["a"], []]


def test_max_tokens_finishes_with_length():
    kv, runner = FakeKV(64), FakeRunner()
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    req = make_request("a", 3, max_tokens=3)
    sched.add(req)
    steps = 0
    while sched.has_work():
        step(sched, runner)
        steps += 1
    assert steps == 3 and req.status == RequestStatus.FINISHED_LENGTH
    assert req.num_output_tokens == 3 and kv.num_held == 0 and ("free", "a") in kv.calls


def test_abort_waiting_and_running_requests():
    kv, runner = FakeKV(64), FakeRunner()
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=1)
    a, b, c = (make_request(rid, 4, max_tokens=9) for rid in "abc")
    for r in (a, b, c):
        sched.add(r)
    step(sched, runner)
    assert ids(sched.running) == ["a"] and ids(sched.waiting) == ["b", "c"]
    sched.finish(b, ABORT)
    assert ids(sched.waiting) == ["c"] and "b" not in sched.requests
    assert b.status == ABORT and ("free", "b") in kv.calls
    assert kv.held("a") == 1
    sched.finish(a, ABORT)
    assert not sched.running and kv.held("a") == 0 and "a" not in sched.requests
    out, _ = step(sched, runner)
    assert scheduled(out) == [("c", 4)]
    assert out.model_input.finished_request_ids == ["b", "a"]
    out, _ = step(sched, runner)
    assert out.model_input.finished_request_ids == [] and runner.finished == ["b", "a"]


def test_a_request_aborted_while_its_step_ran_gets_no_token():
    kv, runner = FakeKV(64), FakeRunner()
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sampled = runner.execute(out.model_input).sampled
    assert set(sampled) == {"a", "b"}
    sched.finish(a, ABORT)
    produced = sched.update(out, sampled)
    assert [r for r, _ in produced] == [b] and a.num_output_tokens == 0
    assert a.status == ABORT and a.num_computed_tokens == 0 and kv.held("a") == 0
