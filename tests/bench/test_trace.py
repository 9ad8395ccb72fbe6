"""Weka trace parser: real corpus, subagent time conventions, validation errors."""

import json
import math
import os
from pathlib import Path

import pytest

from loomserve.bench.trace import TraceError, load_trace, load_traces, parse_session

# Four of the 36 Weka traces, one with a subagent group (tests/data/traces/weka/NOTICE).
WEKA = Path(__file__).resolve().parents[1] / "data" / "traces" / "weka"


def req(t, n_in, out=10, bs=64, start=1, **kw):
    d = {"t": t, "type": "n", "in": n_in, "out": out,
         "hash_ids": list(range(start, start + n_in // bs)), "api_time": 1.0, "think_time": 0.0}
    d.update(kw)
    return d


def sub(t, reqs, agent_id="agent_001", dur_ms=None):
    d = {"t": t, "type": "subagent", "agent_id": agent_id, "subagent_type": "Explore",
         "requests": reqs}
    if dur_ms is not None:
        d["duration_ms"] = dur_ms
    return d


def doc(requests, **kw):
    d = {"id": "x", "models": ["m"], "block_size": 64, "requests": requests}
    d.update(kw)
    return d


def write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


def test_real_traces_load_and_counts_add_up():
    sessions = load_traces(WEKA)
    assert len(sessions) == 4
    n_main = sum(len(s.main) for s in sessions)
    n_sub = sum(len(a.requests) for s in sessions for a in s.subagents())
    assert (n_main, n_sub) == (35, 12)
    assert sum(len(s.all_requests()) for s in sessions) == 47
    assert sum(1 for s in sessions if s.groups) == 1
    for s in sessions:
        raw = json.loads(Path(s.path).read_text())
        tot = raw["totals"]
        assert sum(r.in_tokens for r in s.main) == tot["parent_tokens"]["input"]
        assert sum(r.in_tokens for a in s.subagents() for r in a.requests) == \
            tot["subagent_tokens"]["input"]
        assert len(s.subagents()) == tot["subagent_count"]
        reqs = s.all_requests()
        assert [r.t for r in reqs] == sorted(r.t for r in reqs)
        for a in s.subagents():
            # Weka subagent times restart at 0: normalized to session time
            assert a.requests[0].t == pytest.approx(a.t)
            assert all(r.agent == a.agent_id for r in a.requests)
        for r in reqs:
            assert math.floor(r.in_tokens / 64) <= len(r.hash_ids) <= math.ceil(r.in_tokens / 64)


@pytest.mark.parametrize("relative", [True, False])
def test_subagent_time_conventions_normalize_alike(tmp_path, relative):
    kid_times = [0.0, 5.0, 12.0] if relative else [100.0, 105.0, 112.0]
    kids = [req(t, 640, start=1000 + 10 * i) for i, t in enumerate(kid_times)]
    d = doc([req(0.0, 640), req(90.0, 704), sub(100.0, kids, dur_ms=15000), req(200.0, 768)])
    s = load_trace(write(tmp_path, "a.json", d))
    (g,) = s.groups
    assert [r.t for r in g.subagents[0].requests] == [100.0, 105.0, 112.0]
    assert g.after_index == 1
    assert g.joined  # ends at 115 s, before the parent turn at 200 s
    assert [r.agent for r in s.all_requests()] == ["main", "main"] + ["agent_001"] * 3 + ["main"]


def test_joined_only_when_group_finished_first():
    kids = [req(0.0, 640, start=500)]
    late = doc([req(0.0, 640), sub(10.0, kids, "a1", 5000), sub(12.0, kids, "a2", 30000),
                req(20.0, 704), sub(30.0, kids, "a3", 1000)])
    s = parse_session(late, "late.json")
    assert len(s.groups) == 2
    assert [len(g.subagents) for g in s.groups] == [2, 1]
    assert not s.groups[0].joined  # a2 ends at 42 s > 20 s
    assert not s.groups[1].joined  # trailing group: no parent turn waits for it
    assert s.groups[1].after_index == 1
    first = parse_session(doc([sub(0.5, kids, "a1", 100), req(5.0, 640)]), "f.json")
    assert first.groups[0].after_index == -1 and first.groups[0].joined


def test_block_count_floor_or_ceil_accepted():
    ceil_ids = {"t": 0.0, "type": "s", "in": 100, "out": 1, "hash_ids": [1, 2]}
    floor_ids = {"t": 1.0, "type": "n", "in": 100, "out": 1, "hash_ids": [1]}
    s = parse_session(doc([ceil_ids, floor_ids]))
    assert s.main[0].streaming and not s.main[1].streaming
    assert s.main[0].think_time == 0.0 and s.main[0].api_time is None


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["requests"][1].pop("in"), "requests[1].in"),
    (lambda d: d["requests"][1].update(t="soon"), "requests[1].t"),
    (lambda d: d["requests"][0].update(out=-3), "requests[0].out"),
    (lambda d: d["requests"][0].update(think_time=-1.0), "requests[0].think_time"),
    (lambda d: d["requests"][1].update(hash_ids=[1, 2, 3]), "requests[1].hash_ids"),
    (lambda d: d["requests"][1].update(hash_ids=[1, "2"] + list(range(3, 12))), "requests[1].hash_ids[1]"),
    (lambda d: d["requests"][0].update(type="x"), "requests[0].type"),
    (lambda d: d["requests"][2]["requests"][0].pop("hash_ids"), "requests[2].requests[0].hash_ids"),
    (lambda d: d["requests"][2].pop("agent_id"), "requests[2].agent_id"),
    (lambda d: d["requests"][2].update(requests=[]), "requests[2].requests"),
    (lambda d: d.pop("requests"), "requests"),
    (lambda d: d["requests"][1].update(t=-0.5), "requests[1].t"),
])
def test_malformed_fields_name_file_and_field(tmp_path, mutate, field):
    d = doc([req(0.0, 640), req(10.0, 704), sub(20.0, [req(0.0, 640, start=99)], dur_ms=1000)])
    mutate(d)
    p = write(tmp_path, "bad.json", d)
    with pytest.raises(TraceError) as ei:
        load_trace(p)
    msg = str(ei.value)
    assert str(p) in msg and f"{field}:" in msg


def test_bad_json_names_line_and_column(tmp_path):
    text = '{\n  "block_size": 64,\n  "requests": [\n    {"t": 0.0,, "type": "n"}\n  ]\n}\n'
    p = write(tmp_path, "broken.json", text)
    with pytest.raises(TraceError, match=r"broken\.json: invalid JSON at line 4 column"):
        load_trace(p)


def test_load_traces_all_or_nothing(tmp_path):
    good = doc([req(0.0, 640)])
    write(tmp_path, "a.json", good)
    write(tmp_path, "c.json", good)
    write(tmp_path, "b.json", doc([req(0.0, 640, out=-1)]))
    with pytest.raises(TraceError, match="b.json"):
        load_traces(tmp_path)
    os.remove(tmp_path / "b.json")
    sessions = load_traces([tmp_path])
    assert [Path(s.path).name for s in sessions] == ["a.json", "c.json"]
    with pytest.raises(TraceError, match="no such file"):
        load_traces([tmp_path / "a.json", tmp_path / "missing.json"])
