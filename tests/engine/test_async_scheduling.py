"""Async scheduling (--async-scheduling) against the synchronous step loop.

Oracle: the same engine without the flag. Greedy outputs must be identical token for token
(the overlap changes when a step is scheduled, never what it computes); stop tokens, max_tokens
and aborts end a request at the same token (the extra row a stopped request ran in the step in
flight emits nothing); preemption and a prefix-cached warm turn behave as without it. After each
run no block, request or placeholder may remain. On one rank; under -tp 2 (a worker process,
the step message encoded while the core thread appends to the block lists); on the hybrid
fixtures (Gated DeltaNet, Mamba2, KDA), whose warm turns hit the same state checkpoints, except
one more block where a stopped request's extra row ends one (its state is exact: the next
turn's output is the same).
"""

from __future__ import annotations

import json
import os

import pytest

from loomserve import LLM, SamplingParams
from loomserve.config import EngineConfig
from loomserve.engine.messages import EngineCoreRequest
from loomserve.engine.sched.request import RequestStatus
from loomserve.execution.batch import ModelInput, ScheduledSeq
from loomserve.execution.parallel.step_message import (
    BlockSyncReceiver,
    BlockSyncSender,
    decode,
    encode,
)
from loomserve.sampling_params import StructuredOutputs

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def prompts() -> list[list[int]]:
    """Different lengths, so requests prefill, sample and finish in different steps."""
    return [[(7 * i + j) % 300 + 10 for j in range(3 + 5 * (i % 7))] for i in range(12)]


def make(async_scheduling: bool, name: str = "tiny-llama", **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "4MiB")
    llm = LLM(os.path.join(FIXTURES, name), dtype="float32",
              async_scheduling=async_scheduling, **kw)
    llm.free_at_start = llm.core.kv.num_free_blocks
    return llm


def assert_clean(llm: LLM) -> None:
    core = llm.core
    assert not core.has_work() and not (core.overlap and core.overlap.in_flight)
    assert core.kv.num_free_blocks == llm.free_at_start
    assert not core.scheduler.requests and not core.scheduler.running


@pytest.fixture(scope="module")
def pair():
    plain, overlapped = make(False), make(True)
    yield plain, overlapped
    plain.close()
    overlapped.close()


def ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_greedy_identical_with_varied_max_tokens_and_logprobs(pair):
    plain, overlapped = pair
    sps = [SamplingParams(temperature=0.0, max_tokens=1 + i % 5 * 4, ignore_eos=True,
                          logprobs=2 if i % 3 == 0 else None) for i in range(len(prompts()))]
    a, b = plain.generate(prompts(), sps), overlapped.generate(prompts(), sps)
    assert ids(b) == ids(a)
    assert [len(o.token_ids) for o in b] == [sp.max_tokens for sp in sps]  # never one more
    for x, y in zip(a, b):
        assert (x.logprobs is None) == (y.logprobs is None)
        for (lp1, _), (lp2, _) in zip(x.logprobs or (), y.logprobs or ()):
            assert lp2 == pytest.approx(lp1, abs=1e-5)
    assert_clean(overlapped)


def test_sliding_window_greedy_identical():
    """Blocks leave the window while a step is in flight: they are reused only by later steps."""
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # past the window 32
    out = []
    for a in (False, True):
        llm = make(a, "tiny-mistral-swa", block_size=16)
        out.append(ids(llm.generate(prompts(), sp)))
        if a:
            assert_clean(llm)
        llm.close()
    assert out[1] == out[0]


def test_sliding_window_sessions_with_chunks_in_flight():
    """Agent turns arriving while others prefill: a block leaves the window only once the step
    in flight (whose first queries may still attend to it) is done, not when the next step is
    allocated (its table entry is nulled in place; kv/managers/sliding_window.py)."""
    from tests.engine.test_async_tiers import run_sessions
    out = []
    for a in (False, True):
        llm = make(a, "tiny-mistral-swa", block_size=16, enable_prefix_caching=False)
        out.append(run_sessions(llm)[0])
        if a:
            assert_clean(llm)
        llm.close()
    assert out[1] == out[0]


