"""Shared by the tensor-parallel tests: fixture paths, one torch thread per rank, and a run
of two prefix-sharing rounds at a given tp size."""

from __future__ import annotations

import os

import pytest

from loomserve.sampling_params import SamplingParams

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SYSTEM = list(range(3, 40))  # a shared prefix longer than two 16-token blocks


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")  # the worker inherits the environment


def _fixture(name: str) -> str:
    path = os.path.abspath(os.path.join(FIXTURES, name))
    if not os.path.isdir(path):
        pytest.skip(f"tests/fixtures/{name} is missing")
    return path


def _run(model: str, tp: int, system: list[int] = SYSTEM, **kw) -> tuple[list, list, int, int]:
    """Greedy outputs and cached tokens of two rounds sharing a prefix, plus (blocks, page).
    kw: further engine options."""
    from loomserve.engine.llm import LLM
    kw.setdefault("kv_cache_memory", "2MiB")
    llm = LLM(model, tensor_parallel_size=tp, dtype="float32", **kw)
    try:
        first = llm.generate([system + [50, 51], system + [60] * 9], GREEDY)
        second = llm.generate([system + [70, 71, 72], system + [50, 51]], GREEDY)
        kc = llm.core.runner.kv_cache_config
        outs = first + second
        return ([o.token_ids for o in outs], [o.num_cached_tokens for o in outs],
                kc.num_blocks, kc.page_bytes)
    finally:
        llm.close()
