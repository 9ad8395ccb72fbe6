"""MTP drafts (`"method": "mtp"`) on tiny-deepseek-v3, whose checkpoint carries one MTP module.

Oracles: the MTP module's logits against DeepSeek's formula in plain torch around transformers'
decoder layer (tests/fixtures/build_mla_fixture.py: mtp_reference), fed transformers' own final
hidden states after the norm (as vLLM and SGLang feed it, deepseek_mtp.py), for one prompt, for
its chained drafts 2 and 3 (fed the previous step's output after shared_head.norm), and for
every draft of a multi-step run (the MTP cache rows stay those of the accepted tokens); greedy
outputs against the same engine without speculation,
cold and warm (prefix hits), chunked, preempted, with two modules, with every block and every
per-request state gone afterwards. The fixture's MTP head was fitted to the target's greedy
continuations of MTP_PROMPT, so drafts there are accepted and rejected both.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
import torch

from loomserve import SamplingParams
from loomserve.config import EngineConfig
from loomserve.execution.batch import ModelInput
from loomserve.execution.spec_mtp import MtpRun
from tests.engine.test_spec_decode import fixture, make
from tests.execution.models.conftest import Blocks, seq

MTP = {"method": "mtp", "num_speculative_tokens": 3, "always_draft": True}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
MTP_PROMPT = list(range(20, 52)) * 2  # one the fixture's MTP head was fitted on
PROMPTS = [MTP_PROMPT, [7, 8, 9, 10, 11] * 6 + list(range(20, 29)), list(range(100, 113)),
           list(range(20, 52)) * 3]


def load_builder(filename: str = "build_mla_fixture.py"):
    """A fixture builder under tests/fixtures as a module (its references and fits)."""
    path = os.path.join(os.path.dirname(__file__), "..", "fixtures", filename)
    spec = importlib.util.spec_from_file_location(filename.removesuffix(".py"), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def plain():
    """(the engine without speculation, its greedy outputs of PROMPTS)."""
    llm = make("tiny-deepseek-v3", None)
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def reference():
    """(the builder module, its transformers reference model), loaded once."""
    b = load_builder()
    return b, b.reference_model(fixture("tiny-deepseek-v3"))


def fixture_without(tmp_path, name: str, prefix: str):
    """A copy of fixture `name` under tmp_path whose safetensors lack the tensors under prefix."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "no-mtp"
    shutil.copytree(fixture(name), dst)
    w = load_file(dst / "model.safetensors")
    save_file({k: v for k, v in w.items() if not k.startswith(prefix)},
              dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def mtp_runner(path: str, spec: dict | None = MTP):
    """A float32 CPU runner of the checkpoint at path with MTP drafts (spec None: without)."""
    from loomserve.execution.model_runner import ModelRunner
    return ModelRunner(EngineConfig.from_kwargs(model=path, dtype="float32", device="cpu",
                                                block_size=4, kv_cache_memory="2MB",
                                                speculative_config=spec))


def check_chained_drafts(reference_fn, r, s, tokens: list[int], sampled: int,
                         drafts: list[int], g: torch.Tensor, h: torch.Tensor) -> None:
    """Drafts 2 and 3 as the proposer chains them (one row at the next position fed the last
    draft and the previous step's output after shared_head.norm) against the reference fed
    the previous step's g alike, logits and ids. reference_fn(tokens, next token, chained)
    -> (logits, g) is the builder's plain-torch formula."""
    layer = r.model.mtp.layers[0]
    chain, prev = [g[-1]], h[-1:]
    for j in (1, 2):
        chain_ref, g = reference_fn(tokens + [sampled] + drafts[:j - 1], drafts[j - 1],
                                    tuple(chain))
        prev = r.mtp.run_module(r, 0, [MtpRun(s, len(tokens) + j - 1, [drafts[j - 1]], [], None)],
                                prev)
        torch.testing.assert_close(layer.logits(r.model, prev).float()[0], chain_ref[-1],
                                   atol=2e-4, rtol=2e-4)
        assert drafts[j] == int(chain_ref[-1].argmax()), j
        chain.append(g[-1])


def mla_reference_fn(reference, name: str):
    """check_chained_drafts' reference for a build_mla_fixture model (DeepSeek, GLM)."""
    b, model = reference
    return lambda tokens, nxt, chained: b.mtp_reference(fixture(name), tokens, nxt, ref=model,
                                                        chained=chained)


def test_mtp_logits_equal_the_plain_torch_reference(reference):
    r = mtp_runner(fixture("tiny-deepseek-v3"))
    assert r.model.mtp is not None and len(r.layer_specs) == 4  # 3 layers + the MTP layer's
    tokens = [5, 17, 301, 42, 42, 9, 128, 77, 3, 250, 64]
    table = Blocks(r.block_size).cover([], len(tokens) + 4)
    out = r.execute(ModelInput([seq("r", tokens, 0, table)]))
    sampled = out.sampled["r"]
    b, model = reference
    ref, g = b.mtp_reference(fixture("tiny-deepseek-v3"), tokens, sampled, ref=model)
    # draft 1 follows the prompt and the sampled token: the last row's argmax
    follows, drafts = out.drafts["r"]
    assert follows == len(tokens) + 1 and len(drafts) == 3
    assert drafts[0] == int(ref[-1].argmax())
    # every row's logits (the step's target hidden states again, same blocks)
    s = seq("r", tokens, 0, table)
    r.compute_logits(ModelInput([s]))
    hidden, r.model.last_hidden = r.model.last_hidden, None
    h = r.mtp.run_module(r, 0, [MtpRun(s, 0, tokens[1:] + [sampled], [hidden], None)])
    layer = r.model.mtp.layers[0]
    got = layer.logits(r.model, h).float()
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(h, g, atol=2e-4, rtol=2e-4)  # what a chained step is fed
    check_chained_drafts(mla_reference_fn(reference, "tiny-deepseek-v3"), r, s, tokens, sampled,
                         drafts, g, h)


def test_drafts_over_many_steps_match_a_full_recompute(reference):
    """Every step's draft 1 equals the reference's argmax over the whole final sequence at
    that position: the MTP rows in the cache stay those of the accepted tokens through
    chunked prefill, verification with rejections, rollback and prefix hits."""
    b, model = reference
    prompt = b.MTP_PROMPTS[0]
    llm = make("tiny-deepseek-v3", MTP, max_num_batched_tokens=32)
    seen: list[tuple[int, int]] = []
    receive = llm.core.spec.receive
    llm.core.spec.receive = lambda d: (seen.extend((c, ids[0]) for c, ids in d.values()),
                                       receive(d))
    for _ in range(2):  # cold, then warm (prefix hits)
        out = llm.generate([prompt], GREEDY)[0].token_ids
    stats = llm.core.spec.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    tokens = list(prompt) + list(out)
    logits, _ = b.mtp_reference(fixture("tiny-deepseek-v3"), tokens[:-1], tokens[-1], ref=model)
    assert len(seen) > 10
    for count, first in seen:  # drafted when the request had `count` tokens: row count - 2
        assert first == int(logits[count - 2].argmax()), count


@pytest.mark.parametrize("name, message", [
    ("tiny-deepseek-v3-noqlora", "holds no model.layers.2.eh_proj.weight"),  # config says 1
    ("tiny-llama", "LlamaForCausalLM is not supported"),
])
def test_mtp_is_refused_without_mtp_weights_or_family(name, message):
    with pytest.raises(ValueError, match=message):
        mtp_runner(fixture(name))


def test_greedy_identical_with_mtp_drafts_cold_and_warm_and_leak_free(plain):
    _, ref = plain
    # 32-token steps: prompts run as several chunks (the MTP's held-back chunk row)
    llm = make("tiny-deepseek-v3", MTP, max_num_batched_tokens=32)
    cold = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    warm = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]  # prefix hits this time
    assert cold == ref and warm == ref
    stats = llm.core.spec.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_drafts
    assert stats.num_accepted_tokens > 0 and stats.accepted_per_pos[0] > 0
    for _ in range(3):  # many requests, chunked prompts among them: nothing left behind
        llm.generate(PROMPTS, GREEDY)
    assert_clean_mtp(llm)


