"""The prefill schedule interval over a real KVCacheManager: a waiting request is admitted only
on steps whose number is a multiple of N, while running decodes and running prefill chunks go
on every step, and every request still finishes (nothing starves)."""

from __future__ import annotations

import pytest

from loomserve.config import SchedulerConfig
from loomserve.engine.sched.request import Request
from loomserve.engine.sched.scheduler import Scheduler
from loomserve.kv.cache_manager import KVCacheManager
from loomserve.sampling_params import SamplingParams
from tests.engine.sched.fakes import FakeRunner, step
from tests.kv.conftest import make_config

BS = 4


def req(rid: str, n: int, max_tokens: int = 6) -> Request:
    base = 1000 * (sum(map(ord, rid)) % 97)
    return Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens),
                   max_tokens)


@pytest.mark.parametrize("policy", ["fcfs", "cache_aware"])
def test_new_prefills_admitted_only_every_nth_step_and_nothing_starves(policy):
    kv = KVCacheManager(make_config(128, BS))
    sched = Scheduler(kv, 8, 16, 0, policy=policy, prefill_schedule_interval=4)
    runner = FakeRunner(BS)
    admitted_at: dict[str, int] = {}
    chunked_steps: list[int] = []  # steps where a running prefill got a chunk
    decode_steps: list[int] = []
    arrivals = {0: ["a"], 1: ["b", "c"], 5: ["d"], 9: ["e"], 13: ["f"]}
    for n in range(200):
        for rid in arrivals.get(n, []):
            sched.add(req(rid, 12 if rid == "a" else 3))  # a: a 12-token prompt, 2 chunks
        if not sched.has_work() and n > max(arrivals):
            break
        assert sched.step_number == n
        waiting_before = {r.request_id for r in sched.waiting}
        running_before = {r.request_id: r.num_computed_tokens < r.num_prompt_tokens
                          for r in sched.running}
        out, _ = step(sched, runner)
        for r, k in out.scheduled:
            if r.request_id in waiting_before:
                admitted_at[r.request_id] = n
            elif running_before.get(r.request_id):
                chunked_steps.append(n)
            else:
                decode_steps.append(n)
    assert set(admitted_at) == set("abcdef") and not sched.requests  # all finished: no starving
    assert all(n % 4 == 0 for n in admitted_at.values()), admitted_at
    assert admitted_at["d"] == 8 and admitted_at["e"] == 12  # waited for the next 4th step
    assert any(n % 4 for n in chunked_steps), chunked_steps  # a's 2nd chunk did not wait
    assert any(n % 4 for n in decode_steps)  # decodes run between admission steps


def test_interval_one_is_every_step_and_config_refuses_zero():
    kv = KVCacheManager(make_config(64, BS))
    sched = Scheduler(kv, 8, 16, 0, policy="fcfs")
    runner = FakeRunner(BS)
    sched.add(req("a", 3))
    step(sched, runner)
    sched.add(req("b", 3))
    out, _ = step(sched, runner)
    assert "b" in [r.request_id for r, _ in out.scheduled]
    assert SchedulerConfig().prefill_schedule_interval == 1
    with pytest.raises(ValueError, match="prefill_schedule_interval"):
        SchedulerConfig(prefill_schedule_interval=0)
