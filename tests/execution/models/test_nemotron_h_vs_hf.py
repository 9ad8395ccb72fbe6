"""Nemotron-H (Mamba2 + NoPE attention + relu^2 MLP + routed experts) against transformers, fp32, on the
tiny fixture: every way a step can be cut gives HF's logits for the same position."""

from __future__ import annotations

import pytest
import torch

from tests.execution.models import test_linear_layers as hybrid
from tests.execution.models.conftest import FIXTURES

NAME = "tiny-nemotron-h"


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM

    from loomserve.execution.models.nemotron_h import NemotronHConfig, NemotronHForCausalLM

    model = hybrid.load_fixture(NAME, NemotronHForCausalLM, NemotronHConfig)
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / NAME), dtype=torch.float32).eval()
    return model, ref


def test_fixture_exercises_every_part(pair):
    model, _ = pair
    assert "".join({"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}[layer.kind]
                   for layer in model.model.layers) == "M-M*ME"
    specs = model.kv_cache_specs(4, torch.float32)
    assert specs[1] is None and specs[5] is None


@pytest.mark.parametrize("raw, want", [
    (None, (0.0, float("inf"))),
    ([0.0, float("inf")], (0.0, float("inf"))),
    ([0.0, {"__float__": "Infinity"}], (0.0, float("inf"))),  # as transformers writes it
    ([0.01, 0.5], (0.01, 0.5)),
])
def test_dt_limit_from_config(raw, want):
    from loomserve.execution.models.nemotron_h import _dt_limit

    assert _dt_limit(raw) == want


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
