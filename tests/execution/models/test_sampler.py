"""Sampling: greedy is argmax; top-k/top-p cut where they should; a seeded request draws the same
tokens whatever it is batched with."""

from __future__ import annotations

import torch

from loomserve.execution.sampler import Sampler
from loomserve.sampling_params import SamplingParams


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits(4)
    out = Sampler(torch.device("cpu"), 0)(logits, [SamplingParams(temperature=0)] * 4, [0] * 4)
    assert out == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_and_top_p_tiny_is_greedy():
    logits = _logits(3)
    s = Sampler(torch.device("cpu"), 0)
    assert s(logits, [SamplingParams(temperature=1.0, top_k=1)] * 3, [0] * 3) == logits.argmax(-1).tolist()
    assert s(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 3, [0] * 3) == logits.argmax(-1).tolist()


def test_top_k_never_leaves_the_top_k():
    logits = _logits(1, seed=3)
    top = set(logits[0].topk(5).indices.tolist())
    s = Sampler(torch.device("cpu"), 1)
    for n in range(50):
        assert s(logits, [SamplingParams(temperature=2.0, top_k=5)], [n])[0] in top


def test_seeded_request_independent_of_batch():
    logits = _logits(3, seed=4)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler(torch.device("cpu"), 0)(logits[1:2], [seeded], [n])[0] for n in range(20)]
    s = Sampler(torch.device("cpu"), 7)
    mixed = []
    for n in range(20):
        params = [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.5, top_p=0.9)]
        mixed.append(s(logits, params, [n + 3, n, 0])[1])
    assert alone == mixed
    assert len(set(alone)) > 1  # the draws do depend on num_output_tokens


def test_global_generator_follows_config_seed():
    logits = _logits(2, seed=5)
    params = [SamplingParams(temperature=1.0)] * 2
    a = [Sampler(torch.device("cpu"), 11)(logits, params, [0, 0]) for _ in range(1)]
    b = [Sampler(torch.device("cpu"), 11)(logits, params, [0, 0]) for _ in range(1)]
    assert a == b
