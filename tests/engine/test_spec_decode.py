"""Speculative decoding (ngram drafts, verification, rollback) against plain decoding.

Oracle: the same engine without --speculative-config. Greedy outputs must be identical token
for token (drafts only change how many tokens a step emits), on every attention kind; prompts
repeat text so prompt lookup drafts, and acceptance is asserted to be > 0. After the runs no
block, request or drafter state may remain. The rejection sampler's exactness at temperature 1
is a chi-square test against the target distribution.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from loomserve import SamplingParams
from loomserve.config.speculative import SpeculativeConfig
from loomserve.engine.spec.budget import PROBE_EVERY, DraftBudget
from loomserve.engine.spec.ngram import lookup
from loomserve.execution.batch import ScheduledSeq
from loomserve.execution.rejection_sampler import verify
from loomserve.execution.sampler import Sampler
from loomserve.sampling_params import StructuredOutputs
from tests.kv.transfer.conftest import leg, prefill

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
# always_draft: verify drafts whatever the budget would say of this host's step times
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 4, "always_draft": True}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BASE = list(range(20, 52))


def prompts() -> list[list[int]]:
    """Repeated text (an edit repeats what it changes), and one that repeats less."""
    return [BASE * 3, [7, 8, 9, 10, 11] * 8 + BASE[:9], BASE[:20] + [60, 61] + BASE[:20],
            list(range(100, 140))]


def fixture(name: str) -> str:
    path = os.path.abspath(os.path.join(FIXTURES, name))
    if not os.path.isdir(path):
        pytest.skip(f"tests/fixtures/{name} is missing")
    return path


def make(name: str, spec: dict | None = NGRAM, **kw):
    from loomserve import LLM
    kw.setdefault("kv_cache_memory", "4MiB")
    llm = LLM(fixture(name), dtype="float32", speculative_config=spec, **kw)
    llm.free_at_start = llm.core.kv.num_free_blocks  # all but a null block, if one
    return llm


def assert_clean(llm) -> None:
    """Nothing left behind: every block free as at the start, no request state."""
    core = llm.core
    assert core.kv.num_free_blocks == llm.free_at_start
    assert not core.scheduler.requests and not core.scheduler.running
    if core.spec is not None:
        assert not core.spec._views and not core.spec.drafter._tokens


# -- drafter, config, budget ------------------------------------------------------------------

def test_ngram_takes_the_longest_suffix_at_its_latest_occurrence():
    a = np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 4, 6, 7, 1, 2, 3, 4], dtype=np.int32)
    assert lookup(a, 2, 5, 3).tolist() == [6, 7, 1]  # 1 2 3 4 last seen before 6 7
    assert lookup(a, 2, 5, 1).tolist() == [6]
    b = np.array([5, 1, 2, 8, 3, 2, 9, 1, 2], dtype=np.int32)
    assert lookup(b, 2, 3, 4).tolist() == [8, 3, 2, 9]  # "1 2" beats the later "2"
    assert lookup(b, 1, 1, 2).tolist() == [9, 1]  # length 1: the latest "2"
    assert lookup(np.array([5, 6, 7, 5], dtype=np.int32), 2, 5, 3).size == 0  # too short
    assert lookup(np.array([4], dtype=np.int32), 1, 2, 3).size == 0


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup_max": 3}, "unknown key"),
    ("{method", "not valid JSON"),
])
def test_bad_config_is_a_clear_error(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


def test_cli_flag_parses_and_rejects():
    from loomserve.cli import build_parser, engine_config_from_args
    p = build_parser()
    args = p.parse_args(["serve", "--speculative-config", json.dumps(NGRAM)])
    spec = engine_config_from_args(args).speculative.speculative_config
    assert spec.method == "ngram" and spec.num_speculative_tokens == 4
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--speculative-config", '{"method": "ngram"}'])


def _draft_rows(b: DraftBudget, candidates, num_decodes=None) -> list[int]:
    n = len(candidates) if num_decodes is None else num_decodes
    return b.allocate(candidates, n, b.step_cap(n))


def test_budget_pays_only_with_acceptance_and_small_batches():
    cfg = SpeculativeConfig("ngram", 4, disable_by_batch_size=8, max_draft_tokens_per_step=16)
    b = DraftBudget(cfg)
    assert _draft_rows(b, [("r0", 4)]) == [4]  # optimistic prior, step time not known yet
    assert _draft_rows(b, [("r0", 2)]) == [2]  # never more than the drafter has
    assert _draft_rows(b, [(f"r{i}", 4) for i in range(8)]) == [2] * 8  # 16 a step, by value
    assert b.step_cap(9) == 0  # past disable_by_batch_size
    for _ in range(300):
        b.observe("r0", 0, True)  # every draft rejected
        b.end_step()
    got = [_draft_rows(b, [("r0", 4)]) for _ in range(2 * PROBE_EVERY)]
    assert got.count([0]) == 2 * PROBE_EVERY - 2 and got.count([1]) == 2  # probes only
    for _ in range(300):
        b.observe("r0", 4, False)
        b.end_step()
    assert _draft_rows(b, [("r0", 4)]) == [4]


def test_budget_gives_drafts_to_the_requests_that_copy():
    """One request accepts every draft, one none: the first gets them all, the second none (a
    batch-wide acceptance of ~1/2 would give both a few, or neither)."""
    b = DraftBudget(SpeculativeConfig("ngram", 4))
    for step in range(40):
        b.step_cap(2)
        b.observe("copy", 4, False)
        b.observe("novel", 0, True)
        b.end_step()
    assert 0.3 < b.acceptance < 0.9
    assert b.request_acceptance("copy") > 0.9
    assert b.request_acceptance("novel") < b.min_yield  # below the floor: not even proposed
    assert _draft_rows(b, [("copy", 4), ("novel", 4)]) == [4, 0]
    assert b.request_acceptance("new") == b.acceptance  # no history: the batch's estimate
    b.forget("copy")
    assert b.request_acceptance("copy") == b.acceptance


def test_budget_asks_a_dear_drafter_with_nothing_to_offer_only_every_few_steps():
    """The drafter's call costs every time, its drafts come only with q_r (the share of the
    request's asks that gave drafts): with a dear drafter a request whose asks keep coming
    back empty is asked again only every few steps, one whose drafter gives drafts every step;
    with a cheap drafter both are asked every step."""
    def run(propose_s: float) -> dict[str, list[int]]:
        b = DraftBudget(SpeculativeConfig("ngram", 4))
        for n, d in [(2, 0), (4, 0), (2, 2), (4, 4), (2, 1)] * 4:  # T = 1 + 4B + D + [D>0] ms
            b.observe_step(n, d, 0.001 + 0.004 * n + 0.001 * d + 0.001 * (d > 0))
        b.propose_s = propose_s
        asked: dict[str, list[int]] = {"novel": [], "copy": []}
        for step in range(60):
            b.step_cap(2)
            for rid in asked:
                if b.worth_proposing(rid, 2):
                    asked[rid].append(step)
                    b.observe_ask(rid, rid == "copy")
            b.end_step()
        return asked
    dear = run(0.0015)  # a call costs a sixth of the step
    assert len(dear["copy"]) == 60
    novel = dear["novel"]
    assert novel[0] == 0 and 2 <= len(novel) <= 10 and novel[1] > 4  # asked again later
    cheap = run(0.00001)
    assert len(cheap["copy"]) == len(cheap["novel"]) == 60


# -- the rejection sampler in isolation ----------------------------------------------------------

def _seqs(n, drafts, **sp):
    params = SamplingParams(max_tokens=100, **sp)
    return [ScheduledSeq(f"r{i}", [3] + drafts, 10, [[0]], True, params, num_draft=len(drafts))
            for i in range(n)]


def test_greedy_verification_accepts_while_draft_is_argmax():
    logits = torch.full((3, 8), -5.0)
    logits[0, 4] = logits[1, 6] = logits[2, 1] = 5.0
    out = verify(Sampler(torch.device("cpu"), 0), logits.clone(), _seqs(1, [4, 5], temperature=0))
    assert out.verified["r0"] == [4, 6]  # 4 accepted, 5 rejected: row 1's argmax instead
    out = verify(Sampler(torch.device("cpu"), 0), logits.clone(), _seqs(1, [4, 6], temperature=0))
    assert out.verified["r0"] == [4, 6, 1]  # all accepted, plus the bonus token


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson chi-square at p = 0.001 (Wilson-Hilferty quantile for the degrees of freedom)."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    k = len(probs) - 1
    z = 3.09
    crit = k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3
    return stat < crit


def test_rejection_sampling_keeps_the_target_distribution():
    """Drafts [2, 5] against fixed rows: the first token ~ p0; after accepting 2, the second
    ~ p1; the bonus ~ p2 (each row's own distribution, whatever the draft)."""
    torch.manual_seed(0)
    vocab, n = 6, 20000
    row_logits = torch.randn(3, vocab)
    p = row_logits.softmax(-1).numpy().astype(np.float64)
    logits = row_logits.repeat(n, 1)
    out = verify(Sampler(torch.device("cpu"), 1), logits, _seqs(n, [2, 5], temperature=1.0))
    toks = list(out.verified.values())
    first = np.bincount([t[0] for t in toks], minlength=vocab)
    assert _chi2_ok(first, p[0])
    second = np.bincount([t[1] for t in toks if t[0] == 2], minlength=vocab)
    assert _chi2_ok(second, p[1])
    bonus = np.bincount([t[2] for t in toks if len(t) == 3], minlength=vocab)
    assert bonus.sum() > 100 and _chi2_ok(bonus, p[2])
    # a wrong sampler fails the same test: the draft always accepted
    biased = first.copy()
    biased[2] += biased.sum() // 10
    assert not _chi2_ok(biased, p[0])


def test_seeded_verification_is_reproducible():
    torch.manual_seed(1)
    logits = torch.randn(3, 16).repeat(4, 1)
    runs = [verify(Sampler(torch.device("cpu"), s), logits.clone(),
                   _seqs(4, [1, 2], temperature=0.8, seed=7)).verified for s in (0, 1)]
    assert runs[0] == runs[1]


# -- the engine -------------------------------------------------------------------------------

MODELS = ["tiny-llama", "tiny-qwen3", "tiny-mistral-swa", "tiny-deepseek-v3"]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_identical_cold_and_warm_and_leak_free(name):
    plain = make(name, None)
    ref = [o.token_ids for o in plain.generate(prompts(), GREEDY)]
    plain.close()
    llm = make(name)
    cold = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    warm = [o.token_ids for o in llm.generate(prompts(), GREEDY)]  # prefix hits this time
    assert cold == ref and warm == ref
    s = llm.core.stats()
    assert s.spec_decode_num_accepted_tokens > 0
    assert s.spec_decode_num_draft_tokens >= s.spec_decode_num_accepted_tokens
    assert sum(s.spec_decode_num_accepted_tokens_per_pos) == s.spec_decode_num_accepted_tokens
    assert s.generation_tokens == 2 * sum(map(len, ref))
    assert_clean(llm)
    llm.close()


@pytest.fixture(scope="module")
def pair():
    plain, spec = make("tiny-llama", None), make("tiny-llama")
    yield plain, spec
    plain.close()
    spec.close()


def test_small_pool_preemption_and_chunked_prefill_stay_exact(pair):
    plain, _ = pair
    ref = [o.token_ids for o in plain.generate(prompts(), GREEDY)]
    page = plain.core.runner.kv_cache_config.page_bytes
    llm = make("tiny-llama", kv_cache_memory=str(page * 12), block_size=16,
               scheduling_policy="fcfs", max_num_batched_tokens=40, long_prefill_threshold=24)
    out = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    assert out == ref
    assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.stats().spec_decode_num_accepted_tokens > 0
    assert_clean(llm)


def test_logprobs_stop_strings_and_max_tokens(pair):
    plain, spec = pair
    sp = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True, logprobs=2)
    a = plain.generate(prompts(), sp)
    b = spec.generate(prompts(), sp)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and len(y.logprobs) == len(y.token_ids) == 21
        for (lp1, top1), (lp2, top2) in zip(x.logprobs, y.logprobs):
            assert lp2 == pytest.approx(lp1, abs=1e-4)
            assert [t for t, _ in top1] == [t for t, _ in top2]
    # a stop string inside a verified run of tokens: nothing after it comes out
    stop = a[0].text[len(a[0].text) // 2:len(a[0].text) // 2 + 3]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    x, y = plain.generate(prompts()[0], sp)[0], spec.generate(prompts()[0], sp)[0]
    assert y.finish_reason == "stop" and y.text == x.text and y.token_ids == x.token_ids
    # a stop token: the output ends at it (drafts never run past a stop token)
    tok = a[0].token_ids[10]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[tok])
    y = spec.generate(prompts()[0], sp)[0]
    assert y.token_ids == a[0].token_ids[:a[0].token_ids.index(tok) + 1]
    assert_clean(spec)