def assert_clean_mtp(llm) -> None:
    core = llm.core
    assert core.kv.num_free_blocks == llm.free_at_start
    assert not core.scheduler.requests and not core.scheduler.running
    assert not core.spec._views and not core.spec.drafter._drafts
    assert not core.executor.driver_runner.mtp._held


def check_greedy_and_first_drafts(name: str, prompts: list[list[int]], sp, reference_logits):
    """Greedy outputs with MTP drafts equal the plain engine's cold (prompts in 32-token chunks:
    the MTP's held-back chunk row) and warm (prefix hits), drafts both accepted and rejected,
    nothing left behind; and every step's draft 1 of the first prompt equals the argmax, at
    that position, of reference_logits(tokens[:-1], tokens[-1]) over the prompt and its output
    (the MTP cache rows stay those of the accepted tokens through chunks, rejections, rollback
    and prefix hits)."""
    want = [o.token_ids for o in make(name, None).generate(prompts, sp)]
    llm = make(name, MTP, max_num_batched_tokens=32)
    seen: list[tuple[int, int]] = []
    receive = llm.core.spec.receive
    llm.core.spec.receive = lambda d: (seen.extend((c, ids[0]) for c, ids in d.values()),
                                       receive(d))
    cold = [o.token_ids for o in llm.generate(prompts[:1], sp)]
    drafts_of_first = list(seen)
    cold += [o.token_ids for o in llm.generate(prompts[1:], sp)]
    warm = [o.token_ids for o in llm.generate(prompts, sp)]  # prefix hits this time
    assert cold == want and warm == want
    stats = llm.core.spec.stats
    assert stats.num_draft_tokens > stats.num_drafts > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_clean_mtp(llm)
    tokens = prompts[0] + want[0]
    logits = reference_logits(tokens[:-1], tokens[-1])
    assert len(drafts_of_first) > 5
    for count, first in drafts_of_first:  # drafted when the request had `count` tokens
        assert first == int(logits[count - 2].argmax()), count



