"""Sampler features: logprobs (against transformers as the oracle), presence / frequency /
repetition penalties, logit_bias, min_tokens; plain requests unchanged by featureful neighbours;
the finishing stop token's text left out of the output."""

from __future__ import annotations

import pytest
import torch

from loomserve.execution.batch import ScheduledSeq
from loomserve.execution.sampler import Sampler, greedy_ids
from loomserve.sampling_params import SamplingParams
from tests.execution.conftest import TINY_LLAMA, make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = [[1, 17, 33, 90, 12], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 200, 201]]


@pytest.fixture(scope="module")
def llm():
    engine = make_llm()
    yield engine
    engine.close()


def _seq(params: SamplingParams, history=None, num_prompt=0, suppress=None) -> ScheduledSeq:
    return ScheduledSeq("r", [0], 0, [[]], True, params, len(history or []) - num_prompt,
                        history=history, num_prompt_tokens=num_prompt, suppress=suppress)


def _sample(logits, seqs):
    return Sampler(torch.device("cpu"), 0).sample(logits.clone(), seqs)


# -- unit: the sampler on hand-made logits ------------------------------------------------------

def test_greedy_ids_equal_torch_argmax_ties_and_views_included():
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 5, (7, 301), generator=g).float()  # many ties per row
    logits[3, 10] = float("inf")
    logits[4] = float("-inf")
    logits[4, 200] = 0.0
    for x in (logits, logits[::2], logits[:, 1:], logits.t().contiguous().t()):
        assert greedy_ids(x) == x.argmax(dim=-1).tolist()
    half = logits.to(torch.bfloat16)  # not numpy's: torch's path
    assert greedy_ids(half) == half.argmax(dim=-1).tolist()
    assert greedy_ids(logits[:0]) == []


def test_penalties_follow_openai_and_hf_semantics():
    vocab = 8
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, 1.0, -2.0, 2.5]])
    history = [4, 1, 3, 3, 0]  # prompt [4, 1], output [3, 3, 0]
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    got = logits.clone()
    from loomserve.execution.logits_processors import apply_logits_processors
    apply_logits_processors(got, [_seq(p, history, 2)], None)
    want = logits.clone()
    want[0, 3] -= 0.25 * 2 + 0.5
    want[0, 0] -= 0.25 * 1 + 0.5  # prompt tokens 4 and 1 are not penalized by these two
    assert torch.allclose(got, want)
    rp = SamplingParams(temperature=0, repetition_penalty=2.0)
    got = logits.clone()
    apply_logits_processors(got, [_seq(rp, history, 2)], None)
    want = logits.clone()
    for t in (4, 1, 3, 0):  # prompt and output: positive / 2, negative * 2
        want[0, t] = want[0, t] / 2 if want[0, t] > 0 else want[0, t] * 2
    assert torch.allclose(got, want)
    assert got.shape[-1] == vocab


def test_repetition_penalty_turns_greedy_away_from_a_repeated_token():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    assert _sample(logits, [_seq(SamplingParams(temperature=0), [0, 0], 1)]).tokens == [0]
    rp = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert _sample(logits, [_seq(rp, [0, 0], 1)]).tokens == [1]


def test_logit_bias_and_suppress_touch_only_their_rows():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    plain = SamplingParams(temperature=0)
    biased = SamplingParams(temperature=0, logit_bias={7: 100.0})
    out = _sample(logits, [_seq(plain), _seq(biased), _seq(plain, suppress=[int(logits[2].argmax())])])
    assert out.tokens[0] == int(logits[0].argmax())
    assert out.tokens[1] == 7
    assert out.tokens[2] == int(logits[2].topk(2).indices[1])


def test_logprobs_are_raw_log_softmax_and_only_for_rows_asking():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2)) * 2
    asks = SamplingParams(temperature=0, logprobs=4, logit_bias={3: 50.0})
    out = _sample(logits, [_seq(SamplingParams(temperature=0)), _seq(asks)])
    assert list(out.logprobs) == [1]
    lp, ids, vals = out.logprobs[1]
    raw = torch.log_softmax(logits[1], -1)
    assert out.tokens[1] == 3
    assert lp == pytest.approx(float(raw[3]), abs=1e-5)  # before logit_bias
    assert ids == raw.topk(4).indices.tolist()
    assert vals == pytest.approx(raw.topk(4).values.tolist(), abs=1e-5)


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = torch.randn(1, 10)
    out = _sample(logits, [_seq(SamplingParams(temperature=0, logprobs=0))])
    lp, ids, vals = out.logprobs[0]
    assert ids == [] and vals == [] and lp == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-5)


@pytest.mark.parametrize("kwargs", [dict(logprobs=21), dict(logprobs=-1), dict(presence_penalty=3),
                                    dict(frequency_penalty=-2.5), dict(repetition_penalty=0),
                                    dict(logit_bias={1: 101}), dict(min_tokens=-1),
                                    dict(min_tokens=20, max_tokens=10)])
def test_out_of_range_features_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


# -- the engine on the tiny fixture -----------------------------------------------------------

def test_logprobs_match_transformers(llm):
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5)
    out = llm.generate(PROMPTS[0], params)[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    hf = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, torch_dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0] + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)
    for k, (lp, top) in enumerate(out.logprobs):
        row = ref[len(PROMPTS[0]) - 1 + k]
        assert lp == pytest.approx(float(row[out.token_ids[k]]), abs=1e-4)
        assert [t for t, _ in top] == row.topk(5).indices.tolist()
        assert [v for _, v in top] == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)
        assert top[0][0] == out.token_ids[k]  # greedy picks the top-1


def test_plain_greedy_outputs_unchanged_by_featureful_neighbours(llm):
    alone = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    mixed = [GREEDY, SamplingParams(temperature=0.0, max_tokens=8, logprobs=3,
                                    presence_penalty=1.0, repetition_penalty=1.3,
                                    logit_bias={9: 5.0}, min_tokens=4), GREEDY]
    together = [o.token_ids for o in llm.generate(PROMPTS, mixed)]
    assert together[0] == alone[0] and together[2] == alone[2]
    assert together[1] != alone[1]  # the featureful one did change


def test_large_logit_bias_forces_a_token(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, seed=5, max_tokens=5,
                                                  logit_bias={42: 100.0}))[0]
    assert out.token_ids == [42] * 5


def test_min_tokens_holds_back_eos_then_stop_text_is_left_out(llm):
    eos = 2  # tiny-llama's <|endoftext|>
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=4,
                            logit_bias={eos: 100.0}, skip_special_tokens=False)
    out = llm.generate(PROMPTS[0], params)[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    assert out.finish_reason == "stop"
    assert "<|endoftext|>" not in out.text
    # without min_tokens the biased eos ends the request at once
    params.min_tokens = 0
    assert llm.generate(PROMPTS[0], params)[0].token_ids == [eos]


def test_frequency_penalty_reduces_repeats(llm):
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = llm.generate(PROMPTS[2], base)[0].token_ids
    penal = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                    frequency_penalty=2.0))[0].token_ids
    assert max(penal.count(t) for t in set(penal)) < max(plain.count(t) for t in set(plain))


def test_logit_bias_id_beyond_vocab_is_rejected(llm):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}))


def test_min_tokens_also_holds_back_stop_strings(llm):
    base = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    text = llm.generate(PROMPTS[0], base)[0].text
    stop = text[:2]  # matches at once without min_tokens
    cut = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                  ignore_eos=True, stop=[stop]))[0]
    assert cut.text == "" and cut.finish_reason == "stop"
    held = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                   stop=[stop], min_tokens=6))[0]
    assert len(held.token_ids) >= 6