def test_grammar_constrained_output_identical(pair):
    plain, spec = pair
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                               "b": {"type": "integer"}},
              "required": ["a", "b"]}
    sp = SamplingParams(temperature=0.0, max_tokens=40, structured=StructuredOutputs(
        json_schema=json.dumps(schema)))
    ps = ['{"a": "x", "b": 1} {"a": "x", "b": 1} {"a": "x", "b": 1}', "abc abc abc"]
    x = plain.generate(ps, sp)
    drafted = spec.core.stats().spec_decode_num_draft_tokens
    y = spec.generate(ps, sp)
    assert [o.token_ids for o in y] == [o.token_ids for o in x]
    assert spec.core.stats().spec_decode_num_draft_tokens > drafted  # drafts were verified
    assert_clean(spec)


def test_sampling_at_temperature_one_runs_clean(pair):
    _, spec = pair
    before = spec.core.stats().spec_decode_num_accepted_tokens
    sp = SamplingParams(temperature=1.0, top_k=8, max_tokens=24, ignore_eos=True, seed=3)
    out = spec.generate(prompts() * 2, sp)
    assert all(len(o.token_ids) == 24 for o in out)
    assert out[0].token_ids == out[4].token_ids  # seeded: reproducible within the batch
    assert spec.core.stats().spec_decode_num_accepted_tokens > before
    assert_clean(spec)


