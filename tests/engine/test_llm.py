"""End-to-end engine behaviour on the tiny Llama fixture (real model code, real KV manager)."""

import random

import pytest

from loomserve import SamplingParams
from tests.execution.conftest import make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts(n, lo=5, hi=120, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm():
    return make_llm()


@pytest.fixture(scope="module")
def reference(llm):
    """Each prompt generated alone: the answer every batching/caching variant must reproduce."""
    return [llm.generate(p, GREEDY)[0].token_ids for p in prompts(8)]


def test_generate_returns_ids_and_text(llm):
    out = llm.generate(["hello world", [5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=5,
                                                                      ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [5, 5]
    assert all(o.finished and o.finish_reason == "length" for o in out)
    assert out[0].text == llm.tokenizer.decode(out[0].token_ids)


def test_batched_equals_alone(llm, reference):
    assert [o.token_ids for o in llm.generate(prompts(8), GREEDY)] == reference


def test_prefix_caching_off_gives_same_output(reference):
    llm = make_llm(enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(prompts(8), GREEDY)] == reference


def test_chunked_prefill_gives_same_output(reference):
    llm = make_llm(max_num_batched_tokens=24, long_prefill_threshold=7)
    assert [o.token_ids for o in llm.generate(prompts(8), GREEDY)] == reference


def test_preemption_by_recompute_gives_same_output(llm, reference):
    # A pool of a few blocks cannot hold 8 requests at once: some must be preempted and resumed.
    page = llm.core.runner.kv_cache_config.page_bytes
    # fcfs and the token budget alone: the step-time budget depends on measured step times,
    # so only this mode preempts deterministically here
    llm = make_llm(kv_cache_memory=str(page * 14), block_size=16, scheduling_policy="fcfs",
                   target_step_ms=0)
    out = llm.generate(prompts(8), GREEDY)
    assert llm.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out] == reference
    assert llm.core.kv.num_free_blocks == llm.core.kv.num_blocks


def test_prefix_hit_reports_cached_tokens(llm):
    base = prompts(1, lo=100, hi=100, seed=3)[0]
    first = llm.generate(base + [9], GREEDY)[0]
    second = llm.generate(base + [11, 12], GREEDY)[0]
    bs = llm.config.cache.block_size
    assert second.num_cached_tokens == (len(base) // bs) * bs
    assert first.num_cached_tokens <= second.num_cached_tokens


def test_different_cache_salts_never_share(llm):
    base = prompts(1, lo=64, hi=64, seed=4)[0]
    core, inputs = llm.core, llm.inputs
    for i, salt in enumerate(["a", "b"]):
        req = inputs.make_request(f"salt-{i}", base, GREEDY, cache_salt=salt)
        core.add_request(req)
        while core.has_work():
            core.step()
        assert req.num_cached_tokens == 0


def test_long_prefill_threshold_lets_short_turns_through():
    llm = make_llm(max_num_batched_tokens=64, long_prefill_threshold=32)
    core, inputs = llm.core, llm.inputs
    long_req = inputs.make_request("long", prompts(1, lo=200, hi=200)[0], GREEDY)
    short_req = inputs.make_request("short", [5, 6, 7], GREEDY)
    core.add_request(long_req)
    core.add_request(short_req)
    first = core.step()
    assert long_req.num_computed_tokens == 32  # capped, not the whole budget
    assert [o.request_id for o in first] == ["short"]  # the short turn got its first token
    while core.has_work():
        core.step()
    assert long_req.status.value == "length"


def test_stop_string_and_stop_token(llm):
    free = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert len(free.text) > 3
    stop = free.text[2:4]
    cut = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                             stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[:free.text.index(stop)]
    tok = free.token_ids[3]
    by_id = llm.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                               stop_token_ids=[tok]))[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == tok
    assert by_id.token_ids == free.token_ids[:free.token_ids.index(tok) + 1]


def test_seeded_sampling_is_reproducible_across_batches(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10,
                        ignore_eos=True)
    alone = llm.generate([1, 2, 3, 4], sp)[0].token_ids
    batched = llm.generate([[9, 9, 9], [1, 2, 3, 4], [7, 8]], [GREEDY, sp, GREEDY])[1].token_ids
    assert alone == batched


@pytest.mark.parametrize("prompt,params,match", [
    ([], GREEDY, "empty"),
    ([10 ** 9], GREEDY, "token ids"),
    ([-1], GREEDY, "token ids"),
    ([1] * 10_000, GREEDY, "context length"),
    ([1, 2], SamplingParams(max_tokens=10_000), "max_tokens"),
])
def test_bad_input_is_rejected_and_nothing_is_queued(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params)
    assert not llm.core.has_work()


def test_bad_sampling_params():
    for kwargs in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_tokens": 0},
                   {"top_k": -2}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)


def test_hit_rate_counters_count_each_admitted_prompt_once(llm):
    """Requests waiting for blocks are probed every step; only their admission counts."""
    page = llm.core.runner.kv_cache_config.page_bytes
    # 7 blocks of 16: one 60-token prompt (+12 new tokens = 5 blocks) runs at a time, the
    # other three wait for dozens of steps.
    small = make_llm(kv_cache_memory=str(page * 7), block_size=16)
    batch = [[(7 * i + j) % 397 + 3 for j in range(60)] for i in range(4)]
    small.generate(batch, GREEDY)
    assert small.core.scheduler.num_preemptions == 0
    assert small.core.kv.stats.prefix_queried_tokens == 4 * 60


def test_hit_rate_counters_leave_out_readmissions_after_preemption(llm):
    page = llm.core.runner.kv_cache_config.page_bytes
    # fcfs and the token budget alone: the step-time budget depends on measured step times,
    # so only this mode preempts deterministically here
    small = make_llm(kv_cache_memory=str(page * 14), block_size=16, scheduling_policy="fcfs",
                     target_step_ms=0)
    batch = prompts(8)
    out = small.generate(batch, GREEDY)
    assert small.core.scheduler.num_preemptions > 0
    stats = small.core.kv.stats
    assert stats.prefix_queried_tokens == sum(len(p) for p in batch)
    assert stats.prefix_hit_tokens == sum(o.num_cached_tokens for o in out)
