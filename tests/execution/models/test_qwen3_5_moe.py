"""Qwen3.5 MoE against transformers, fp32, on tests/fixtures/tiny-qwen3-5-moe, a checkpoint in the
released layout (Qwen3_5MoeForConditionalGeneration: config under text_config, weights under
model.language_model.*, experts one tensor each, a vision tensor and an MTP tensor to skip):
every way a step can be cut gives HF's logits; the router always renormalizes its top k; -tp 2
equals one rank. DEP (-dp 2 with expert parallelism): tests/engine/test_dep.py. The dense
variant: test_qwen3_5.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from loomserve.execution.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from loomserve.execution.models.qwen3_next import SparseMoE
from tests.execution.models import test_linear_layers as hybrid
from tests.execution.models.conftest import FIXTURES
from tests.execution.models.test_qwen3_5 import run_two_rounds

NAME = "tiny-qwen3-5-moe"
PATH = str(FIXTURES / NAME)


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM

    model = hybrid.load_fixture(NAME, Qwen3_5ForCausalLM, Qwen3_5Config)
    ref = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    return model, ref


def _hf_config() -> dict:
    with open(os.path.join(PATH, "config.json")) as f:
        return json.load(f)


def test_fixture_exercises_every_part(pair):
    from loomserve.execution.models.loading.checkpoint import iter_safetensors
    from loomserve.execution.models.registry import resolve

    model, ref = pair
    d = _hf_config()
    assert d["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and "text_config" in d
    assert resolve(d)[0] is Qwen3_5ForCausalLM
    names = [n for n, _ in iter_safetensors(PATH)]
    assert "model.language_model.layers.1.mlp.experts.3.up_proj.weight" in names
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("mtp.") for n in names)
    kinds = [layer.kind for layer in model.model.layers]
    assert kinds == ["linear_attention", "full_attention"] * 2 == list(ref.config.layer_types)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SparseMoE"] * 4
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (4, 2, True)
    assert model.model.layers[0].linear_attn.split_projections


def test_prefill_then_decode(pair):
    hybrid.scenario_prefill_then_decode(*pair)


def test_chunked_prefill(pair):
    hybrid.scenario_chunked_prefill(*pair)


def test_mixed_batch(pair):
    hybrid.scenario_mixed_batch(*pair)


def test_saves_and_prefix_hit(pair):
    hybrid.scenario_saves_and_prefix_hit(*pair)


def test_through_model_runner(pair):
    hybrid.scenario_runner(NAME, pair[1])


def test_sparse_moe_matches_hf_block(pair):
    """One MoE block on random rows (routing, renormalized top-2, shared expert) against HF's;
    the renormalization is Qwen3.5's always, whatever norm_topk_prob the dict carries."""
    model, ref = pair
    ours, theirs = model.model.layers[3].mlp, ref.model.layers[3].mlp
    assert isinstance(ours, SparseMoE)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x[None])[0], atol=1e-6, rtol=1e-5)
        top = torch.softmax(ours.gate(x), dim=-1).topk(2, dim=-1)
    assert len(torch.unique(top.indices)) == 4 and (top.values.sum(-1) < 0.95).all()
    d = _hf_config()
    d["text_config"] = {**d["text_config"], "norm_topk_prob": False, "mlp_only_layers": [1]}
    cfg = Qwen3_5Config.from_hf(d)
    assert cfg.norm_topk_prob and all(cfg.is_moe(i) for i in range(4))
    with pytest.raises(ValueError, match="num_experts"):
        Qwen3_5Config.from_hf({**d, "text_config": {**d["text_config"], "num_experts": 0}})


def test_tensor_parallel_2_matches_one_rank(monkeypatch):
    """-tp 2 on the vision-language layout (weights renamed before they are sliced): heads,
    state pages and expert columns split; the same greedy tokens and prefix hits as one rank."""
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    tokens1, cached1 = run_two_rounds(PATH, 1)
    tokens2, cached2 = run_two_rounds(PATH, 2)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] >= 64 and cached1[3] >= 64

