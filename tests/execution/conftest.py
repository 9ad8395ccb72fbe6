import os

import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
TINY_LLAMA = os.path.abspath(os.path.join(FIXTURES, "tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_path() -> str:
    return TINY_LLAMA


def make_llm(**kwargs):
    from loomserve import LLM
    kwargs.setdefault("kv_cache_memory", "8MiB")
    kwargs.setdefault("dtype", "float32")
    return LLM(TINY_LLAMA, **kwargs)
