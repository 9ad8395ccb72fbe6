"""benchmarks/gpu_check.py without a GPU: a clear refusal, and its logic as a CPU dry run."""

from __future__ import annotations

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