def test_mtp_drafter_proposes_only_for_the_token_count_drafted_for():
    from loomserve.engine.spec.drafter import DraftRequest
    from loomserve.engine.spec.mtp import MtpDrafter

    d = MtpDrafter()
    tokens = [1, 2, 3]
    req = DraftRequest("a", None, tokens, 2)
    d.receive({"a": (3, [7, 8, 9])})
    assert d.propose(req, 2) == [7, 8]
    tokens.append(4)  # the request moved on (drafts made for an older state)
    assert d.propose(req, 3) == []
    d.on_finished(req)
    assert not d._drafts


def test_two_mtp_modules_chain_through_both(tmp_path, plain):
    """num_nextn_predict_layers 2 (a copy of the module at layer 4): draft 2 comes from the
    second module, whose attention is a fifth MLA layer; greedy output unchanged."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = fixture("tiny-deepseek-v3"), tmp_path / "two-mtp"
    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    w.update({k.replace("model.layers.3.", "model.layers.4."): v.clone()
              for k, v in w.items() if k.startswith("model.layers.3.")})
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    llm = make(str(dst), MTP)
    r = llm.core.executor.driver_runner
    assert len(r.model.mtp.layers) == 2 and len(r.layer_specs) == 5
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain[1]
    assert llm.core.spec.stats.num_draft_tokens > llm.core.spec.stats.num_drafts
    assert_clean_mtp(llm)


def test_mtp_config_parses_and_rejects_unknown_keys():
    from loomserve.config.speculative import SpeculativeConfig

    cfg = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}')
    assert cfg.method == "mtp" and cfg.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2, "layers": 1})


def test_small_pool_preemption_stays_exact_and_leak_free(plain):
    engine, ref = plain
    page = engine.core.runner.kv_cache_config.page_bytes  # without the MTP layer's rows
    llm = make("tiny-deepseek-v3", MTP, kv_cache_memory=str(page * 14), block_size=16,
               scheduling_policy="fcfs", max_num_batched_tokens=40, long_prefill_threshold=24)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.spec.stats.num_accepted_tokens > 0
    assert_clean_mtp(llm)
