"""`loomserve bench simulate` on the command line: the JSON shape of a single run and of a sweep,
the text output, and the exit status on bad options."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest


def _write_trace(path, tid: str, n_turns: int) -> None:
    reqs, ids = [], []
    for k in range(n_turns):
        ids = ids + list(range(len(ids) + 1, len(ids) + 4))
        reqs.append({"t": float(k), "type": "s", "model": "m", "in": 64 * len(ids) + 10,
                     "out": 20, "hash_ids": ids, "input_types": ["text"],
                     "output_types": ["text"], "stop": "tool_use", "api_time": 0.5,
                     "think_time": 0.0})
    path.write_text(json.dumps({"id": tid, "models": ["m"], "block_size": 64,
                                "hash_id_scope": "local", "tool_tokens": 0,
                                "system_tokens": 0, "requests": reqs}))


def _run_cli(argv: list[str]) -> tuple[int, str]:
    from loomserve.cli import build_parser
    args = build_parser().parse_args(["bench", "simulate", *argv])
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = args.func(args)
    return rc, buf.getvalue()


@pytest.fixture
def trace_dir(tmp_path):
    _write_trace(tmp_path / "t1.json", "t1", 4)
    _write_trace(tmp_path / "t2.json", "t2", 3)
    return tmp_path


def test_cli_json_single_run(trace_dir):
    rc, out = _run_cli([str(trace_dir), "--capacity-tokens", "1024", "--json"])
    assert rc == 0
    res = json.loads(out)
    assert res["command"] == "simulate" and res["traces"] == 2 and res["requests"] == 7
    assert res["semantics"] == "loomserve" and res["block_size"] == 64
    (run,) = res["runs"]
    assert run["policy"] == "lru" and run["capacity_tokens"] == 1024 and run["num_blocks"] == 16
    assert 0 <= run["token_hit_rate"] <= 1 and run["requests"] == 7
    assert set(run["per_request_hit_rate"]) == {"n", "mean", "p10", "p25", "p50", "p75", "p90"}
    assert set(run["manager_cpu_us"]) == {"median", "p99", "mean"}
    assert run["requests_per_s"] > 0
    for k in ("hit_tokens", "counted_tokens", "truncated_requests", "evictions"):
        assert isinstance(run[k], int)


def test_cli_json_sweep(trace_dir, tmp_path):
    png = tmp_path / "curve.png"
    rc, out = _run_cli([str(trace_dir), "--sweep", "0.25,0.5,1.0", "--block-size", "32",
                        "--semantics", "kvcache-sim", "--plot", str(png), "--json"])
    assert rc == 0
    res = json.loads(out)
    assert res["semantics"] == "kvcache-sim" and res["warmup_requests"] == 3
    assert res["working_set_tokens"] == res["unique_blocks"] * 32 == 21 * 64
    assert [r["capacity_fraction"] for r in res["curve"]] == [0.25, 0.5, 1.0]
    for row in res["curve"]:
        assert row["lru"] <= row["optimal"] <= row["infinite"]
    assert {r["policy"] for r in res["runs"]} == {"lru", "optimal", "infinite"}
    assert len(res["runs"]) == 7
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 0 and res["plot"] == str(png)


def test_cli_human_and_errors(trace_dir):
    rc, out = _run_cli([str(trace_dir), "--sweep-capacities", "640,1280", "--policy", "lru"])
    assert rc == 0 and "capacity tokens" in out and "token hit rate" in out
    rc, _ = _run_cli([str(trace_dir)])
    assert rc == 2
    rc, _ = _run_cli([str(trace_dir), "--capacity-tokens", "64", "--policy", "fifo"])
    assert rc == 2
    rc, out = _run_cli([str(trace_dir), "--policy", "infinite", "--json"])
    assert rc == 0 and json.loads(out)["runs"][0]["policy"] == "infinite"
