"""The Triton attention kernels compile for an NVIDIA GPU (sm_90) on this machine, which has
none: Triton's own ptxas, no driver. Catches what the interpreter runs past (tl.dot shapes,
loop-carried types, constexpr branches); the GPU run itself is benchmarks/gpu_check.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    p = subprocess.run([sys.executable, "-m", "tests.execution.triton_ahead", "--quick"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    bad = [r for r in rows if not r["ok"]]
    assert p.returncode == 0 and not bad, (bad or p.stderr[-2000:])
    kernels = {r["kernel"] for r in rows}
    assert kernels == {"decode_split", "decode_merge", "prefill_split"} and len(rows) == 16
    assert any(r["SPLIT"] for r in rows if r["kernel"] == "prefill_split")
    fp8 = {(r["kernel"], r["KV_FP8"]) for r in rows if r.get("KV_FP8")}  # 8-bit caches
    assert fp8 == {(k, c) for k in ("decode_split", "prefill_split") for c in (1, 2)}
