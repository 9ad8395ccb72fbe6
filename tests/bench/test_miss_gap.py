"""The served-vs-theoretical gap by miss cause (loomserve.bench.miss_gap): its arithmetic, the
simulator's lru runs (where only eviction separates lru from the infinite cache) and the
agentx metrics, summary and plot."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomserve.bench.metrics import RequestRecord, compute_metrics
from loomserve.bench.miss_gap import attribute_gap, request_gap
from loomserve.bench.report import plot_miss_gap, summary_table
from loomserve.bench.simulate import run_lru
from tests.bench.test_simulate import sessions_st, workload


def test_compulsory_misses_come_off_first_sight_first():
    assert request_gap({"first_sight": 10, "evicted": 20, "partial_block": 3}, 12) == {
        "evicted": 20, "partial_block": 1}
    assert request_gap({"evicted": 20}, 5) == {"evicted": 15}  # cross-session: any cause
    g = attribute_gap([(100, 40, 90, {"evicted": 50, "first_sight": 10}),
                       (100, 90, 90, {"partial_block": 10}),
                       (100, 0, 50, None)])  # no causes: its 50-point gap is unattributed
    assert g["gap_points"] == (230 - 130) * 100 / 300
    assert g["points"] == {"evicted": 50 * 100 / 300}
    assert abs(g["unattributed_points"] - 50 * 100 / 300) < 1e-6
    assert g["requests_without_causes"] == 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sessions_st(), st.integers(1, 24))
def test_simulated_lru_gap_is_all_eviction(sessions, blocks):
    """Requests one at a time, no pins, salts or tiers: a block the infinite cache hits and
    lru misses was evicted; lru never beats the infinite cache, so nothing is unattributed."""
    w = workload(sessions)
    res = run_lru(w, blocks * w.block_size, attribute=True)
    g = res.miss_gap
    if not g.get("prompt_tokens"):
        return
    assert abs(g["served"] - res.token_hit_rate) < 1e-12
    if res.truncated_requests == 0:
        assert set(g["points"]) <= {"evicted"}
        assert abs(g["unattributed_points"]) < 1e-6
        assert abs(sum(g["points"].values()) - g["gap_points"]) < 1e-6


def test_agentx_metrics_summary_and_plot(tmp_path):
    recs = [RequestRecord(send_time=0.0, end_time=1.0, first_token_time=0.5, chunk_times=[0.5],
                          prompt_tokens=1000, cached_tokens=600, output_tokens=1,
                          intended_prompt_tokens=1000, theoretical_cached_tokens=900,
                          miss_causes={"evicted": 250, "pin_expired": 50, "first_sight": 96,
                                       "partial_block": 4})]
    m = compute_metrics(recs)
    g = m["miss_gap"]
    assert abs(g["gap_points"] - 30.0) < 1e-9
    assert g["points"] == {"evicted": 25.0, "pin_expired": 5.0}
    text = summary_table({"config": {"model": "m", "endpoint": "e"}, "metrics": m})
    assert "hit-rate gap, theoretical - served: 30.00 points" in text and "pin_expired" in text
    assert "hit gap points" in text and "gap from evicted" in text
    path = plot_miss_gap([g, g], ["a", "b"], str(tmp_path / "gap.png"))
    assert (tmp_path / "gap.png").stat().st_size > 1000 and path.endswith("gap.png")
    assert "miss_gap" not in compute_metrics([RequestRecord(send_time=0.0, end_time=1.0)])