def test_metrics_families():
    from prometheus_client import CollectorRegistry, generate_latest

    from loomserve.api.metrics import EngineStatsCollector
    from loomserve.engine.messages import EngineStats

    class Engine:
        def stats(self):
            return EngineStats(spec_decode_num_drafts=3, spec_decode_num_draft_tokens=9,
                               spec_decode_num_accepted_tokens=4,
                               spec_decode_num_accepted_tokens_per_pos=[3, 1, 0])

    reg = CollectorRegistry()
    reg.register(EngineStatsCollector(Engine(), "m"))
    text = generate_latest(reg).decode()
    assert 'loomserve_spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'loomserve_spec_decode_num_accepted_tokens_total{model_name="m"} 4.0' in text
    assert ('loomserve_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
            'position="1"} 1.0') in text


def test_tensor_parallel_two_ranks_identical(monkeypatch):
    """-tp 2: every rank computes the drafts' logits rows (the step message carries
    num_draft), rank 0 verifies; the output is the one-rank plain engine's."""
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")  # the worker inherits the environment
    plain = make("tiny-llama", None)
    ref = [o.token_ids for o in plain.generate(prompts()[:2], GREEDY)]
    plain.close()
    llm = make("tiny-llama", tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in llm.generate(prompts()[:2], GREEDY)] == ref
        assert llm.core.stats().spec_decode_num_accepted_tokens > 0
        assert_clean(llm)
    finally:
        llm.close()


