"""Data parallelism: two engine cores behind one front end (loomserve.engine.dp_client).

Served through the OpenAI API and AsyncLLM on the tiny Llama fixture, one thread per core:
greedy outputs equal dp 1's, a session's turns stay on one rank (its second turn hits the
prefix cache), concurrent sessions spread over both ranks, stats sum over ranks, and a SIGKILLed
rank fails its in-flight requests within 5 s with /health at 503. The placement rules are unit
tested on DPPlacement itself.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from loomserve import SamplingParams
from loomserve.engine.dp_client import DPPlacement, aggregate_stats, block_hashes
from loomserve.engine.messages import EngineCoreRequest, EngineStats
from tests.api.server.conftest import running_server
from tests.api.server.test_supervision import health, long_body, stream_until_error

ENV = {"LOOMSERVE_NUM_THREADS": "1"}  # two cores on a 2-core machine
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "1, 2, 3, 4,"]


def wait_for(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def complete_all(url: str, model: str) -> list[str]:
    """PROMPTS through the OpenAI client at once (so both ranks get some), greedy."""
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    out: dict[int, str] = {}

    def one(i: int) -> None:
        r = client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
        out[i] = r.choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return [out[i] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def dp2():
    with running_server(core_env=ENV, data_parallel_size=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def dp1():
    """The reference: one core, in a thread; (its KV capacity in tokens, PROMPTS' greedy texts),
    computed once for every dp 2 layout compared with it."""
    with running_server(in_process=True) as srv:
        return srv.engine.ready.kv_capacity_tokens, complete_all(srv.url, srv.model)


def test_dp2_with_drafts_greedy_matches_dp1(dp1):
    """Speculative decoding under DP: each core drafts and verifies its own requests; greedy
    texts equal dp 1's without drafts, and the draft counters are summed over the ranks."""
    _, expected = dp1
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 4, "always_draft": True}
    with running_server(core_env=ENV, data_parallel_size=2, speculative_config=spec) as srv:
        assert complete_all(srv.url, srv.model) == expected
        client = srv.engine.client
        wait_for(lambda: sum(s.generation_tokens for s in client.rank_stats) >= 12 * 4)
        total = srv.engine.stats()
        drafted = [s.spec_decode_num_draft_tokens for s in client.rank_stats]
        assert total.spec_decode_num_draft_tokens == sum(drafted) > 0
        assert total.spec_decode_num_accepted_tokens == \
            sum(s.spec_decode_num_accepted_tokens for s in client.rank_stats)

def test_dp2_greedy_matches_dp1_and_uses_both_ranks(dp2, dp1):
    capacity, expected = dp1
    assert complete_all(dp2.url, dp2.model) == expected
    client = dp2.engine.client
    wait_for(lambda: all(s.generation_tokens > 0 for s in client.rank_stats))
    total = dp2.engine.stats()
    assert total.generation_tokens == sum(s.generation_tokens for s in client.rank_stats)
    assert total.kv_blocks_total == sum(s.kv_blocks_total for s in client.rank_stats) > 0
    assert dp2.engine.ready.kv_capacity_tokens == 2 * capacity


@pytest.mark.parametrize("group", [{"tensor_parallel_size": 2},
                                   {"decode_context_parallel_size": 2},
                                   {"prefill_context_parallel_size": 2}])
def test_dp2_with_a_rank_group_per_core_greedy_matches_dp1(group, dp1):
    """Two DP cores, each a group of two ranks (four model processes): tensor, decode-context
    or prefill-context parallel."""
    expected = dp1[1]
    with running_server(core_env=ENV, data_parallel_size=2, **group) as srv:
        assert complete_all(srv.url, srv.model) == expected
        client = srv.engine.client
        wait_for(lambda: all(s.generation_tokens > 0 for s in client.rank_stats))


async def turn(engine, prompt, session):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    last = None
    async for out in engine.generate(prompt, params, session_id=session):
        last = out
    return last


def test_a_session_stays_on_its_rank_and_hits_the_cache_while_sessions_spread(dp2):
    engine, placement = dp2.engine, dp2.engine.client.placement
    system = list(range(100, 164))  # 64 tokens: whole blocks to hit

    async def main():
        firsts = await asyncio.gather(turn(engine, system + [1, 2, 3], "sa"),
                                      turn(engine, system[::-1] + [4, 5], "sb"))
        ranks = (placement._sessions["sa"], placement._sessions["sb"])
        second = await turn(engine, system + [1, 2, 3] + list(firsts[0].token_ids) + [7],
                            "sa")
        return firsts, ranks, second

    firsts, ranks, second = asyncio.run(main())
    assert sorted(ranks) == [0, 1]  # concurrent sessions spread by load
    assert placement._sessions["sa"] == ranks[0]  # the second turn stayed
    # The 76-token second turn hits the system prompt's 4 blocks; its 5th block (tokens 64-75)
    # is not full, so 64 is also the most it can hit.
    assert second.num_cached_tokens == 64
    assert all(n == 0 for n in placement.load)  # every request finished and was counted


