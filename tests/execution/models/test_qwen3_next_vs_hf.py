"""Qwen3-Next (Gated DeltaNet + gated attention + sparse MoE) against transformers, fp32, on the
tiny fixture: every way a step can be cut gives HF's logits for the same position."""

from __future__ import annotations

import pytest
import torch

from tests.execution.models import test_linear_layers as hybrid
from tests.execution.models.conftest import FIXTURES

NAME = "tiny-qwen3-next"


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM

    from loomserve.execution.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM

    model = hybrid.load_fixture(NAME, Qwen3NextForCausalLM, Qwen3NextConfig)
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / NAME), dtype=torch.float32).eval()
    return model, ref


def test_fixture_exercises_every_part(pair):
    model, _ = pair
    kinds = [layer.kind for layer in model.model.layers]
    assert kinds == ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SparseMoE", "SparseMoE", "SwiGLU", "SparseMoE"]
    assert model.model.layers[1].self_attn.rotary_dim == 4


def test_prefill_then_decode(pair):
    hybrid.scenario_prefill_then_decode(*pair)


def test_chunked_prefill(pair):
    hybrid.scenario_chunked_prefill(*pair)


def test_mixed_batch(pair):
    hybrid.scenario_mixed_batch(*pair)


def test_saves_and_prefix_hit(pair):
    hybrid.scenario_saves_and_prefix_hit(*pair)


def test_through_model_runner(pair):
    pytest.importorskip("loomserve.execution.models.registry")
    hybrid.scenario_runner(NAME, pair[1])
