"""Speculative decoding on hybrid models: the linear/SSM state after the last accepted token.

Oracle: the same engine without --speculative-config (greedy outputs identical token for
token), on Gated DeltaNet (tiny-qwen3-next), Mamba2 (tiny-nemotron-h) and KDA
(tiny-kimi-linear). A verified step runs a request's 1 + d rows through the recurrent layers in
order and keeps the state after each row; the next step restores the one at the accepted
length (kv/managers/linear_state.py). Cold, warm (a hit restoring the prompt's checkpoint) and
a second turn that hits a checkpoint taken while drafting: a checkpoint holding a rejected
draft's state would change that turn's output. 16-token blocks (max_hybrid_block_size=0) put
block boundaries inside verified drafts.

The random tiny models seldom copy their context, so prompt lookup drafts little that is
accepted; the prompts end in runs of a token each model repeats (found by greedy search), so
ngram drafts are both accepted and rejected. A scripted drafter then proposes the reference
continuation with one wrong token at a cycling position, so every acceptance length 0..k is
verified and restored.
"""

from __future__ import annotations

import pytest

from loomserve import SamplingParams
from loomserve.engine.spec.drafter import Drafter, DraftRequest
from tests.engine.test_spec_decode import BASE, NGRAM, make

K = NGRAM["num_speculative_tokens"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
HYBRID = dict(kv_cache_memory="8MiB", max_hybrid_block_size=0)

# model -> prompts: generic ones, then runs of a token the model keeps repeating
PROMPTS = {
    "tiny-qwen3-next": [BASE[:20] + [60, 61] + BASE[:20], list(range(80, 94)) + [353] * 8,
                        list(range(74, 88)) + [353] * 8],
    "tiny-nemotron-h": [BASE * 3 + [7], [7, 8, 9, 10, 11] * 8 + BASE[:9], list(range(100, 140))],
    "tiny-kimi-linear": [list(range(182, 196)) + [267] * 8, list(range(20, 34)) + [267] * 5,
                         [7, 8, 9, 10, 11] * 8],
}


class ScriptedDrafter(Drafter):
    """Proposes a request's reference continuation with a wrong token at draft position
    (its step count mod k + 1): acceptance lengths 0, 1, .., k in turn."""

    name = "scripted"

    def __init__(self, refs: dict[tuple[int, ...], list[int]]) -> None:
        self.refs = refs
        self.steps: dict[str, tuple[int, int]] = {}  # id -> (tokens, step)

    def propose(self, req: DraftRequest, max_tokens: int) -> list[int]:
        n = req.num_prompt_tokens
        ref = self.refs[tuple(req.tokens[:n])]
        drafts = list(ref[len(req.tokens) - n:][:max_tokens])
        # a step is counted when the request moved on since the last call (a request proposed
        # for but not scheduled, for want of token budget, is asked again at the same length)
        last, step = self.steps.get(req.request_id, (-1, -1))
        if len(req.tokens) != last:
            step += 1
        self.steps[req.request_id] = (len(req.tokens), step)
        wrong = step % (K + 1)
        if wrong < len(drafts):
            drafts[wrong] ^= 1  # another id of the 512-token vocabulary
        return drafts

    def on_finished(self, req: DraftRequest) -> None:
        self.steps.pop(req.request_id, None)


@pytest.fixture(scope="module", params=list(PROMPTS))
def engines(request):
    plain, spec = make(request.param, None, **HYBRID), make(request.param, **HYBRID)
    yield request.param, plain, spec
    plain.close()
    spec.close()


def tokens(llm, prompts, sp=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, sp)]


_REFS: dict[str, tuple[list[list[int]], int]] = {}


def reference(name: str, plain=None) -> tuple[list[list[int]], int]:
    """Plain decoding's greedy output for the model's prompts, and the pool's page bytes (one
    engine load per module)."""
    if name not in _REFS:
        llm = plain or make(name, None, **HYBRID)
        _REFS[name] = tokens(llm, PROMPTS[name]), llm.core.runner.kv_cache_config.page_bytes
        if plain is None:
            llm.close()
    return _REFS[name]


def counters(llm) -> tuple[int, int, list[int]]:
    s = llm.core.stats()
    return (s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens,
            list(s.spec_decode_num_accepted_tokens_per_pos))


def assert_clean(llm) -> None:
    """Every block and state page free as at the start; no request, draft or restore state."""
    core = llm.core
    assert core.kv.num_free_blocks == llm.free_at_start
    assert not core.scheduler.requests and not core.scheduler.running
    for mgr in core.kv.coordinator.state_managers:
        assert not mgr.states and not mgr.req_blocks
    assert not core.spec._views


