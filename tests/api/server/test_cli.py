"""`loomserve serve` parses its options into EngineConfig, prints one startup line and serves."""

import os
import subprocess
import sys
import time

import httpx
import pytest

from loomserve.cli import build_parser, engine_config_from_args
from loomserve.config import EngineConfig
from tests.api.server.conftest import TINY_LLAMA


def test_defaults_come_from_engine_config():
    args = build_parser().parse_args(["serve"])
    assert engine_config_from_args(args) == EngineConfig()
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_options_map_to_engine_config():
    args = build_parser().parse_args([
        "serve", "some/model", "--max-model-len", "512", "--kv-cache-memory", "2GiB",
        "--block-size", "32", "--max-num-batched-tokens", "256", "--max-num-seqs", "4",
        "--long-prefill-threshold", "0", "--dtype", "bfloat16", "--device", "cpu", "--seed", "3",
        "--served-model-name", "m", "--no-prefix-caching", "--port", "9000",
        "--kv-cache-dtype", "bf16"])
    assert engine_config_from_args(args) == EngineConfig.from_kwargs(
        model="some/model", max_model_len=512, kv_cache_memory="2GiB", block_size=32,
        kv_cache_dtype="bfloat16",
        max_num_batched_tokens=256, max_num_seqs=4, long_prefill_threshold=0, dtype="bfloat16",
        device="cpu", seed=3, served_model_name="m", enable_prefix_caching=False)
    assert args.port == 9000


def test_a_kv_cache_dtype_it_lacks_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-m", "loomserve", "serve", "--kv-cache-dtype", "int3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "kv_cache_dtype must be one of" in proc.stderr and "bfloat16" in proc.stderr


def test_serve_subprocess_prints_one_startup_line_and_serves():
    if not os.path.isdir(TINY_LLAMA):
        pytest.skip("tests/fixtures/tiny-llama is missing")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "loomserve", "serve", TINY_LLAMA, "--port", str(port),
         "--kv-cache-memory", "4MiB", "--dtype", "float32", "--served-model-name", "tiny",
         "--kv-cache-dtype", "bfloat16", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    lines = [ln for ln in out.splitlines() if ln.startswith("loomserve:")]
    assert len(lines) == 1, out
    line = lines[0]
    for piece in ("tiny", TINY_LLAMA, "float32", "cpu", "KV cache", "(bfloat16)",
                  f"http://127.0.0.1:{port}"):
        assert piece in line, (piece, line)
    # uvicorn re-raises the SIGTERM it shut down on, after a graceful shutdown.
    assert proc.returncode in (0, -15), out


def test_vllm_spellings_underscores_and_json_keys_one_at_a_time():
    """As vLLM's parser: --max_model_len for --max-model-len; --speculative-config.key value
    (nested with dots, merged over the option's own JSON, the keys winning); an unknown
    option is reported as typed."""
    p = build_parser()
    cfg = engine_config_from_args(p.parse_args([
        "serve", "--max_model_len", "512", "--max_num_seqs=7", "my_model_dir",
        "--speculative_config", '{"method": "ngram", "num_speculative_tokens": 5}',
        "--speculative-config.num_speculative_tokens=2", "--speculative-config.prompt_lookup_max",
        "3", "--hf-overrides.rope_scaling.factor", "2.0",
        "--hf-overrides.rope_scaling.rope_type", "yarn"]))
    assert (cfg.model.max_model_len, cfg.scheduler.max_num_seqs) == (512, 7)
    assert cfg.model.model == "my_model_dir"  # a positional keeps its underscores
    spec = cfg.speculative.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 2, 3)
    assert cfg.model.hf_overrides == {"rope_scaling": {"factor": 2.0, "rope_type": "yarn"}}
    only_keys = engine_config_from_args(p.parse_args(
        ["serve", "--speculative-config.method", "suffix",
         "--speculative-config.num_speculative_tokens", "4"])).speculative.speculative_config
    assert (only_keys.method, only_keys.num_speculative_tokens) == ("suffix", 4)
    for bad in (["serve", "--no_such_option"], ["serve", "--max-model-len.x", "3"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_a_vllm_command_line_runs_as_it_is():
    """vLLM's serve options map to loomserve's (--model, --gpu-memory-utilization on a GPU
    only, --kv-offloading-size, --[no-]enable-prefix-caching) or are what loomserve always
    does (accepted, no effect); contradictions are errors naming both."""
    p = build_parser()
    args = p.parse_args([
        "serve", "--model", "some_dir", "--trust-remote-code", "--gpu-memory-utilization", "0.9",
        "--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--enable-chunked-prefill", "--disable-log-requests", "--enforce-eager",
        "--disable-log-stats", "--kv-offloading-size", "4", "--kv-offloading-backend", "native",
        "--device", "cpu"])
    cfg = engine_config_from_args(args)
    assert cfg.model.model == "some_dir" and cfg.cache.enable_prefix_caching
    assert cfg.cache.kv_cache_memory is None  # a CPU: --gpu-memory-utilization has no effect
    assert cfg.tier.host_cache_memory == 4 << 30
    gpu = engine_config_from_args(p.parse_args(
        ["serve", "--gpu-memory-utilization", "0.5", "--device", "cuda"]))
    assert gpu.cache.kv_cache_memory.fraction == 0.5
    assert not engine_config_from_args(
        p.parse_args(["serve", "--no-enable-prefix-caching"])).cache.enable_prefix_caching
    for bad, message in ((["a", "--model", "b"], "two models"),
                         (["--enforce-eager", "--cuda-graphs"], "contradict"),
                         (["--gpu-memory-utilization", "1.5"], r"\(0, 1\]"),
                         (["--host-cache-memory", "1GiB", "--kv-offloading-size", "2"], "both")):
        with pytest.raises(ValueError, match=message):
            engine_config_from_args(p.parse_args(["serve", *bad]))