def varied_then_stopped(llm: LLM) -> tuple:
    """Greedy tokens at varied max_tokens, then tokens and finish reasons with a stop token
    that turns up mid-run (taken from the first run)."""
    sps = [SamplingParams(temperature=0.0, max_tokens=1 + i % 5 * 4, ignore_eos=True)
           for i in range(len(prompts()))]
    varied = ids(llm.generate(prompts(), sps))
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                        stop_token_ids=[varied[1][3]])
    stopped = llm.generate(prompts(), sp)
    assert stopped[1].finish_reason == "stop"
    return varied, ids(stopped), [o.finish_reason for o in stopped]


def test_stop_token_ends_at_it_and_the_extra_row_emits_nothing(pair):
    plain, overlapped = pair
    ref = ids(plain.generate(prompts(), GREEDY))
    stop = ref[0][6]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop])
    a, b = plain.generate(prompts(), sp), overlapped.generate(prompts(), sp)
    assert ids(b) == ids(a)
    assert b[0].token_ids == ref[0][:ref[0].index(stop) + 1] and b[0].finish_reason == "stop"
    assert [o.finish_reason for o in b] == [o.finish_reason for o in a]
    # stop strings: the front end aborts the request, a token may be in flight for it then
    text = plain.generate(prompts()[1], GREEDY)[0].text
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                        stop=[text[len(text) // 2:len(text) // 2 + 2]])
    x, y = plain.generate(prompts()[1], sp)[0], overlapped.generate(prompts()[1], sp)[0]
    assert y.finish_reason == "stop" and (y.text, y.token_ids) == (x.text, x.token_ids)
    assert_clean(overlapped)


def abort_in_flight(llm: LLM) -> None:
    """Abort one of four decoding requests while its next token is computed: nothing more is
    emitted for it, the others run to max_tokens, nothing leaks."""
    core = llm.core
    sp = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(prompts()[:4]):
        core.add(EngineCoreRequest(request_id=f"ab{i}", prompt_token_ids=p, sampling=sp,
                                   max_tokens=30))
    got: dict[str, list[int]] = {}
    for _ in range(6):
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    victim = core.scheduler.requests["ab1"]
    assert victim.num_output_placeholders == 1  # its next token is being computed
    assert core.abort("ab1")
    emitted = len(got["ab1"])
    while core.has_work():
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert len(got["ab1"]) == emitted
    assert all(len(got[f"ab{i}"]) == 30 for i in (0, 2, 3))
    assert_clean(llm)


def test_abort_with_a_token_in_flight_emits_nothing_after(pair):
    abort_in_flight(pair[1])


def test_preemption_and_chunked_prefill_stay_exact():
    plain = make(False)
    ref = ids(plain.generate(prompts(), GREEDY))
    page = plain.core.runner.kv_cache_config.page_bytes
    plain.close()
    kw = dict(kv_cache_memory=str(page * 10), block_size=16, scheduling_policy="fcfs",
              max_num_batched_tokens=40, long_prefill_threshold=24)
    small = [make(a, **kw) for a in (False, True)]
    out = [ids(llm.generate(prompts(), GREEDY)) for llm in small]
    assert out[1] == out[0] == ref
    assert small[1].core.scheduler.num_preemptions > 0
    assert_clean(small[1])
    for llm in small:
        llm.close()


def test_warm_turn_hits_the_prefix_cache_as_without_it(pair):
    """Turn 2 resends turn 1 and its answer: the blocks async scheduling cached (hashed from
    real tokens only, never a placeholder) are hit the same."""
    plain, overlapped = pair
    first = [list(range(40, 90)), list(range(100, 133))]
    turns = []
    for llm in pair:
        t1 = llm.generate(first, GREEDY)
        second = [p + o.token_ids + [5, 6, 7] for p, o in zip(first, t1)]
        t2 = llm.generate(second, GREEDY)
        turns.append((ids(t1), ids(t2), [o.num_cached_tokens for o in t2]))
    assert turns[1] == turns[0]
    assert all(n >= 48 for n in turns[1][2])  # most of turn 1's tokens, its outputs' blocks too
    assert_clean(overlapped)


def test_seeded_sampling_penalties_and_a_grammar_identical(pair):
    plain, overlapped = pair
    sp = SamplingParams(temperature=0.9, top_k=20, max_tokens=12, ignore_eos=True, seed=11,
                        repetition_penalty=1.3, presence_penalty=0.5, min_tokens=4)
    assert ids(overlapped.generate(prompts(), sp)) == ids(plain.generate(prompts(), sp))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    sp = SamplingParams(temperature=0.0, max_tokens=24, structured=StructuredOutputs(
        json_schema=json.dumps(schema)))
    mixed = prompts()[:3]
    sps = [sp, GREEDY, sp]  # grammar requests wait for their token; the plain one overlaps
    assert ids(overlapped.generate(mixed, sps)) == ids(plain.generate(mixed, sps))
    assert_clean(overlapped)


def test_cli_flag_parses_and_defaults_off():
    from loomserve.cli import build_parser, engine_config_from_args
    p = build_parser()
    assert not engine_config_from_args(p.parse_args(["serve"])).scheduler.async_scheduling
    cfg = engine_config_from_args(p.parse_args(["serve", "--async-scheduling"]))
    assert cfg.scheduler.async_scheduling


def test_request_status_survives_preemption_with_a_token_in_flight(pair):
    """A request preempted while its token is computed gets that token at update and is
    re-admitted only then (it must not prefill with a placeholder)."""
    _, overlapped = pair
    core = overlapped.core
    core.add(EngineCoreRequest(request_id="pre", prompt_token_ids=prompts()[2], sampling=GREEDY,
                               max_tokens=16))
    out = [t for _ in range(2) for o in core.step() for t in o.new_token_ids]
    req = core.scheduler.requests["pre"]
    assert req.num_output_placeholders == 1
    sched = core.scheduler
    sched.running.remove(req)
    sched._preempt(req, "decode_blocks")
    assert sched._held(req)  # waits for its token
    while core.has_work():
        out += [t for o in core.step() if o.request_id == "pre" for t in o.new_token_ids]
    assert req.status == RequestStatus.FINISHED_LENGTH and len(out) == 16
    assert out == ids(pair[0].generate([prompts()[2]], GREEDY))[0]
    assert_clean(overlapped)


def test_served_core_streams_the_same_tokens(pair):
    """Through the core loop (AsyncLLM, core in a thread): concurrent streams, one ended by a
    stop string the front end matched while a token was in flight; the engine ends idle."""
    import asyncio

    from loomserve.engine.async_llm import AsyncLLM
    from tests.engine.test_async_llm import wait_idle

    plain = pair[0]
    texts = ["the same prompt", "another prompt, longer than the first", "a third one"]
    ref = plain.generate(texts, GREEDY)
    stop = ref[1].text[4:7]
    stopped = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    engine = AsyncLLM(EngineConfig.from_kwargs(
        model=os.path.join(FIXTURES, "tiny-llama"), dtype="float32", kv_cache_memory="4MiB",
        async_scheduling=True), in_process=True)

    async def last(prompt, sp):
        out = None
        async for out in engine.generate(prompt, sp):
            pass
        return out

    async def main():
        outs = await asyncio.gather(last(texts[0], GREEDY), last(texts[1], stopped),
                                    last(texts[2], GREEDY))
        return outs, await wait_idle(engine)

    try:
        outs, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [outs[0].token_ids, outs[2].token_ids] == [ref[0].token_ids, ref[2].token_ids]
    want = plain.generate(texts[1], stopped)[0]
    assert (outs[1].text, outs[1].token_ids) == (want.text, want.token_ids)
    assert outs[1].finish_reason == "stop" and stats.kv_blocks_used == 0


def test_tensor_parallel_2_matches_its_synchronous_engine(monkeypatch):
    """-tp 2 (a worker process, gloo): the step message and every collective go out on the
    execution thread, in schedule order; greedy tokens, a stop token and an abort with a
    token in flight as with the synchronous -tp 2 engine; no block leaks."""
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")  # the worker inherits the environment
    runs = []
    for a in (False, True):  # one after the other: this process is rank 0 of one group
        llm = make(a, tensor_parallel_size=2)
        try:
            runs.append(varied_then_stopped(llm))
            if a:
                abort_in_flight(llm)
                assert llm.core.executor.bytes_sent > 0  # the steps did reach the worker
        finally:
            llm.close()
    assert runs[1] == runs[0]


class GrowsWhenSliced(list):
    """A block list the core thread appends to between the encoder's len() and its slice
    (the step in flight's message is encoded while the next step allocates)."""

    def __getitem__(self, i):
        if isinstance(i, slice) and len(self) < 9:
            self.append(len(self) + 100)
        return super().__getitem__(i)


def test_step_message_takes_a_block_list_as_long_as_it_was_at_encoding():
    """The worker's table must equal the driver's list after every message: a block appended
    while a message is encoded goes out once, in the next one."""
    ids = GrowsWhenSliced([1, 2])
    sender, receiver = BlockSyncSender(), BlockSyncReceiver()
    for step in range(4):
        n = len(ids)
        inp = ModelInput([ScheduledSeq("r", [5], step, [ids], True, None)])
        got = receiver.model_input(decode(encode(sender.message(inp))))
        assert got.seqs[0].block_ids[0] == list(ids)[:n]
    assert len(ids) > n  # the list did grow during an encoding


HYBRID = dict(kv_cache_memory="8MiB", max_hybrid_block_size=0)  # 16-token blocks


def stop_token(ref: list[int], prompt: list[int], fills_block: bool) -> int:
    """A token of ref at index >= 3, its first occurrence, where the request's tokens up to it
    fill whole blocks (fills_block) or not: a stop token to end the request there."""
    for i in range(3, len(ref)):
        if ref[i] not in ref[:i] and ((len(prompt) + i + 1) % 16 == 0) == fills_block:
            return ref[i]
    raise AssertionError(f"no such token in {ref}")


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-qwen3-5", "tiny-nemotron-h",
                                  "tiny-kimi-linear"])
