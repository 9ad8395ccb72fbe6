"""MTP drafts (`"method": "mtp"`) on tiny-glm4-moe, whose checkpoint carries GLM-4.5's MTP layer
at model.layers.3 (execution/models/glm4_moe_mtp.py), driven by the proposer DeepSeek-V3's
modules use (execution/spec_mtp.py).

Oracles: the MTP layer's logits against the MTP formula in plain torch around transformers'
Glm4Moe decoder layer (tests/fixtures/build_mla_fixture.py: mtp_reference, family-agnostic),
fed transformers' own final hidden states after the norm (GLM's contract, glm4_moe_mtp.py), for
one prompt, for its chained drafts 2 and 3 (fed the previous step's normed output), and for
every draft 1 of a multi-step run;
greedy outputs against the same engine without speculation, cold and warm (prefix hits),
chunked, with every block and every per-request state gone afterwards. The fixture's MTP head
was fitted to the target's greedy continuations of MTP_PROMPT, so drafts there are accepted
and rejected both.
"""

from __future__ import annotations

import json

import pytest
import torch

from loomserve.execution.batch import ModelInput
from loomserve.execution.spec_mtp import MtpRun
from loomserve.kv.spec import FullAttentionSpec
from tests.engine.test_spec_decode import fixture, make
from tests.engine.test_spec_mtp import (
    GREEDY,
    MTP,
    PROMPTS,
    assert_clean_mtp,
    check_chained_drafts,
    check_greedy_and_first_drafts,
    fixture_without,
    load_builder,
    mla_reference_fn,
    mtp_runner,
)
from tests.execution.models.conftest import Blocks, seq

NAME = "tiny-glm4-moe"


@pytest.fixture(scope="module")
def reference():
    """(build_mla_fixture, its transformers reference model of tiny-glm4-moe), loaded once."""
    b = load_builder()
    return b, b.reference_model(fixture(NAME))


def test_mtp_logits_equal_the_plain_torch_reference(reference):
    r = mtp_runner(fixture(NAME))
    assert type(r.model.mtp).__name__ == "Glm4MoeMTP"
    # the MTP layer's GQA attention: a fourth full-attention layer, in the model's one group
    assert len(r.layer_specs) == 4 and all(isinstance(s, FullAttentionSpec) for s in r.layer_specs)
    assert [g.layer_ids for g in r.kv_cache_config.groups] == [(0, 1, 2, 3)]
    assert type(r.model.mtp.layers[0].mlp).__name__ == "DeepseekMoE"
    tokens = [5, 17, 301, 42, 42, 9, 128, 77, 3, 250, 64]
    table = Blocks(r.block_size).cover([], len(tokens) + 4)
    out = r.execute(ModelInput([seq("r", tokens, 0, table)]))
    sampled = out.sampled["r"]
    b, model = reference
    ref, g = b.mtp_reference(fixture(NAME), tokens, sampled, ref=model)
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
    check_chained_drafts(mla_reference_fn(reference, NAME), r, s, tokens, sampled, drafts, g, h)


def test_greedy_identical_with_mtp_drafts_cold_and_warm_and_leak_free(reference):
    """Exact greedy outputs, drafts accepted and rejected, and every step's draft 1 equal to the
    reference's argmax over the final sequence at that position (the MTP cache rows stay those
    of the accepted tokens through chunked prefill, rejections, rollback and prefix hits)."""
    b, model = reference
    check_greedy_and_first_drafts(
        NAME, PROMPTS, GREEDY,
        lambda t, nxt: b.mtp_reference(fixture(NAME), t, nxt, ref=model)[0])


@pytest.mark.parametrize("name, cls, why", [
    ("tiny-minimax-m2", "MiniMaxM2ForCausalLM", "carry no trained MTP weights")])
def test_mtp_is_refused_for_families_without_an_mtp_loader(name, cls, why):
    """MiniMax-M2 (no MTP weights released), naming why (DeepSeek-V3.2's layer runs:
    test_spec_mtp_v32.py)."""
    message = f"Glm4MoeForCausalLM, .*; {cls} is not supported: .*{why}"
    with pytest.raises(ValueError, match=message):
        mtp_runner(fixture(name))


def test_mtp_is_refused_without_the_mtp_layer_weights(tmp_path):
    """config.json says num_nextn_predict_layers 1, the safetensors hold no layer 3."""
    dst = fixture_without(tmp_path, NAME, "model.layers.3.")
    with pytest.raises(ValueError, match="holds no model.layers.3.eh_proj.weight"):
        mtp_runner(str(dst))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="no num_nextn_predict_layers >= 1"):
        mtp_runner(str(dst))


def test_no_mtp_layer_without_method_mtp():
    """(Under -tp 2 the layer splits as the target's: tests/engine/test_spec_mtp_tp.py.)"""
    r = mtp_runner(fixture(NAME), None)
    assert r.model.mtp is None and len(r.layer_specs) == 3


def test_small_pool_preemption_stays_exact_and_leak_free():
    """Preempted and recomputed requests: their MTP rows are written again with the target's,
    greedy outputs stay those of the engine without speculation."""
    plain = make(NAME, None, block_size=16, kv_cache_memory="4MiB")
    ref = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    page = plain.core.runner.kv_cache_config.page_bytes  # without the MTP layer's rows
    llm = make(NAME, MTP, kv_cache_memory=str(page * 14), block_size=16,
               scheduling_policy="fcfs", max_num_batched_tokens=40, long_prefill_threshold=24)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert llm.core.scheduler.num_preemptions > 0
    assert llm.core.spec.stats.num_accepted_tokens > 0
    assert_clean_mtp(llm)
