"""MTP drafts (`"method": "mtp"`) on Qwen3.5: tiny-qwen3-5 (the flat dense text checkpoint) and
tiny-qwen3-5-moe (the released vision-language layout: text_config, model.language_model.*,
mtp.* at the top level). Qwen3.5's MTP layer is Qwen3-Next's (execution/models/qwen3_next_mtp.py:
fc over the two pre-fc norms, one full-attention decoder layer, norm; the model's embedding and
head), its decoder layer dense for the dense model and MoE for the MoE one, counted by
text_config's mtp_num_hidden_layers.

Oracles (tests/engine/test_spec_mtp_qwen3_next.py's checks, on these fixtures): the MTP layer's
logits for every row and its chained drafts 2 and 3 against vLLM's formula in plain torch around
transformers' Qwen3.5 decoder layer (build_linear_fixtures.py: qwen3_next_mtp_reference), fed
transformers' final hidden states after the norm; greedy outputs against the engine without
speculation, cold and warm (prefix hits over Gated DeltaNet state checkpoints), chunked, drafts
accepted and rejected (so the linear states roll back), every draft 1 equal to the reference's
argmax, no block or per-request state left. The fixtures' fc and norm were fitted to the
target's greedy continuations of MTP_PROMPTS (build_qwen3_5_fixtures.py). -tp 2:
tests/engine/test_spec_mtp_tp.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.engine.test_spec_decode import fixture
from tests.engine.test_spec_mtp import fixture_without, mtp_runner
from tests.engine.test_spec_mtp_qwen3_next import (
    check_greedy_exact,
    check_mtp_logits,
    reference_of,
)

# fixture: (the MTP decoder layer's MLP, the attention group's layers with the MTP layer's 4)
CASES = {"tiny-qwen3-5": ("SwiGLU", (2, 4)), "tiny-qwen3-5-moe": ("SparseMoE", (1, 3, 4))}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    """(fixture name, its builder and transformers reference), loaded once per fixture."""
    return request.param, reference_of(request.param)


def test_mtp_logits_equal_the_plain_torch_reference(case):
    name, reference = case
    check_mtp_logits(name, reference, *CASES[name])


def test_greedy_identical_with_mtp_drafts_cold_and_warm_and_leak_free(case):
    check_greedy_exact(*case)


def test_mtp_is_refused_without_the_weights_or_the_layer_count(tmp_path):
    """The released layout: mtp.* and the count under text_config; without either, refused,
    naming what is missing; without method mtp no MTP layer (4 KV specs)."""
    name = "tiny-qwen3-5-moe"
    cfg = json.loads((Path(fixture(name)) / "config.json").read_text())
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1 and "mtp_num_hidden_layers" not in cfg
    with pytest.raises(ValueError, match="holds no mtp.fc.weight"):
        mtp_runner(str(fixture_without(tmp_path, name, "mtp.")))
    dst = shutil.copytree(fixture(name), tmp_path / "no-count")  # the MTP weights kept
    cfg["text_config"]["mtp_num_hidden_layers"] = 0
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no mtp_num_hidden_layers >= 1"):
        mtp_runner(str(dst))
    r = mtp_runner(fixture(name), None)
    assert r.model.mtp is None and len(r.layer_specs) == 4