def test_bench_agentx_reads_the_counters():
    """`bench agentx` scrapes the counters before and after a run: acceptance and mean length."""
    from loomserve.bench.replay.scrape import (
        counter_delta,
        parse_spec_decode,
        spec_decode_summary,
    )
    from loomserve.bench.report import summary_table

    def text(drafts, tokens, accepted):  # what the server's collector exposes
        from prometheus_client import CollectorRegistry, generate_latest

        from loomserve.api.metrics import EngineStatsCollector
        from loomserve.engine.messages import EngineStats

        class Engine:
            def stats(self):
                return EngineStats(spec_decode_num_drafts=drafts,
                                   spec_decode_num_draft_tokens=tokens,
                                   spec_decode_num_accepted_tokens=accepted,
                                   spec_decode_num_accepted_tokens_per_pos=[accepted])

        reg = CollectorRegistry()
        reg.register(EngineStatsCollector(Engine(), "m"))
        return generate_latest(reg).decode()

    assert parse_spec_decode("# TYPE x counter\nx_total 1\n") is None  # not speculating
    delta = counter_delta(parse_spec_decode(text(10, 40, 5)), parse_spec_decode(text(30, 100, 35)))
    summary = spec_decode_summary(delta)
    assert summary["acceptance_rate"] == pytest.approx(0.5)
    assert summary["mean_acceptance_length"] == pytest.approx(2.5)
    table = summary_table({"metrics": {"spec_decode": summary}})
    assert "spec decode acceptance" in table and "50.00%" in table and "2.50" in table


