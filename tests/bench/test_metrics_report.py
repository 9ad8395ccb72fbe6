"""Metrics arithmetic on hand-made records, reports, plots, and one end-to-end replay against a
real loomserve server on the tiny fixture model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loomserve.bench import report
from loomserve.bench.metrics import RequestRecord, compute_metrics
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def records():
    return [
        RequestRecord(send_time=0.0, first_token_time=1.0, chunk_times=[1.0, 1.5, 2.0],
                      end_time=2.0, prompt_tokens=100, cached_tokens=60, output_tokens=3,
                      intended_prompt_tokens=100, theoretical_cached_tokens=80),
        RequestRecord(send_time=1.0, first_token_time=1.5, chunk_times=[1.5, 2.5], end_time=3.0,
                      prompt_tokens=200, cached_tokens=150, output_tokens=2,
                      intended_prompt_tokens=200, theoretical_cached_tokens=160, truncated=True),
        RequestRecord(send_time=0.0, first_token_time=0.5, chunk_times=[0.5], end_time=0.5,
                      prompt_tokens=50, cached_tokens=0, output_tokens=1, primer=True,
                      intended_prompt_tokens=50),
        RequestRecord(send_time=0.5, error="timeout"),
    ]


def test_metrics_hand_computed():
    m = compute_metrics(records(), devices=2, device_price_per_hour=3.6)
    approx = pytest.approx
    assert m["requests"] == {"ok": 2, "errors": 1, "primers": 1, "primer_errors": 0,
                             "truncated": 1, "total": 4}
    assert m["errors_by_kind"] == {"timeout": 1}
    assert m["window_s"] == approx(3.0)
    assert m["ttft_s"]["p50"] == approx(0.75) and m["ttft_s"]["p90"] == approx(0.95)
    assert m["ttft_s"]["mean"] == approx(0.75) and m["ttft_s"]["count"] == 2
    assert m["itl_s"]["p50"] == approx(0.5) and m["itl_s"]["mean"] == approx(2 / 3)
    assert m["e2e_s"]["p99"] == approx(2.0)
    # r_i = e2e / out = [2/3, 1]; P90 = 2/3 + 0.9/3
    assert m["interactivity"] == approx(1 / (2 / 3 + 0.9 / 3))
    # TPOT = [(2-1)/2, (2.5-1.5)/1] = [0.5, 1.0]; P90 = 0.95
    assert m["interactivity_itl_p90"] == approx(1 / 0.95)
    assert m["tokens"]["total"] == 305 and m["tokens"]["cached"] == 210
    assert m["tpgs"] == approx(305 / 3 / 2)
    assert m["output_tps"] == approx(5 / 3)
    assert m["hit_rate"]["served"] == approx(0.7)
    assert m["hit_rate"]["theoretical"] == approx(0.8)
    c = m["cost"]
    assert c["served_usd"] == approx(3 / 3600 * 2 * 3.6)
    assert c["tokens_per_usd"] == approx(305 / 0.006)
    assert c["api_equivalent_usd"] == approx((210 * 0.5 + 90 * 5 + 5 * 25) / 1e6)
    assert c["api_to_served_ratio"] == approx(680e-6 / 0.006)
    assert m["ttft_cdf"][0] == [0.5, 0.0] and m["ttft_cdf"][-1] == [1.0, 1.0]
    assert sum(b["requests"] for b in m["timeline"]) == 2


def test_metrics_empty_and_price_list():
    m = compute_metrics([], prices={"output": 10.0})
    assert m["tpgs"] is None and m["interactivity"] is None and m["hit_rate"]["served"] is None
    m = compute_metrics(records(), prices={"output": 10.0, "cached_input": 0.0,
                                           "uncached_input": 1.0})
    assert m["cost"]["api_equivalent_usd"] == pytest.approx((90 * 1 + 5 * 10) / 1e6)
    assert m["cost"]["served_usd"] is None


def _result(conc, tpgs_scale=1.0):
    recs = records()
    for r in recs:
        if r.prompt_tokens:
            r.prompt_tokens = int(r.prompt_tokens * tpgs_scale)
    return {"command": "agentx", "config": {"concurrency": conc, "scale": 4, "time_scale": 0.1},
            "server": {"mode": "ids"}, "metrics": compute_metrics(recs)}


def test_compare_ratios_table_and_plots(tmp_path, capsys):
    a, b = _result(1), _result(4, 2.0)
    cmp = report.compare([a, b], ["A", "B"])
    row = next(r for r in cmp["rows"] if r["key"] == "metrics.tpgs")
    assert row["ratios"][0] == pytest.approx(b["metrics"]["tpgs"] / a["metrics"]["tpgs"])
    assert "B/A" in report.compare_table(cmp)
    assert "TPGS" in report.summary_table(a)
    pa, pb = tmp_path / "A.json", tmp_path / "B.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    import argparse

    p = argparse.ArgumentParser()
    report.add_arguments(p)
    args = p.parse_args([str(pa), str(pb), "--json", "--plots", str(tmp_path / "plots")])
    assert report.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["labels"] == ["A", "B"]
    for name in ("pareto.png", "ttft_cdf.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000
    paths = report.write_run_plots(a, str(tmp_path / "run"))
    assert all(os.path.getsize(x) > 1000 for x in paths)


def _run(intended_scale=1.0, max_context=8192, max_output=256, conc=4):
    recs = records()
    for r in recs:
        r.intended_prompt_tokens = int(r.intended_prompt_tokens * intended_scale)
    return {"command": "agentx", "config": {"concurrency": conc, "max_context": max_context,
                                             "max_output": max_output},
            "server": {"mode": "ids"}, "metrics": compute_metrics(recs)}


def _compare_main(tmp_path, runs, *extra):
    import argparse

    paths = []
    for i, r in enumerate(runs):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    p = argparse.ArgumentParser()
    report.add_arguments(p)
    return report.main(p.parse_args([*map(str, paths), *extra]))


def test_compare_refuses_runs_that_did_different_work(tmp_path, capsys):
    same = report.work_problems([_run(), _run(1.015)], ["a", "b"])
    assert same == []  # within the 2% tolerance
    probs = report.work_problems([_run(), _run(1.05), _run(max_context=4096)], ["a", "b", "c"])
    assert len(probs) == 2 and "+5.0%" in probs[0] and "max_context 4096 vs 8192" in probs[1]
    assert _compare_main(tmp_path, [_run(), _run(max_output=128)]) == 3
    assert "WORK DIFFERS: r1: max_output 128 vs 256" in capsys.readouterr().err
    assert _compare_main(tmp_path, [_run(), _run(max_output=128)], "--allow-different-work") == 0
    assert _compare_main(tmp_path, [_run(), _run(1.01)]) == 0


def test_pareto_draws_one_curve_per_system(tmp_path):
    assert report.system_of("loomserve-c16") == "loomserve"
    assert report.system_of("llama-server@4") == "llama-server"
    assert report.system_of("vllm") == "vllm"
    runs = [_run(conc=c) for c in (1, 4, 1, 4)]
    labels = ["loomserve-c1", "loomserve-c4", "llama-c1", "llama-c4"]
    path = report.plot_pareto(runs, str(tmp_path / "p.png"), labels)
    assert os.path.getsize(path) > 1000
    import matplotlib.pyplot as plt

    drawn = {}
    real = plt.Axes.plot

    def spy(ax, xs, ys, *a, **kw):
        drawn[kw.get("label")] = len(xs)
        return real(ax, xs, ys, *a, **kw)

    plt.Axes.plot = spy
    try:
        report.plot_pareto(runs, str(tmp_path / "q.png"), labels)
    finally:
        plt.Axes.plot = real
    assert drawn == {"loomserve": 2, "llama": 2}


# ------------------------------------------------------------------ end to end (real server)

def _weka(sid: str, turns: int, shared: int) -> dict:
    """A growing-context session: each turn appends two 64-token blocks to the last prompt."""
    reqs, ids = [], [10_000 + i for i in range(shared)]
    nxt = 1
    for k in range(turns):
        ids = ids + [nxt, nxt + 1]
        nxt += 2
        reqs.append({"t": 2.0 * k, "type": "s", "model": "m", "in": 64 * len(ids), "out": 4,
                     "hash_ids": list(ids), "api_time": 0.5, "think_time": 0.0})
    return {"id": sid, "models": ["m"], "block_size": 64, "hash_id_scope": "local",
            "requests": reqs}


@pytest.fixture
def server():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomserve", "serve", str(ROOT / "tests/fixtures/tiny-llama"),
         "--port", str(port), "--kv-cache-memory", "16MiB"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("server did not become healthy")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_end_to_end_against_loomserve(server, tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    for i, turns in enumerate((6, 5)):
        (traces / f"s{i}.json").write_text(json.dumps(_weka(f"s{i}", turns, shared=3)))
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "loomserve", "bench", "agentx", "--endpoint", server,
           "--traces", str(traces), "--concurrency", "2", "--duration", "4", "--scale", "4",
           "--time-scale", "0.01", "--seed", "1", "--json", "--json-out", str(out),
           "--records", "--no-progress", "--plots", str(tmp_path / "plots")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    assert json.loads(out.read_text())["metrics"] == res["metrics"]
    m = res["metrics"]
    assert res["server"]["mode"] == "ids" and res["server"]["vocab_size"] == 512
    assert res["config"]["scale"] == 4 and res["config"]["time_scale"] == 0.01
    assert m["requests"]["ok"] > 4 and m["requests"]["errors"] == 0, m["errors_by_kind"]
    assert m["requests"]["primers"] == 2
    served, theo = m["hit_rate"]["served"], m["hit_rate"]["theoretical"]
    assert 0 < served <= theo + 0.02
    # every record's usage agrees with what was sent (token-id prompts are exact)
    for r in res["records"]:
        assert r["error"] is None
        assert r["prompt_tokens"] == r["intended_prompt_tokens"]
        assert r["cached_tokens"] <= r["prompt_tokens"]
    assert (tmp_path / "plots" / "hit_rate_over_time.png").exists()
