"""Miss attribution (loomserve.kv.miss_causes): every uncached prompt token gets exactly one
cause, and each cause comes out of the scenario built to produce it.

Manager-level scenarios drive the real KVCacheManager the way the scheduler does (probe,
allocate, free); the engine-level ones run the tiny models through LLM."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomserve import SamplingParams
from loomserve.kv.cache_manager import KVCacheManager
from loomserve.kv.miss_causes import CAUSES, DropRecord, common_prefix
from loomserve.kv.retention import RetentionConfig
from tests.kv.conftest import Req, make_config, make_hybrid_config

BS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def admit(kv, req, num_new=None):
    """What the scheduler does at a first admission: probe, allocate, attribute."""
    hit, n = kv.get_computed_blocks(req)
    left = len(req.all_token_ids) - n
    assert kv.allocate_slots(req, left if num_new is None else num_new, hit, n)
    req.num_computed_tokens = n + (left if num_new is None else num_new)
    miss = kv.explain_miss(req, n)
    assert miss.total == req.num_prompt_tokens - n, (miss.causes, n)
    return n, miss


def run(kv, req, release=None):
    n, miss = admit(kv, req)
    kv.free(req, release=release) if release else kv.free(req)
    return n, miss


def toks(a, n):
    return list(range(a, a + n))


def test_first_sight_and_partial_block():
    kv = KVCacheManager(make_config(32, BS))
    n, miss = run(kv, Req("a", toks(100, 18)))  # 4 full blocks + 2: cap (17 // 4) * 4 = 16
    assert n == 0 and miss.causes == {"first_sight": 16, "partial_block": 2}
    n, miss = run(kv, Req("b", toks(100, 16)))  # exactly 4 blocks: the last one is computed
    assert n == 12 and miss.causes == {"partial_block": 4}


def test_evicted_by_policy_with_age():
    clock = Clock()
    for policy in ("lru", "flop_aware"):
        kv = KVCacheManager(make_config(9, BS), eviction=policy, clock=clock)
        run(kv, Req("a", toks(100, 16)))
        clock.t = 5.0
        run(kv, Req("b", toks(500, 33)))  # needs all 9 blocks: a's are evicted
        clock.t = 7.5
        n, miss = run(kv, Req("c", toks(100, 17)))
        assert n == 0 and miss.causes == {"evicted": 16, "partial_block": 1}
        assert miss.detail["evicted"]["policy"] == policy
        assert miss.detail["evicted"]["age_s"] == 2.5


def test_evicted_with_tier_is_a_tier_miss():
    kv = KVCacheManager(make_config(9, BS))
    run(kv, Req("a", toks(100, 16)))
    run(kv, Req("b", toks(500, 33)))
    req = Req("c", toks(100, 17))
    hit, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, 17, hit, n)
    assert kv.explain_miss(req, n, tiers=True).causes == {"evicted_tier": 16, "partial_block": 1}


def test_reset_prefix_cache_drops_read_as_evicted():
    """A reset empties the pool: the next miss on what it held is `evicted` (release
    "reset"), not first_sight."""
    clock = Clock()
    kv = KVCacheManager(make_config(32, BS), clock=clock)
    run(kv, Req("a", toks(100, 16)))
    clock.t = 3.0
    assert kv.reset_prefix_cache()
    clock.t = 4.5
    n, miss = run(kv, Req("b", toks(100, 17)))
    assert n == 0 and miss.causes == {"evicted": 16, "partial_block": 1}
    assert miss.detail["evicted"]["release"] == "reset"
    assert miss.detail["evicted"]["age_s"] == 1.5


def test_chain_broken_early_inherits_the_cause():
    """Block 0 evicted, blocks 1..3 still live: all four missed because block 0 was lost."""
    kv = KVCacheManager(make_config(8, BS))
    req = Req("a", toks(100, 16))
    run(kv, req)
    b0 = kv.pool.cached[0][req.block_hashes[0]]
    kv.pool.free_queue.remove(b0)
    kv.pool.free_queue.appendleft(b0)  # next to be reused
    kv.pool.allocate(1)
    n, miss = run(kv, Req("c", toks(100, 17)))
    assert n == 0 and miss.causes == {"evicted": 16, "partial_block": 1}


def test_pin_expired_ttl_and_budget():
    clock = Clock()
    page = make_config(16, BS).page_bytes
    kv = KVCacheManager(make_config(9, BS), clock=clock,
                        retention=RetentionConfig(pin_ttl_s=10.0, pin_budget_bytes=64 * page))
    run(kv, Req("a", toks(100, 17), session_id="s"))  # pins its 4 blocks
    assert len(kv.pins) == 1
    clock.t = 11.0  # the TTL runs out at the next allocation
    run(kv, Req("b", toks(500, 33)))
    n, miss = run(kv, Req("c", toks(100, 17), session_id="s2"))
    assert n == 0 and miss.causes == {"pin_expired": 16, "partial_block": 1}
    # budget: a second session's pin pushes the first one out
    kv = KVCacheManager(make_config(13, BS), clock=clock,
                        retention=RetentionConfig(pin_ttl_s=1e9, pin_budget_bytes=4 * page))
    run(kv, Req("a", toks(100, 17), session_id="s"))
    run(kv, Req("b", toks(300, 17), session_id="t"))  # over budget: s's pin dropped
    run(kv, Req("x", toks(500, 33)))  # takes every free block (t still pins 4)
    n, miss = run(kv, Req("c", toks(100, 17)))
    assert n == 0 and miss.causes == {"pin_expired": 16, "partial_block": 1}


def test_preempted_blocks_evicted():
    kv = KVCacheManager(make_config(9, BS))
    req = Req("a", toks(100, 17))
    admit(kv, req)
    kv.free(req, release="preempted")  # the scheduler's _preempt
    run(kv, Req("b", toks(500, 33)))
    n, miss = run(kv, Req("c", toks(100, 17)))
    assert n == 0 and miss.causes == {"preempted": 16, "partial_block": 1}


def test_preempted_through_the_scheduler():
    """B is preempted (the scheduler marks its blocks), then aborted while waiting; A's decode
    evicts B's blocks; C with B's prompt misses them because of the preemption."""
    from loomserve.engine.sched.request import Request, RequestStatus
    from loomserve.engine.sched.scheduler import Scheduler
    from loomserve.sampling_params import SamplingParams
    from tests.engine.sched.fakes import FakeRunner, step

    kv = KVCacheManager(make_config(10, BS))
    sched = Scheduler(kv, 64, 8)
    runner = FakeRunner(BS)

    def mk(rid, prompt, max_tokens):
        return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens)

    a, b = mk("a", toks(100, 16), 20), mk("b", toks(500, 17), 20)
    sched.add(a)
    sched.add(b)
    while not b.num_preemptions:
        step(sched, runner)
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert b.miss.causes == {"first_sight": 16, "partial_block": 1}
    while a.status == RequestStatus.RUNNING:
        step(sched, runner)
    c = mk("c", toks(500, 17), 1)
    sched.add(c)
    step(sched, runner)
    assert c.num_cached_tokens + c.miss.causes.get("preempted", 0) + 1 == 17
    assert c.miss.causes.get("preempted", 0) > 0


def test_a_hit_clears_the_release_mark():
    kv = KVCacheManager(make_config(9, BS))
    req = Req("a", toks(100, 17))
    admit(kv, req)
    kv.free(req, release="preempted")
    run(kv, Req("a2", toks(100, 17)))  # hits them again, frees them normally
    run(kv, Req("b", toks(500, 33)))
    assert run(kv, Req("c", toks(100, 17)))[1].causes == {"evicted": 16, "partial_block": 1}


def test_diverged_session_history():
    kv = KVCacheManager(make_config(64, BS))
    first = toks(100, 24)
    run(kv, Req("t1", first, session_id="s"))
    edited = first[:6] + [7] + first[7:] + toks(900, 10)  # token 6 edited, 10 tokens added
    n, miss = run(kv, Req("t2", edited, session_id="s"))
    assert n == 4  # block 0 still hits
    # blocks 1..5 (tokens 4..24) diverged from the previous prompt, the new tail first seen
    assert miss.causes == {"diverged": 20, "first_sight": 8, "partial_block": 2}
    assert miss.detail["diverged"] == {"token": 6, "block": 1}


def test_salt_of_another_tenant():
    kv = KVCacheManager(make_config(64, BS))
    run(kv, Req("a", toks(100, 21), cache_salt="tenant-a"))
    n, miss = run(kv, Req("b", toks(100, 17) + [1, 2, 3, 4, 5], cache_salt="tenant-b"))
    assert n == 0 and miss.causes == {"salt": 16, "first_sight": 4, "partial_block": 2}
    # a session that changed its salt
    run(kv, Req("c", toks(300, 9), session_id="s"))
    n, miss = run(kv, Req("d", toks(300, 9), session_id="s", cache_salt="x"))
    assert miss.causes == {"salt": 8, "partial_block": 1}


def test_state_missing_on_hybrid():
    kv = KVCacheManager(make_hybrid_config(40, BS, state=True))
    run(kv, Req("a", toks(100, 24)))  # checkpoint only at its end (block 6)
    n, miss = run(kv, Req("b", toks(100, 20) + [1, 2, 3, 4, 5]))
    # attention blocks 0..4 are live but no state sits at boundary 5: nothing hits
    assert n == 0 and miss.causes == {"state_missing": 20, "first_sight": 4, "partial_block": 1}


def test_drop_record_is_bounded_lru():
    rec = DropRecord(capacity=3, clock=lambda: 1.0)
    for h in (b"a", b"b", b"c", b"a", b"d"):
        rec.note(h, None)
    assert len(rec) == 3 and rec.get(b"b") is None and rec.get(b"a") == (None, 1.0)
    assert rec.ever(b"b" * 8) is False  # never noted
    rec.note(b"b" * 8, None)
    rec.note(b"c" * 8, None)
    rec.note(b"d" * 8, None)
    rec.note(b"e" * 8, None)
    assert rec.get(b"b" * 8) is None and rec.ever(b"b" * 8)  # forgotten, still ever dropped


def test_forgotten_drops_still_read_as_evicted():
    kv = KVCacheManager(make_config(9, BS))
    kv.pool.drops.capacity = 1  # keeps only the latest drop with its details
    run(kv, Req("a", toks(100, 16)))
    run(kv, Req("b", toks(500, 33)))
    n, miss = run(kv, Req("c", toks(100, 17)))
    assert n == 0 and miss.causes == {"evicted": 16, "partial_block": 1}
    assert common_prefix([1, 2, 3, 4], [1, 2, 9], 10) == 2
    assert common_prefix([1, 2], [1, 2, 3], 10) == 2


# -- random workloads through the engine --------------------------------------------------

PAGE = 8192  # the tiny Llama's page bytes (asserted in the fixture)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    """One engine for the module: a 24-block device pool (batches preempt and evict) over a
    disk tier of 6 pages (it evicts too)."""
    from tests.execution.conftest import make_llm
    llm = make_llm(kv_cache_memory=str(PAGE * 24), block_size=16, scheduling_policy="fcfs",
                   target_step_ms=0, disk_cache_dir=str(tmp_path_factory.mktemp("kv")),
                   disk_cache_size=str(PAGE * 6), session_pin_ttl=0.05,
                   session_pin_budget=str(PAGE * 8))
    assert llm.core.runner.kv_cache_config.page_bytes == PAGE
    yield llm
    llm.close()


def check(outs):
    for o in outs:
        assert o.miss_causes is not None
        assert sum(o.miss_causes.values()) == len(o.prompt_token_ids) - o.num_cached_tokens
        assert set(o.miss_causes) <= set(CAUSES) and all(v > 0 for v in o.miss_causes.values())


def generate(llm, items):
    """LLM.generate with per-request session ids and salts: items of (prompt, params, kw)."""
    from loomserve.engine.processor import RequestState
    states = {}
    for k, (p, sp, kw) in enumerate(items):
        rid = f"g{next(_ids)}-{k}"
        req = llm.inputs.make_core_request(rid, p, sp, **kw)
        states[rid] = RequestState(rid, req.prompt_token_ids, sp, llm.tokenizer)
        llm.core.add(req)
    results = {}
    while llm.core.has_work():
        for out in llm.core.step():
            results[out.request_id] = states[out.request_id].process([out])
    return [results[rid] for rid in states]


_ids = iter(range(1 << 30))


@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 90), st.integers(0, 3),
                          st.booleans()), min_size=2, max_size=8), st.integers(0, 1 << 30))
def test_causes_sum_to_uncached_tokens(tiny_llm, turns, seed):
    """Random sessions (history kept, edited, or a salt switched), session pins with a short
    TTL, a 24-block pool over a 6-page disk tier: batches preempt and evict; every finished
    request's causes sum to its uncached prompt tokens."""
    import random
    rng = random.Random(seed)
    history: dict[int, list[int]] = {}
    items = []
    for session, grow, edit, own_batch in turns:
        prev = history.get(session, [rng.randrange(3, 400) for _ in range(8)])
        if edit == 1 and len(prev) > 4:
            prev = prev[:]
            prev[rng.randrange(len(prev))] = rng.randrange(3, 400)
        p = (prev + [rng.randrange(3, 400) for _ in range(grow)])[:200]
        history[session] = p
        kw = {"session_id": f"s{seed}-{session}",
              "cache_salt": "other" if edit == 2 else None}
        items.append((p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), kw))
        if own_batch:  # a turn that waits for the previous ones (sessions in sequence)
            check(generate(tiny_llm, items))
            items = []
    check(generate(tiny_llm, items))