def test_budget_drafts_only_where_the_measured_step_time_pays():
    """Rows nearly free (a memory-bound step): drafts; rows as dear as tokens: none at 50%
    acceptance, since 1 + E(d) tokens then cost 1 + d rows."""
    cfg = SpeculativeConfig("ngram", 4)
    cheap, dear = DraftBudget(cfg), DraftBudget(cfg)
    for rows, drafts in ((1, 0), (2, 2), (4, 0), (8, 8), (16, 0), (5, 3), (3, 1)):
        cheap.observe_step(rows, drafts, 0.010 + 0.0001 * (rows + drafts))
        dear.observe_step(rows, drafts, 0.0001 + 0.010 * (rows + drafts))
    for b in (cheap, dear):
        for _ in range(200):
            b.observe("r", 1, True)  # a = 1/2
            b.end_step()
    one, eight = [("r", 4)], [(f"r{i}", 4) for i in range(8)]
    assert _draft_rows(cheap, one) == [4] and min(_draft_rows(cheap, eight)) >= 2
    assert _draft_rows(dear, one) == [0] and _draft_rows(dear, eight) == [0] * 8
    assert not dear.worth_proposing("r", 8)  # the drafter is not even asked


def test_step_time_fit_prices_draft_rows_apart_from_requests():
    """Requests' rows dear (10 ms), draft rows cheap (0.5 ms, sharing a request's context
    pass), a verified step 2 ms of overhead: the fit tells the three apart, so drafts pay at 8
    requests and 50% acceptance; with one batch size only, the step's time at it is known."""
    b = DraftBudget(SpeculativeConfig("ngram", 4))
    for n, d in ((8, 0), (8, 8), (4, 2), (6, 0), (8, 16), (2, 4), (7, 7), (3, 0)):
        b.observe_step(n, d, 0.001 + 0.010 * n + 0.0005 * d + 0.002 * (d > 0))
    base, td, tv, tb = b.fit.prices(8)
    assert base == pytest.approx(0.081, rel=1e-3) and td == pytest.approx(0.0005, rel=1e-2)
    assert tv == pytest.approx(0.002, rel=1e-2) and tb == pytest.approx(0.010, rel=1e-2)
    for _ in range(200):
        b.observe("r", 1, True)
        b.end_step()
    assert sum(_draft_rows(b, [(f"r{i}", 4) for i in range(8)])) >= 8
    lockstep = DraftBudget(SpeculativeConfig("ngram", 4))
    for d in (0, 8, 0, 16, 4):
        lockstep.observe_step(32, d, 0.2 + 0.005 * d)
    base, td, tv, tb = lockstep.fit.prices(32)
    assert base == pytest.approx(0.2, rel=1e-3) and td == pytest.approx(0.005, rel=1e-3)
    assert tv == pytest.approx(0.0, abs=1e-6) and tb is None  # one batch size: not known


