"""The online step cost model (loomserve.engine.sched.step_cost): features, fit, error stats."""

from __future__ import annotations

import numpy as np
import pytest

from loomserve.engine.sched.step_cost import (
    NUM_FEATURES,
    ModelLayout,
    StepCostModel,
    StepFeatures,
)
from tests.kv.conftest import make_config, make_hybrid_config

FULL = ModelLayout()


def test_chunk_features_count_pairs_of_the_causal_triangle():
    f = StepFeatures(FULL)
    f.add(100, 10)  # 10 queries over 100 + their own triangle
    f.add(50, 1)  # a decode
    v = f.vector
    assert v[0] == 1 and v[1] == 11 and v[5] == 2
    assert v[2] == pytest.approx(10 * (100 + 5) + 1 * (50 + 0.5))
    assert v[3] == v[4] == 0  # no sliding or linear layers


def test_sliding_pairs_cap_the_context_at_the_window_and_layout_from_groups():
    lay = ModelLayout.from_kv_config(make_hybrid_config(16, window=8))
    assert (lay.full_layers, lay.sliding_layers, lay.sliding_window, lay.linear_layers) == \
        (1, 1, 8, 2)
    d = StepFeatures(lay).chunk(1000, 4)
    assert d[2] == pytest.approx(4 * 1002) and d[3] == pytest.approx(4 * (8 + 2)) and d[4] == 4
    assert ModelLayout.from_kv_config(make_config(8)) == ModelLayout(1, 0, 0, 0)


def synthetic_steps(rng, n):
    """Decode batches and mixed prefill steps, like a server's."""
    out = []
    for _ in range(n):
        f = StepFeatures(FULL)
        for _ in range(rng.integers(1, 9)):
            f.add(int(rng.integers(10, 4000)), 1)
        if rng.random() < 0.4:
            f.add(int(rng.integers(0, 4000)), int(rng.integers(16, 512)))
        out.append(f.vector)
    return out


TRUE = np.array([4e-3, 2e-4, 3e-8, 0.0, 0.0, 3e-4])  # seconds per unit of each feature


def test_converges_on_a_linear_law_with_noise_from_a_wrong_prior():
    rng = np.random.default_rng(0)
    model = StepCostModel(TRUE * np.array([3.0, 0.3, 5.0, 1.0, 1.0, 0.2]) + 1e-9)
    for v in synthetic_steps(rng, 400):
        model.observe(v, float(TRUE @ v) * (1 + rng.normal(0, 0.03)))
    assert (model.weights >= 0).all()
    test = synthetic_steps(rng, 200)
    rel = [abs(model.predict(v) - TRUE @ v) / (TRUE @ v) for v in test]
    assert np.median(rel) < 0.03 and np.quantile(rel, 0.9) < 0.08
    # the recorded errors: large at first (the prior), noise-sized at the end
    errors = list(model.errors)
    assert errors[0] > 0.3 and np.median(errors[-100:]) < 0.06


def test_predict_sees_every_sample_though_the_fit_is_solved_lazily():
    """observe() alone solves every SOLVE_EVERY samples; predict() first solves what observe()
    folded in since. A model asked after every sample agrees up to the fit age its samples
    were weighted by."""
    rng = np.random.default_rng(3)
    prior = TRUE * np.array([3.0, 0.3, 5.0, 1.0, 1.0, 0.2]) + 1e-9
    eager, lazy = StepCostModel(prior), StepCostModel(prior)
    probe = synthetic_steps(rng, 1)[0]
    steps = synthetic_steps(rng, 37)
    for i, v in enumerate(steps):
        t = float(TRUE @ v) * (1 + rng.normal(0, 0.03))
        eager.observe(v, t)
        eager.predict(probe)
        lazy.observe(v, t)
        if i == len(steps) - 2:
            stale = float(lazy._weights @ probe)  # the fit as observe() left it
    assert lazy._unsolved > 0
    fresh = lazy.predict(probe)
    assert lazy._unsolved == 0 and fresh != stale
    lazy._solve()
    assert lazy.predict(probe) == fresh  # nothing was left unsolved
    assert fresh == pytest.approx(eager.predict(probe), rel=1e-3)


def test_before_any_sample_the_prior_rules():
    prior = np.array([1e-3, 1e-4, 1e-8, 0, 0, 1e-5])
    model = StepCostModel(prior)
    v = StepFeatures(FULL).with_chunk(10, 100) + StepFeatures.fixed_term()
    assert model.predict(v) == pytest.approx(prior @ v)


def test_weights_stay_non_negative_on_adversarial_times():
    rng = np.random.default_rng(1)
    model = StepCostModel(TRUE + 1e-9)
    for v in synthetic_steps(rng, 100):
        model.observe(v, max(1e-4, 0.5 - 1e-4 * v[1]))  # time falls as tokens grow
    assert (model.weights >= 0).all()
    f = StepFeatures(FULL)
    base = model.predict(f.with_chunk(100, 10) + StepFeatures.fixed_term())
    assert model.predict(f.with_chunk(100, 500) + StepFeatures.fixed_term()) >= base


def test_error_quantiles_are_those_of_the_recorded_relative_errors():
    prior = np.array([1e-2, 0, 0, 0, 0, 0])
    model = StepCostModel(prior, ridge=1e12)  # frozen at the prior: predicts 10 ms
    assert model.error_quantiles() == (0.0, 0.0)
    v = np.zeros(NUM_FEATURES)
    v[0] = 1
    actual = [0.01, 0.02, 0.005, 0.01, 0.04, 0.0125]
    for t in actual:
        model.observe(v, t)
    want = [abs(0.01 - t) / t for t in actual]
    p50, p90 = model.error_quantiles()
    assert p50 == pytest.approx(np.quantile(want, 0.5), rel=1e-3)
    assert p90 == pytest.approx(np.quantile(want, 0.9), rel=1e-3)
    assert model.num_samples == len(actual)


def test_host_noise_spikes_do_not_drag_the_fit():
    """10% of steps slowed 3-10x by something else on the host: the typical step is still
    predicted (errors measured against the law, not the spikes)."""
    rng = np.random.default_rng(2)
    model = StepCostModel(TRUE + 1e-9)
    for v in synthetic_steps(rng, 400):
        spike = rng.uniform(3, 10) if rng.random() < 0.1 else 1.0
        model.observe(v, float(TRUE @ v) * spike * (1 + rng.normal(0, 0.03)))
    rel = [abs(model.predict(v) - TRUE @ v) / (TRUE @ v) for v in synthetic_steps(rng, 200)]
    assert np.median(rel) < 0.06  # 0.31 without the clipping