def test_sigkill_of_one_rank_fails_in_flight_requests_and_health_503():
    with running_server(core_env={**ENV, "LOOMSERVE_STEP_DELAY_MS": "20"},
                        data_parallel_size=2) as srv:
        results, started = {}, [threading.Event(), threading.Event()]

        def reader(i: int) -> None:
            results[i] = stream_until_error(srv.url, long_body(srv.model, True, 200), started[i])

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(5.0), "a stream never started"
        client = srv.engine.client
        assert sorted(client.placement._rank_of.values()) == [0, 1]
        os.kill(client.clients[1].proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(timeout=5.0)
            assert not t.is_alive(), "a stream hung after a rank was killed"
        assert time.monotonic() - killed < 5.0
        for i in range(2):
            err = results[i]["error"]
            assert err["code"] == "engine_core_failed", err
            assert "data-parallel rank 1" in err["message"]
        wait_for(lambda: health(srv.url) == 503, 1.0)
        r = httpx.post(srv.url + "/v1/completions", json=long_body(srv.model, False, 4),
                       timeout=5.0)
        assert r.status_code == 503


# -- placement rules -------------------------------------------------------------------------
def req(rid, prompt, session=None, parent=None, sibling=None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt,
                             sampling=SamplingParams(max_tokens=1), max_tokens=1,
                             session_id=session, parent_session_id=parent, sibling_of=sibling)


def test_placement_session_then_prefix_within_load_slack_then_least_load():
    p = DPPlacement(2, block_size=4)
    shared = list(range(16))
    assert p.place(req("a", shared + [1], session="s")) == 0
    assert p.place(req("b", [9] * 8)) == 1  # cold: the least loaded
    assert p.place(req("c", shared + [2])) == 0  # prefix hit, load within the slack
    for i in range(2):  # hits within the slack: rank 0 now 4 in flight, rank 1 one
        assert p.place(req(f"x{i}", shared + [3 + i])) == 0
    assert p.load == [4, 1]
    assert p.place(req("d", shared + [9])) == 1  # rank 0 too loaded for its hit
    assert p.place(req("e", [5] * 8, session="s")) == 0  # sticky regardless of load
    assert p.place(req("f", [6] * 8, parent="s")) == 0  # a child session follows its parent
    assert p.place(req("g", [6] * 8, sibling="b")) == 1  # n > 1 samples stay together
    p.finished("a")
    assert p.rank_of("a") is None and p.load == [5, 3]
    assert p.end_session("s") == 0 and p.end_session("s") is None


def test_block_hashes_are_chained_and_salted():
    a, b = block_hashes(list(range(9)), 4), block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert block_hashes(list(range(8)), 4, "x")[0] != block_hashes(list(range(8)), 4)[0]


def test_stats_sum_over_ranks():
    s = aggregate_stats([EngineStats(num_running=1, kv_blocks_total=10, target_step_ms=5.0,
                                     num_preemptions_by_cause={"decode_blocks": 1}),
                         EngineStats(num_running=2, kv_blocks_total=10, target_step_ms=7.0,
                                     num_preemptions_by_cause={"decode_blocks": 2})])
    assert (s.num_running, s.kv_blocks_total, s.target_step_ms) == (3, 20, 7.0)
    assert s.num_preemptions_by_cause == {"decode_blocks": 3}


def test_cli_flags_and_refusals():
    from loomserve.cli import build_parser, engine_config_from_args
    from loomserve.config import EngineConfig
    from loomserve.engine.async_llm import AsyncLLM
    from loomserve.engine.core_client import EngineStartError
    from loomserve.engine.dp_client import check_dp_supported
    args = build_parser().parse_args(["serve", "m", "--data-parallel-size", "2",
                                      "--enable-expert-parallel",
                                      "--prefill-schedule-interval", "4"])
    config = engine_config_from_args(args)
    assert config.parallel.data_parallel_size == 2 and config.parallel.enable_expert_parallel
    assert config.parallel.world_size == 1  # ranks of one engine core
    assert config.scheduler.prefill_schedule_interval == 4
    assert EngineConfig.from_kwargs(data_parallel_size=2, nnodes=2,  # one core per node
                                    master_port=1234).parallel.dp_local_size == 1
    with pytest.raises(ValueError, match="does not split evenly"):
        EngineConfig.from_kwargs(data_parallel_size=3, nnodes=2, master_port=1234)
    check_dp_supported(EngineConfig.from_kwargs(data_parallel_size=2, host_cache_memory="4MiB"))
    with pytest.raises(EngineStartError, match="role prefill/decode"):
        check_dp_supported(EngineConfig.from_kwargs(data_parallel_size=2, role="prefill"))
    with pytest.raises(EngineStartError, match="engine-in-process"):
        AsyncLLM(EngineConfig.from_kwargs(data_parallel_size=2), in_process=True)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-next", "tiny-deepseek-v3"])
def test_dp2_greedy_and_cached_tokens_match_dp1_on_more_families(name, monkeypatch):
    """Qwen3, a linear-state hybrid and the MLA MoE fixture (no expert parallelism: each core
    the whole model) at dp 2: per session (each on its own core) the same greedy tokens and
    cached_tokens as one core serving the same sessions."""
    from loomserve.config import EngineConfig
    from loomserve.engine.async_llm import AsyncLLM
    from tests.execution.tp_util import _fixture
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    model = _fixture(name)
    async def sessions(engine):
        async def one(sid, first):  # distinct prefixes: the sessions spread by load
            a = await turn(engine, first, sid)
            b = await turn(engine, first + list(a.token_ids) + [9], sid)
            return [(o.token_ids, o.num_cached_tokens) for o in (a, b)]
        return await asyncio.gather(one("sa", list(range(100, 167))),
                                    one("sb", list(range(200, 266))))

    got = {}
    for dp in (1, 2):
        engine = AsyncLLM(EngineConfig.from_kwargs(model=model, dtype="float32",
                                                   kv_cache_memory="4MiB",
                                                   data_parallel_size=dp))
        try:
            got[dp] = asyncio.run(sessions(engine))
            if dp == 2:
                placed = engine.client.placement._sessions
                assert sorted((placed["sa"], placed["sb"])) == [0, 1]
        finally:
            engine.shutdown()
    assert got[2] == got[1]
    assert all(s[1][1] >= 64 for s in got[2])  # each second turn hit its session's prefix