def test_step_time_fit_is_not_thrown_by_one_stalled_step():
    """A step 100x its usual time (a host pause, a first call's warm-up) counts as twice the
    prediction once the fit has settled: the prices stay known and move by less than 20%
    (unclipped, that one step makes the draft row's price negative: no prices at all)."""
    b = DraftBudget(SpeculativeConfig("ngram", 4))
    shapes = [(8, 0), (8, 8), (4, 2), (6, 0), (8, 16), (2, 4), (7, 7), (3, 0)] * 4
    for n, d in shapes:  # the CPU's regime: a draft row ~4 ms, a step of 8 requests 76 ms
        b.observe_step(n, d, 0.02 + 0.007 * n + 0.004 * d)
    base, td, _, _ = b.fit.prices(8)
    b.observe_step(8, 0, 100 * base)
    after = b.fit.prices(8)
    assert after is not None
    assert after[0] == pytest.approx(base, rel=0.2) and after[1] == pytest.approx(td, rel=0.2)


def test_drafts_for_part_of_a_batch_pay_by_the_request_rows_they_save():
    """Two requests of 32 copy (a = 0.9), the rest have nothing to draft: the steps go on for
    the 30 others, so an accepted token saves only a later request row (tb), not a step's
    share. Draft rows as dear as a request's (td = tb = 5 ms): no drafts; cheap (td 1 ms):
    drafts for the two; the batch never changed size (tb unknown): none."""
    def budget(td, sizes):
        b = DraftBudget(SpeculativeConfig("ngram", 4))
        for n in sizes:
            for d in (0, 8, 2, 16, 0, 4):
                b.observe_step(n, d, 0.02 + 0.005 * n + td * d)
        for _ in range(100):
            for r in ("a", "b"):
                b.observe(r, 9, True)  # a = 0.9
            b.end_step()
        return b
    two = [("a", 4), ("b", 4)]
    assert _draft_rows(budget(0.005, (24, 32, 28)), two, 32) == [0, 0]
    assert min(_draft_rows(budget(0.001, (24, 32, 28)), two, 32)) >= 2
    assert _draft_rows(budget(0.001, (32,)), two, 32) == [0, 0]
    # every request of the batch drafts: the batch needs fewer steps, a token is worth T / B
    everyone = [(r, 4) for r in "ab"]
    assert min(_draft_rows(budget(0.005, (2, 3, 4)), everyone, 2)) >= 1


def test_budget_weighs_a_verified_steps_overhead():
    """Rows nearly free but a step with drafts 1.5 ms dearer (a small model: proposals and
    verification cost more than its rows): at 1/2 acceptance one request's 4 drafts (0.94
    tokens expected) pay for it in a 2 ms step, one request's among 8 in a 9 ms step do not."""
    b = DraftBudget(SpeculativeConfig("ngram", 4))
    for n, d in ((1, 0), (1, 2), (8, 0), (8, 8), (4, 4), (2, 0), (8, 16), (1, 4)):
        b.observe_step(n, d, 0.001 * n + 0.00001 * d + 0.0015 * (d > 0) + 0.001)
    for _ in range(200):
        b.observe("r0", 1, True)
        b.end_step()
    assert _draft_rows(b, [("r0", 4)]) != [0]
    assert _draft_rows(b, [("r0", 4)], num_decodes=8) == [0]


def test_pd_decode_instance_speculates_on_imported_kv():
    """A decode instance with drafts after a P/D handover: it imports the prefill instance's
    KV (only the tail computed), verifies drafts over it, and emits the single instance's
    greedy tokens; nothing is left on it afterwards."""
    from loomserve import LLM

    def pd(role: str, spec: dict | None = None) -> LLM:
        return LLM(fixture("tiny-llama"), dtype="float32", role=role, kv_cache_memory="2MiB",
                   block_size=16, kv_transfer_backend="inproc", speculative_config=spec)

    ref, a, b = pd("both"), pd("prefill"), pd("decode", NGRAM)
    try:
        prompt = BASE * 3 + BASE[:4]
        want = leg(ref, "r", prompt, GREEDY).token_ids
        b.free_at_start = b.core.kv.num_free_blocks
        out = leg(b, "d", prompt, GREEDY, prefill(a, "p", prompt))
        assert out.num_tier_cached_tokens == 96  # imported, not recomputed
        assert out.token_ids == want
        assert b.core.stats().spec_decode_num_accepted_tokens > 0
        b.core.kv.reset_prefix_cache()
        assert_clean(b)
    finally:
        for e in (ref, a, b):
            e.close()
