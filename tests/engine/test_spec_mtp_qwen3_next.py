"""MTP drafts (`"method": "mtp"`) on tiny-qwen3-next, whose checkpoint carries Qwen3-Next's MTP
layer under mtp.* (execution/models/qwen3_next_mtp.py) beside a hybrid target (Gated DeltaNet
and gated full attention), driven by the proposer DeepSeek-V3's and GLM-4.5's modules use.

Oracles: the MTP layer's logits against vLLM's Qwen3-Next MTP formula in plain torch around
transformers' Qwen3Next decoder layer (tests/fixtures/build_linear_fixtures.py:
qwen3_next_mtp_reference), fed transformers' final hidden states after the norm, for one
prompt, its chained drafts 2 and 3, and every draft 1 of a multi-step run; greedy outputs
against the same engine without speculation, cold and warm (prefix hits, state checkpoints),
chunked, with every block and per-request state gone afterwards. The fixture's fc and norm were
fitted to the target's greedy continuations of MTP_PROMPT, so drafts there are accepted.
"""

from __future__ import annotations

import pytest
import torch

from loomserve.execution.batch import ModelInput
from loomserve.execution.spec_mtp import MtpRun
from loomserve.kv.spec import FullAttentionSpec
from tests.engine.test_spec_decode import fixture
from tests.engine.test_spec_mtp import (
    GREEDY,
    PROMPTS,
    check_chained_drafts,
    check_greedy_and_first_drafts,
    fixture_without,
    load_builder,
    mtp_runner,
)
from tests.execution.models.test_linear_layers import RunnerSeqs

NAME = "tiny-qwen3-next"


def reference_of(name: str):
    """(build_linear_fixtures, its transformers reference of fixture `name` with the MTP layer
    as layer n)."""
    b = load_builder("build_linear_fixtures.py")
    return b, b.qwen3_next_mtp_reference_model(fixture(name))


@pytest.fixture(scope="module")
def reference():
    return reference_of(NAME)


def test_mtp_logits_equal_the_plain_torch_reference(reference):
    # the MTP layer's gated attention: a fifth layer, full attention, grouped with layers 1, 3
    check_mtp_logits(NAME, reference, "SparseMoE", (1, 3, 4))


def check_mtp_logits(name: str, reference, mlp: str, attention_layers: tuple[int, ...]) -> None:
    """On fixture `name` (4 layers): the MTP layer's decoder layer has an `mlp` MLP, its
    attention is the fifth layer, in the group of the target's `attention_layers`; its logits
    for every row and chained drafts 2 and 3 equal the reference's."""
    r = mtp_runner(fixture(name))
    layer = r.model.mtp.layers[0]
    assert type(layer.model.layers[0].mlp).__name__ == mlp
    assert len(r.layer_specs) == 5 and isinstance(r.layer_specs[4], FullAttentionSpec)
    g_attn = r.attn_groups[0]
    assert r.kv_cache_config.groups[g_attn].layer_ids == attention_layers
    tokens = [5, 17, 301, 42, 42, 9, 128, 77, 3, 250, 64]
    rs = RunnerSeqs(r)
    tables = rs.new()
    s = rs.seq("r", tables, tokens, 0, zero=True)
    for g in r.attn_groups:  # room for the chained drafts' rows
        while len(tables[g]) * r.block_size < len(tokens) + 4:
            tables[g].append(rs.alloc())
    out = r.execute(ModelInput([s]))
    sampled = out.sampled["r"]
    b, ref_model = reference
    ref, g = b.qwen3_next_mtp_reference(ref_model, tokens, sampled)
    follows, drafts = out.drafts["r"]
    assert follows == len(tokens) + 1 and len(drafts) == 3
    assert drafts[0] == int(ref[-1].argmax())
    # every row's logits (the step's target hidden states again, same blocks, state from zero)
    s = rs.seq("r", tables, tokens, 0, zero=True)
    r.compute_logits(ModelInput([s]))
    hidden, r.model.last_hidden = r.model.last_hidden, None
    h = r.mtp.run_module(r, 0, [MtpRun(s, 0, tokens[1:] + [sampled], [hidden], None)])
    torch.testing.assert_close(layer.logits(r.model, h).float(), ref, atol=2e-4, rtol=2e-4)
    check_chained_drafts(
        lambda t, nxt, chained: b.qwen3_next_mtp_reference(ref_model, t, nxt, chained=chained),
        r, s, tokens, sampled, drafts, g, h)


def test_greedy_identical_with_mtp_drafts_cold_and_warm_and_leak_free(reference):
    check_greedy_exact(NAME, reference)


def check_greedy_exact(name: str, reference) -> None:
    """Exact greedy outputs over the hybrid target, drafts accepted and rejected, and every
    step's draft 1 equal to the reference's argmax over the final sequence at that position."""
    b, ref_model = reference
    check_greedy_and_first_drafts(
        name, PROMPTS, GREEDY,
        lambda t, nxt: b.qwen3_next_mtp_reference(ref_model, t, nxt)[0])


def test_mtp_is_refused_without_the_mtp_weights(tmp_path):
    """(Under -tp 2 the layer splits as the target's: tests/engine/test_spec_mtp_tp.py.)"""
    dst = fixture_without(tmp_path, NAME, "mtp.")
    with pytest.raises(ValueError, match="holds no mtp.fc.weight"):
        mtp_runner(str(dst))
    r = mtp_runner(fixture(NAME), None)
    assert r.model.mtp is None and len(r.layer_specs) == 4  # no MTP layer without method mtp
