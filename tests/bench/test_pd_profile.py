"""`loomserve bench pd-profile`: the saturation and ratio math on synthetic numbers, the report,
lengths from traces, and one run against a real tiny-llama `loomserve serve` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from loomserve.bench.pd_profile import workload_from_traces
from loomserve.bench.pd_profile.model import (
    concurrency_levels,
    layout,
    pd_ratio,
    saturation,
    simple_ratio,
)
from loomserve.bench.pd_profile.report import markdown, plot, summarize
from loomserve.bench.pd_profile.runner import Level, Workload
from loomserve.cli import build_parser

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY_LLAMA = os.path.join(ROOT, "tests", "fixtures", "tiny-llama")


def test_levels_double_then_end_at_the_cap():
    assert concurrency_levels(1) == [1]
    assert concurrency_levels(8) == [1, 2, 4, 8]
    assert concurrency_levels(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError):
        concurrency_levels(0)


def test_saturation_is_the_first_level_that_gains_no_more_than_5_percent():
    s = saturation([(1, 100.0), (2, 190.0), (4, 300.0), (8, 310.0)])
    assert (s.concurrency, s.rate, s.reached) == (8, 310.0, True)  # +3.3 %: saturated
    s = saturation([(1, 100.0), (2, 190.0), (4, 170.0)])
    assert (s.concurrency, s.rate, s.reached) == (2, 190.0, True)   # fell: the best is kept
    s = saturation([(1, 100.0), (2, 190.0)])
    assert s.reached is False and s.rate == 190.0                   # still gaining


def test_ratio_formula_and_layout():
    # 2048-token prompts at 4096 tok/s = 0.5 s of a prefill instance per request; 128 output
    # tokens at 512 tok/s (summed over the decode batch) = 0.25 s of a decode instance.
    r = pd_ratio(2048, 128, 4096.0, 512.0)
    assert r == pytest.approx(2.0)
    assert simple_ratio(r) == (2, 1)
    assert simple_ratio(0.5) == (1, 2)
    assert simple_ratio(1 / 3) == (1, 3)
    assert layout(r, 3) == ["prefill", "prefill", "decode"]
    assert layout(0.01, 4) == ["prefill", "decode", "decode", "decode"]  # at least one of each
    assert layout(50.0, 4) == ["prefill", "prefill", "prefill", "decode"]
    assert layout(2.0, 1) == ["both"]
    with pytest.raises(ValueError):
        pd_ratio(2048, 0, 1.0, 1.0)


def _lv(phase, c, wall, prompt=0, cached=0, completion=0):
    return Level(phase, c, c * 3, 0, wall, prompt, cached, completion,
                 {"count": 3, "p50": 10.0, "p90": 12.0}, {"count": 3, "p50": 2.0})


def test_summary_and_markdown_from_synthetic_levels(tmp_path):
    w = Workload(1000, 100)
    prefill = [_lv("prefill", 1, 1.0, 3000), _lv("prefill", 2, 1.0, 6000),
               _lv("prefill", 4, 1.0, 6100)]                          # saturates at 6000 tok/s
    decode = [_lv("decode", 1, 1.0, completion=300), _lv("decode", 2, 1.0, completion=600)]
    combined = [_lv("combined", 1, 2.0, 3000, 0, 300)]
    res = summarize(w, prefill, decode, combined, instances=4, colocated=True)
    # (1000 / 6100) / (100 / 600) = 0.98 prefill per decode
    assert res["ratio"]["prefill_per_decode"] == pytest.approx(0.9836, abs=1e-3)
    assert res["ratio"]["simple"] == [1, 1]
    assert res["layout"]["flags"] == ["--role prefill"] * 2 + ["--role decode"] * 2
    assert res["prefill"]["saturation"]["reached"] and not res["decode"]["saturation"]["reached"]
    md = markdown(res)
    assert md.count("\n| prefill |") == 3 and "| combined | 1 | 3 | 0 | 1,500.0 | 150.0 |" in md
    assert "decode did not saturate" in md and "co-located" in md
    assert "2 x --role prefill, 2 x --role decode" in md
    json.dumps(res)  # the --json output is plain data
    png = tmp_path / "p.png"
    plot(res, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workload_from_traces_counts_only_new_blocks_as_prefill(tmp_path):
    bs = 64
    reqs = [{"t": 0.0, "type": "n", "in": 640, "out": 20, "hash_ids": list(range(10))},
            # shares its first 10 blocks with the request before: 2 new blocks
            {"t": 5.0, "type": "n", "in": 768, "out": 40, "hash_ids": list(range(12))}]
    (tmp_path / "s.json").write_text(json.dumps({"block_size": bs, "requests": reqs}))
    w = workload_from_traces(str(tmp_path))
    assert (w.input_len, w.output_len, w.prefill_len) == (704, 30, (640 + 128) // 2)


def test_cli_registers_pd_profile():
    args = build_parser().parse_args(["bench", "pd-profile", "--prefill", "http://x:1",
                                      "--input-len", "32"])
    assert args.input_len == 32 and args.output_len == 128 and args.max_concurrency == 16


@pytest.fixture(scope="module")
def tiny_instance(tmp_path_factory):
    if not os.path.isdir(TINY_LLAMA):
        pytest.skip("tests/fixtures/tiny-llama is missing")
    from loomserve.control.store_launcher import free_port
    port = free_port()
    log = open(tmp_path_factory.mktemp("pd") / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "loomserve", "serve", TINY_LLAMA, "--port",
                             str(port), "--dtype", "float32", "--kv-cache-memory", "16MiB",
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def test_pd_profile_against_a_real_instance(tiny_instance, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = build_parser().parse_args([
        "bench", "pd-profile", "--prefill", tiny_instance, "--router", tiny_instance,
        "--input-len", "48", "--output-len", "6", "--max-concurrency", "2", "--rounds", "2",
        "--instances", "3", "--out", str(out), "--plot", str(png), "--json"])
    assert args.func(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res == json.loads(out.read_text()) | {"plot": str(png)}
    assert png.stat().st_size > 0
    for phase in ("prefill", "decode", "combined"):
        levels = res[phase]["levels"]
        assert levels and all(lv["errors"] == 0 for lv in levels)
    pre = res["prefill"]["levels"][0]
    assert pre["prompt_tokens"] == 2 * 48 and pre["cached_tokens"] == 0  # unique, uncached
    assert pre["completion_tokens"] == 2
    dec = res["decode"]["levels"][0]
    assert dec["completion_tokens"] == 2 * 6 and dec["cached_tokens"] >= 2 * 32  # prompt hit
    assert [lv["concurrency"] for lv in res["combined"]["levels"]] == [1, 2]
    assert res["ratio"]["prefill_per_decode"] > 0 and len(res["layout"]["roles"]) == 3
    assert "co-located" in " ".join(res["notes"])


def test_pd_profile_reports_an_unreachable_instance(capsys):
    from loomserve.control.store_launcher import free_port
    args = build_parser().parse_args(["bench", "pd-profile", "--prefill",
                                      f"http://127.0.0.1:{free_port()}", "--input-len", "8"])
    assert args.func(args) == 1
    assert "cannot reach" in capsys.readouterr().err
