"""Async scheduling together with speculative decoding.

Oracle: the synchronous engine without drafts (greedy outputs identical token for token). Under
--async-scheduling a step with drafts runs alone: the core finishes the step in flight before
scheduling one that may draft, and finishes a drafted step before scheduling the next
(StepOverlap raises if a step is ever scheduled while drafts are verified). Checked per
drafter (ngram, suffix, MTP), on hybrid models with every acceptance length (the state restored
after the step that verified, as without the flag), with stop tokens inside drafts, max_tokens,
logprobs, an abort and preemption, and that a workload with nothing to copy keeps its overlap.
After each run no block, request or placeholder may remain.
"""

from __future__ import annotations

import pytest

from loomserve import SamplingParams
from loomserve.engine.spec.drafter import Drafter
from tests.engine.test_spec_decode import NGRAM, make, prompts
from tests.engine.test_spec_hybrid import HYBRID, PROMPTS, ScriptedDrafter

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "always_draft": True}
MTP = {"method": "mtp", "num_speculative_tokens": 3, "always_draft": True}
MTP_PROMPTS = [list(range(20, 52)) * 2, [7, 8, 9, 10, 11] * 6 + list(range(20, 29)),
               list(range(100, 113))]


def tokens(llm, ps, sp=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(ps, sp)]


def reference(name: str, ps, sp=GREEDY, **kw) -> list[list[int]]:
    """The synchronous engine's greedy output without drafts."""
    llm = make(name, None, **kw)
    try:
        return tokens(llm, ps, sp)
    finally:
        llm.close()


def clean(llm) -> None:
    core = llm.core
    assert core.kv.num_free_blocks == llm.free_at_start
    assert not core.scheduler.requests and not core.scheduler.running
    assert not core.spec._views and not core.spec._asked
    assert not core.overlap.in_flight
    assert all(not r.num_output_placeholders for r in core.scheduler.requests.values())


@pytest.mark.parametrize("name,spec,ps", [("tiny-llama", NGRAM, prompts()),
                                          ("tiny-llama", SUFFIX, prompts()),
                                          ("tiny-deepseek-v3", MTP, MTP_PROMPTS)],
                         ids=["ngram", "suffix", "mtp"])
def test_greedy_identical_per_drafter(name, spec, ps):
    ref = reference(name, ps)
    llm = make(name, spec, async_scheduling=True)
    try:
        assert tokens(llm, ps) == ref
        assert tokens(llm, ps) == ref  # warm: prefix hits, the drafter's session state
        s = llm.core.stats()
        assert s.spec_decode_num_drafts > 0 and s.spec_decode_num_accepted_tokens > 0
        clean(llm)
    finally:
        llm.close()


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_hybrid_state_restored_at_every_acceptance_length(name):
    """A scripted drafter's wrong token cycles through the draft positions: each length
    0..k is verified and the next step (scheduled only after the update) restores it."""
    ps = PROMPTS[name]
    ref = reference(name, ps, **HYBRID)
    llm = make(name, async_scheduling=True, **HYBRID)
    try:
        llm.core.spec.drafter = ScriptedDrafter({tuple(p): r for p, r in zip(ps, ref)})
        assert tokens(llm, ps) == ref
        per_pos = llm.core.stats().spec_decode_num_accepted_tokens_per_pos
        assert per_pos[0] > per_pos[-1] > 0  # full and partial acceptance both happened
        clean(llm)
    finally:
        llm.close()


def test_stops_max_tokens_logprobs_and_abort():
    """A stop token among the drafts ends the request there; max_tokens is never exceeded;
    logprobs come one per emitted token; an abort with a step in flight emits nothing more."""
    ps = prompts()
    sps = [SamplingParams(temperature=0.0, max_tokens=3 + 7 * i, ignore_eos=True,
                          logprobs=1 if i % 2 else None) for i in range(len(ps))]
    ref = reference("tiny-llama", ps, sps)
    stop = ref[3][5]
    sp_stop = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             stop_token_ids=[stop])
    ref_stop = reference("tiny-llama", ps, sp_stop)
    llm = make("tiny-llama", NGRAM, async_scheduling=True)
    try:
        out = llm.generate(ps, sps)
        assert [o.token_ids for o in out] == ref
        for o, sp in zip(out, sps):
            assert len(o.token_ids) == sp.max_tokens
            assert (o.logprobs is None) == (sp.logprobs is None)
            assert o.logprobs is None or len(o.logprobs) == len(o.token_ids)
        stopped = llm.generate(ps, sp_stop)
        assert [o.token_ids for o in stopped] == ref_stop
        assert stopped[3].finish_reason == "stop" and stopped[3].token_ids[-1] == stop
        core = llm.core
        from loomserve.engine.messages import EngineCoreRequest
        core.add(EngineCoreRequest(request_id="gone", prompt_token_ids=ps[3],
                                   sampling=GREEDY, max_tokens=24))
        got = [t for _ in range(4) for o in core.step() for t in o.new_token_ids]
        assert core.abort("gone")
        while core.has_work():
            got += [t for o in core.step() if o.request_id == "gone" for t in o.new_token_ids]
        assert got == ref[3][:len(got)] and len(got) < 24
        clean(llm)
    finally:
        llm.close()


def test_small_pool_preemption_and_chunked_prefill_stay_exact():
    ps = prompts() * 2
    kw = dict(kv_cache_memory="160KiB", max_num_batched_tokens=48)
    ref = reference("tiny-llama", ps, **kw)
    llm = make("tiny-llama", NGRAM, async_scheduling=True, **kw)
    try:
        assert tokens(llm, ps) == ref
        assert llm.core.scheduler.num_preemptions > 0
        clean(llm)
    finally:
        llm.close()


def test_nothing_to_copy_keeps_the_overlap():
    """A drafter that never has anything: after a first ask per request most steps overlap
    (a request is asked again only every REASK_EVERY steps, all of them at once)."""
    ps = [[(37 * i + 11 * j) % 401 + 50 for j in range(20 + i)] for i in range(6)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "always_draft": True}
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    ref = reference("tiny-llama", ps, sp)
    llm = make("tiny-llama", spec, async_scheduling=True)
    llm.core.spec.drafter = Drafter()  # the base drafter proposes nothing
    try:
        assert tokens(llm, ps, sp) == ref
        ov = llm.core.overlap
        assert ov.num_overlapped > ov.num_steps / 2
        clean(llm)
    finally:
        llm.close()


def test_tensor_parallel_two_ranks_identical(monkeypatch):
    """-tp 2: the drafted step's message and collectives still run on the execution thread in
    schedule order; the output is the one-rank plain engine's."""
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")  # the worker inherits the environment
    ps = prompts()[:2]
    ref = reference("tiny-llama", ps)
    llm = make("tiny-llama", NGRAM, async_scheduling=True, tensor_parallel_size=2)
    try:
        assert tokens(llm, ps) == ref
        assert llm.core.stats().spec_decode_num_accepted_tokens > 0
        clean(llm)
    finally:
        llm.close()
