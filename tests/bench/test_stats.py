"""bench stats: theoretical hit rate against brute force, JSON output on the real traces."""

import argparse
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve.bench import stats
from loomserve.bench.trace import parse_session

# Four of the 36 Weka traces, one with a subagent group (tests/data/traces/weka/NOTICE).
WEKA = Path(__file__).resolve().parents[1] / "data" / "traces" / "weka"


@st.composite
def chained_trace(draw):
    """A session whose hash ids are chained: each request extends a prefix of an earlier
    request (or starts fresh); some requests go to subagents."""
    bs = draw(st.sampled_from([4, 16, 64]))
    n = draw(st.integers(1, 12))
    next_id = [1]
    prefixes: list[list[int]] = []
    entries, kids = [], []
    t = 0.0
    for _ in range(n):
        if prefixes and draw(st.booleans()):
            base = draw(st.sampled_from(prefixes))
            base = base[:draw(st.integers(0, len(base)))]
        else:
            base = []
        extra = draw(st.integers(0, 5))
        ids = base + list(range(next_id[0], next_id[0] + extra))
        next_id[0] += extra
        prefixes.append(ids)
        n_in = len(ids) * bs + draw(st.integers(0, bs - 1))
        t += draw(st.floats(0, 10))
        r = {"t": t, "type": "n", "in": n_in, "out": 1, "hash_ids": ids}
        (kids if draw(st.integers(0, 3)) == 0 else entries).append(r)
    if kids:
        entries.append({"t": kids[0]["t"], "type": "subagent", "agent_id": "a", "requests": kids})
        entries.sort(key=lambda e: e["t"])
    return parse_session({"block_size": bs, "requests": entries}, "h.json")


def brute_force(session):
    """Hit = longest common prefix with ANY earlier request (definition of prefix caching)."""
    done, out = [], []
    for r in session.all_requests():
        best = 0
        for prev in done:
            k = 0
            while k < min(len(prev), len(r.hash_ids)) and prev[k] == r.hash_ids[k]:
                k += 1
            best = max(best, k)
        out.append(min(best * session.block_size, r.in_tokens))
        done.append(r.hash_ids)
    return out


@settings(max_examples=150, deadline=None)
@given(chained_trace())
def test_theoretical_hits_match_brute_force(session):
    hits = stats.theoretical_hits(session)
    assert [r for r, _ in hits] == session.all_requests()
    assert [h for _, h in hits] == brute_force(session)
    st_ = stats.compute_stats([session])
    total_in = sum(r.in_tokens for r in session.all_requests())
    assert st_["hit_tokens"] == sum(brute_force(session))
    if total_in:
        assert st_["theoretical_hit_rate"] == pytest.approx(st_["hit_tokens"] / total_in)


def test_hits_by_hand():
    s = parse_session({"block_size": 64, "requests": [
        {"t": 0, "type": "n", "in": 200, "out": 1, "hash_ids": [1, 2, 3]},
        {"t": 1, "type": "n", "in": 300, "out": 1, "hash_ids": [1, 2, 3, 4]},
        {"t": 2, "type": "n", "in": 130, "out": 1, "hash_ids": [1, 9]},
        {"t": 3, "type": "n", "in": 100, "out": 1, "hash_ids": [1, 2]},  # ceil ids: cap at in
    ]})
    assert [h for _, h in stats.theoretical_hits(s)] == [0, 192, 64, 100]
    out = stats.compute_stats([s])
    assert out["new_prefill"]["max"] == 200 and out["hit_tokens"] == 356


def test_stats_json_on_real_traces(capsys):
    p = argparse.ArgumentParser()
    stats.add_arguments(p)
    assert stats.main(p.parse_args([str(WEKA), "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sessions"] == 4
    assert out["requests"] == {"total": 47, "main": 35, "subagent": 12}
    assert (out["input_tokens"], out["hit_tokens"]) == (2631093, 2323712)
    assert out["theoretical_hit_rate"] == pytest.approx(2323712 / 2631093)
    assert len(out["per_trace"]) == 4
    assert sum(t["input_tokens"] for t in out["per_trace"]) == out["input_tokens"]
    for t in out["per_trace"]:
        assert 0.0 <= t["theoretical_hit_rate"] <= 1.0
    for key in ("turns_per_session", "in_tokens", "out_tokens", "new_prefill", "think_time"):
        d = out[key]
        assert d["n"] > 0 and d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert out["turns_per_session"]["n"] == 4 and out["in_tokens"]["n"] == 47
    assert out["new_prefill"]["mean"] == pytest.approx(
        (out["input_tokens"] - out["hit_tokens"]) / 47)
    sub = out["subagents"]
    assert sub["sessions_with_groups"] == 1 and sub["subagents"] == 2
    assert sub["requests_per_group"]["n"] == sub["groups"] == 1
    assert sub["max_concurrent_subagents"] == 2  # trace_0291's two subagents overlap


def test_stats_reports_bad_trace(tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"requests": [{"t": 0}]}')
    p = argparse.ArgumentParser()
    stats.add_arguments(p)
    assert stats.main(p.parse_args([str(tmp_path)])) == 2
    assert "x.json" in capsys.readouterr().err