def test_ngram_greedy_identical_cold_warm_and_next_turn(engines):
    name, plain, spec = engines
    prompts = PROMPTS[name]
    ref, _ = reference(name, plain)
    drafted, accepted, _ = counters(spec)
    cold = spec.generate(prompts, GREEDY)
    warm = spec.generate(prompts, GREEDY)  # hits: the prompt checkpoints restore the state
    assert [o.token_ids for o in cold] == ref and [o.token_ids for o in warm] == ref
    assert all(o.num_cached_tokens > 0 for o in warm)
    d, a, _ = counters(spec)
    assert a > accepted and d - drafted > a - accepted  # drafts accepted and rejected
    # the next turn hits a checkpoint taken while drafts were verified (past the prompt)
    # (the tail page: as without drafts, the boundary a verified step's accepted drafts crossed)
    turns = [p + r + [5, 6] for p, r in zip(prompts, ref)]
    want = plain.generate(turns, GREEDY)
    got = spec.generate(turns, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]
    assert any(o.num_cached_tokens > len(p) for o, p in zip(got, prompts))
    assert_clean(spec)


def test_every_acceptance_length_restores_the_state(engines):
    name, plain, spec = engines
    prompts = PROMPTS[name]
    for llm in (plain, spec):  # the checkpoints below are this test's own
        assert llm.core.kv.reset_prefix_cache()
    ref = tokens(plain, prompts)
    ngram = spec.core.spec.drafter
    spec.core.spec.drafter = ScriptedDrafter({tuple(p): r for p, r in zip(prompts, ref)})
    try:
        drafted, accepted, per_pos = counters(spec)
        assert tokens(spec, prompts) == ref
        d, a, now = counters(spec)
    finally:
        spec.core.spec.drafter = ngram
    gained = [x - y for x, y in zip(now, per_pos)]
    # steps accepting more than i drafts, for each i: every length occurred, k included
    assert all(gained[i] > gained[i + 1] > 0 for i in range(K - 1)), gained
    assert d - drafted > a - accepted
    # block boundaries crossed inside accepted drafts left the tail checkpoint a plain decode
    # leaves: the next turn hits as far, and continues as plain decoding does
    turns = [p + r + [5, 6] for p, r in zip(prompts, ref)]
    want, got = plain.generate(turns, GREEDY), spec.generate(turns, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]
    assert_clean(spec)


def test_many_requests_leave_no_block_or_state_page(engines):
    name, _, spec = engines
    prompts = PROMPTS[name]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = spec.core.stats().spec_decode_num_draft_tokens
    for i in range(3):
        spec.generate([p[i:] + [i + 1] for p in prompts] * 2, sp)
    assert spec.core.stats().spec_decode_num_draft_tokens > before
    assert_clean(spec)
    spec.core.kv.reset_prefix_cache()
    assert spec.core.kv.num_free_blocks == spec.free_at_start


def test_small_pool_preemption_stays_exact():
    """A pool of 10 pages: requests verifying drafts are preempted (their draft and restore
    pages freed) and recomputed; the output is still plain decoding's."""
    prompts, (ref, page) = PROMPTS["tiny-qwen3-next"], reference("tiny-qwen3-next")
    llm = make("tiny-qwen3-next", kv_cache_memory=str(page * 10), max_hybrid_block_size=0,
               scheduling_policy="fcfs", max_num_batched_tokens=40, long_prefill_threshold=24)
    try:
        llm.core.spec.drafter = ScriptedDrafter({tuple(p): r for p, r in zip(prompts, ref)})
        assert tokens(llm, prompts) == ref
        assert llm.core.scheduler.num_preemptions > 0
        stats = llm.core.stats()  # drafts were verified and accepted between preemptions
        assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens_per_pos[0]
        assert_clean(llm)
    finally:
        llm.close()


def test_tensor_parallel_two_ranks_identical(monkeypatch):
    """-tp 2 on Gated DeltaNet: every rank applies the same restore (the step message carries
    the state directives), with every acceptance length."""
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")  # the worker inherits the environment
    prompts, (ref, _) = PROMPTS["tiny-qwen3-next"], reference("tiny-qwen3-next")
    llm = make("tiny-qwen3-next", tensor_parallel_size=2, **HYBRID)
    try:
        assert tokens(llm, prompts) == ref  # ngram
        llm.core.spec.drafter = ScriptedDrafter({tuple(p): r for p, r in zip(prompts, ref)})
        assert tokens(llm, prompts) == ref
        per_pos = llm.core.stats().spec_decode_num_accepted_tokens_per_pos
        assert per_pos[K - 1] > 0
        assert_clean(llm)
    finally:
        llm.close()
