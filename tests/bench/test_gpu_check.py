"""benchmarks/gpu_check.py without a GPU: a clear refusal, and its logic as a CPU dry run."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_no_cuda_device_exits_with_a_clear_message(tmp_path):
    out = tmp_path / "never.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU even where one exists
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "no CUDA device" in proc.stderr and "--cpu-only" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_cpu_only_dry_run_on_one_fixture(tmp_path):
    import gpu_check

    out = tmp_path / "gpu_check-cpu.json"
    rc = gpu_check.main(["--cpu-only", "--models", "tiny-llama", "--agree-tokens", "6",
                         "--decode-tokens", "6", "--streams", "3", "--prefill-streams", "2",
                         "--prompt-len", "16", "--out", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0 and data["all_ok"] and data["cpu_only_dry_run"]
    (model,) = data["models"]
    assert model["model"] == "tiny-llama" and "errors" not in model
    assert model["agreement"]["equal"] == model["agreement"]["prompts"]
    speed = model["speed"]
    assert set(speed["decode"]) == {"1", "3"}
    for row in speed["decode"].values():
        assert 0 < row["tok_per_s"] and 0 < row["bandwidth_limit_tok_per_s"]
    assert 0 < speed["prefill"]["tok_per_s"] and speed["weight_bytes"] > 0
    assert data["hardware"]["bandwidth_gbs"] > 0 and data["hardware"]["matmul_tflops"] > 0
    (f8,) = data["fp8"]  # --quantization fp8 ran too: the product, agreement and speed
    assert f8["model"] == "tiny-llama" and "errors" not in f8 and f8["w8a8"] is True
    assert f8["agreement"]["prompts"] == len(gpu_check.AGREE_PROMPTS)
    assert f8["speed"]["weight_bytes"] < speed["weight_bytes"]
    assert all(row["tok_per_s"] > 0 for row in f8["speed"]["decode"].values())
    assert_spec_and_async(data, gpu_check, streams=3)


def assert_spec_and_async(data, gpu_check, streams):
    """The spec part: each drafter's greedy outputs equal plain decoding's, its decode rows
    and counters; the async part: outputs equal, both loops measured."""
    spec = data["spec"]
    assert spec["model"] == "tiny-llama" and "errors" not in spec
    streams_keys = {str(c) for c in gpu_check.SPEC_STREAMS}
    assert set(spec["none"]["decode"]) == streams_keys
    assert set(spec["methods"]) == set(gpu_check.SPEC_METHODS)
    drafts = 0
    for m in spec["methods"].values():
        a = m["agreement"]
        assert a["prompts"] == spec["copy_prompts"] + len(gpu_check.AGREE_PROMPTS)
        assert a["equal"] == a["prompts"] and a["first_difference_at"] == []
        assert set(m["decode"]) == streams_keys
        for row in m["decode"].values():
            assert row["tok_per_s"] > 0 and row["speedup"] > 0
            assert row["accepted_tokens"] <= row["draft_tokens"]
            if row["drafts"]:
                assert 1 <= row["acceptance_length"] <= 1 + m["config"]["num_speculative_tokens"]
            if row["prices"] is not None:
                assert row["prices"]["step_s"] > 0 and row["prices"]["draft_row_s"] > 0
            drafts += row["drafts"]
    assert drafts > 0  # the copy prompts were drafted for, and the drafts verified
    assert gpu_check.spec_async_ok(spec, data["async"])
    differ = copy.deepcopy(spec)  # a disagreement, or a part's error, fails the check (exit 1)
    differ["methods"]["suffix"]["agreement"]["equal"] -= 1
    assert not gpu_check.spec_async_ok(differ, data["async"])
    assert not gpu_check.spec_async_ok(spec, {**data["async"], "errors": ["RuntimeError: x"]})
    asy = data["async"]
    assert "errors" not in asy and asy["equal"] == asy["prompts"] == streams
    spec_round = asy["async_spec"]  # drafts under async scheduling: the same greedy outputs
    assert spec_round["equal"] == streams and spec_round["decode_tok_per_s"] > 0
    assert spec_round["drafts"] > 0 and 0 <= spec_round["overlapped_steps"] <= spec_round["steps"]
    assert not gpu_check.spec_async_ok(spec, {**asy, "async_spec": {**spec_round, "equal": 0}})
    for mode in ("sync", "async"):
        x = asy[mode]
        assert x["decode_tok_per_s"] > 0 and 0 <= x["host_share"] <= 1
        assert len(x["runs_step_ms"]) == gpu_check.ASYNC_ROUNDS