def test_engine_reports_usage_causes_and_preemption(tiny_llm):
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = list(range(10, 170))
    outs = tiny_llm.generate([base + [i] * 20 for i in range(4)], sp)
    check(outs)
    assert tiny_llm.core.scheduler.num_preemptions > 0
    again = tiny_llm.generate(base + [1] * 20, sp)[0]
    check([again])


def test_tier_eviction_through_the_engine(tiny_llm):
    """A's blocks leave the device and a disk tier too small to keep them: a tier miss."""
    from tests.kv.connector.conftest import OTHERS, A, run, settle
    run(tiny_llm, A)
    settle(tiny_llm)
    tiny_llm.generate(OTHERS, SamplingParams(temperature=0.0, max_tokens=1))
    settle(tiny_llm)
    out = run(tiny_llm, A)
    check([out])
    assert out.miss_causes.get("evicted_tier", 0) >= 16
    assert "first_sight" not in out.miss_causes


def test_hybrid_state_missing_through_the_engine():
    import os

    from loomserve import LLM
    llm = LLM(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "fixtures",
                                           "tiny-qwen3-next")),
              kv_cache_memory="8MiB", dtype="float32")
    bs = llm.core.scheduler.kv.block_size
    sp = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    a = list(range(10, 10 + 3 * bs + 5))
    check(llm.generate(a, sp))
    out = llm.generate(a[:2 * bs + 3] + [7] * bs, sp)[0]
    check([out])
    # attention blocks 0-1 live, the only checkpoint at block 3: nothing hits
    assert out.num_cached_tokens == 0
    assert out.miss_causes == {"state_missing": 2 * bs, "first_sight": bs, "partial_block": 3}


def test_a_state_only_model_builds_without_attribution():
    """A model of state layers only has no group whose pages grow with tokens: the manager
    builds (it raised StopIteration) and explains nothing rather than guessing."""
    from loomserve.kv.cache_manager import KVCacheManager
    from tests.kv.conftest import make_hybrid_config

    kv = KVCacheManager(make_hybrid_config(200, window=0, state=True, full=False))
    assert kv.misses is None and kv.pool.drops is None
