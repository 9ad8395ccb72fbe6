"""`--quantization auto` (the default): a GGUF model runs its own blocks in place on a CPU with
one rank, anything else loads as it is stored; the startup line says which."""

from __future__ import annotations

import os

import torch

from loomserve.api.serve import _weights
from loomserve.engine.messages import CoreReady
from loomserve.execution.layers.quant import QuantLinear
from loomserve.execution.models.loading.loader import resolve_quantization

TINY_LLAMA = os.path.join(os.path.dirname(__file__), "..", "..", "fixtures", "tiny-llama")
CPU = torch.device("cpu")


def test_auto_picks_gguf_for_a_gguf_model_on_cpu_only(tmp_path):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert resolve_quantization("auto", None, CPU) == "gguf"  # the built-in model is a GGUF
    assert resolve_quantization("auto", str(gguf_file), CPU) == "gguf"
    assert resolve_quantization("auto", TINY_LLAMA, CPU) == "none"  # an HF folder
    assert resolve_quantization("auto", str(gguf_file), torch.device("cuda")) == "none"
    for explicit in ("none", "gguf", "int8", "int4", "fp8"):
        assert resolve_quantization(explicit, None, CPU) == explicit


def test_default_config_runs_the_builtin_gguf_in_place():
    from loomserve.config import EngineConfig
    from loomserve.execution.model_runner import ModelRunner

    r = ModelRunner(EngineConfig.from_kwargs(device="cpu", kv_cache_memory="8MB"))
    assert r.quantization == "gguf"
    quantized = [m for m in r.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) > 100  # every linear of the 30 layers, and the tied head


def test_startup_line_names_the_weights_mode():
    base = dict(model_name="m", model_folder="f", eos_token_ids=[], max_model_len=8,
                vocab_size=8, block_size=4, kv_capacity_tokens=8, kv_blocks_total=2,
                max_waiting_requests=2, num_params=1, weight_bytes=1)
    assert "GGUF blocks run in place" in _weights(CoreReady(quantization="gguf", **base))
    assert _weights(CoreReady(quantization="none", dtype="bfloat16", **base)) == "bfloat16"