def test_hybrid_cold_warm_and_stop_tokens_match_sync(name):
    """Gated DeltaNet, Mamba2 and KDA layers beside attention. Cold, then a warm turn
    resending turn 1's prompt and output: the same tokens and the same cached-token counts,
    hits past the prompt included (checkpoints a decode step took at a boundary ending in a
    placeholder, hashed once the token is known). Then stop tokens: a stopped request's extra
    row (its stop token's) runs in the step in flight; where it ends a block, async keeps that
    block (state and KV after exactly those tokens) and the next turn hits one block more,
    with the same output; elsewhere the hits are the synchronous engine's."""
    llms = [make(a, name, **HYBRID) for a in (False, True)]
    first = [list(range(40, 77)), list(range(100, 133)), list(range(200, 220)),
             list(range(7, 30))]

    def turns(llm, sps):
        t1 = llm.generate(first, sps)
        t2 = llm.generate([p + o.token_ids + [5, 6, 7] for p, o in zip(first, t1)], GREEDY)
        assert_clean(llm)
        return ids(t1), [o.finish_reason for o in t1], ids(t2), [o.num_cached_tokens for o in t2]

    try:
        cold = [turns(llm, GREEDY) for llm in llms]
        assert cold[1] == cold[0]
        assert any(n > len(p) // 16 * 16 for n, p in zip(cold[1][3], first))
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        sps = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                              stop_token_ids=[stop_token(r, p, fills_block=i % 2 == 0)])
               for i, (p, r) in enumerate(zip(first, ids(llms[0].generate(first, long))))]
        for llm in llms:
            assert llm.core.kv.reset_prefix_cache()
        (a1, fa, a2, ca), (b1, fb, b2, cb) = [turns(llm, sps) for llm in llms]
        assert b1 == a1 and fb == fa == ["stop"] * 4 and b2 == a2
        assert cb == [c + 16 * (i % 2 == 0) for i, c in enumerate(ca)]
    finally:
        for llm in llms:
            llm.close()


def test_a_cpu_model_leaves_a_core_to_the_core_thread(monkeypatch):
    """On a CPU the model runs one thread fewer under async scheduling (an OpenMP team on
    every core stalls while the core thread works beside it), restored when the engine closes;
    LOOMSERVE_NUM_THREADS, or a GPU, leaves the count alone."""
    import torch

    from loomserve.engine.step_overlap import leave_a_core
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "3")
        assert leave_a_core(torch.device("cpu")) is None and torch.get_num_threads() == 3
        monkeypatch.delenv("LOOMSERVE_NUM_THREADS")
        assert leave_a_core(torch.device("cuda")) is None
        llm = make(True)
        assert torch.get_num_threads() == 2
        llm.close()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
