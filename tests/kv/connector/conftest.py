"""The tiny Llama fixture with a device pool of a few blocks, for tests of the tier connector
through the engine: prompts, the cache-free reference outputs every tiered run must reproduce,
and helpers that push a prefix out of the device pool or wait for background stores."""

from __future__ import annotations

import random
import time

import pytest

from loomserve import SamplingParams
from loomserve.kv.hashing import hash_chain
from tests.execution.conftest import make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BS = 16
POOL_BLOCKS = 16  # the device pool: room for about two of the prompts below


def prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


A = prompt(1)
OTHERS = [prompt(s) for s in range(10, 14)]


def reference_outputs() -> dict:
    """Outputs without any cache: what every tiered run must reproduce."""
    llm = make_llm(enable_prefix_caching=False)
    return {tuple(p): llm.generate(p, GREEDY)[0].token_ids for p in [A, *OTHERS]}


def tiny_page_bytes() -> int:
    return make_llm(kv_cache_memory="1MiB").core.runner.kv_cache_config.page_bytes


@pytest.fixture(scope="module")
def reference():
    return reference_outputs()


@pytest.fixture(scope="module")
def page_bytes(reference):
    return tiny_page_bytes()


def small_llm(page_bytes, **kw):
    return make_llm(kv_cache_memory=str(page_bytes * POOL_BLOCKS), block_size=BS, **kw)


def run(llm, p):
    return llm.generate(p, GREEDY)[0]


def evict_a(llm, reference):
    """Other traffic pushes A's blocks out of the device pool."""
    for p in OTHERS:
        assert run(llm, p).token_ids == reference[tuple(p)]
    hashes = hash_chain(A, BS)
    assert not any(h in llm.core.kv.pool.cached[0] for h in hashes[:2]), "A still on device"


def settle(llm):
    """Wait for background stores, then release the rows they held."""
    assert llm.core.tiers.store.flush(10)
    llm.core.idle()
    assert llm.core.tiers.num_held_blocks == 0
    assert llm.core.kv.num_free_blocks == llm.core.kv.num_blocks


def drain(core, timeout=30.0):
    deadline = time.monotonic() + timeout
    while core.has_work() and time.monotonic() < deadline:
        core.step()
    assert not core.has_work()
