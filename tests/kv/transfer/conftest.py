"""Two engines of one process with the in-process transfer backend: a prefill instance A and a
decode instance B, and the legs of the kv_transfer_params handshake driven by hand (what the
router does over HTTP)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from loomserve import LLM, SamplingParams
from loomserve.engine.output import RequestOutput
from loomserve.engine.processor import RequestState

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # the prefill leg


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


def make(name: str, role: str = "both", **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "2MiB")
    kw.setdefault("block_size", 4 if name != "tiny-llama" else 16)
    return LLM(str(FIXTURES / name), dtype="float32", device="cpu", role=role,
               kv_transfer_backend="inproc", **kw)


@pytest.fixture(scope="module")
def engines():
    """A reference instance, a prefill instance A and a decode instance B (tiny-llama), one
    set per test module."""
    ref, a, b = make("tiny-llama"), make("tiny-llama", "prefill"), make("tiny-llama", "decode")
    yield ref, a, b
    for e in (ref, a, b):
        e.close()


def reference(ref: LLM, prompt: list[int], rid: str) -> list[int]:
    """A single instance's greedy tokens for prompt, computed from nothing."""
    ref.core.kv.reset_prefix_cache()
    return leg(ref, rid, prompt, GREEDY).token_ids


def leg(llm: LLM, rid: str, prompt: list[int], sp: SamplingParams,
        params: dict | None = None) -> RequestOutput:
    """One request through llm's core, stepped here; its final RequestOutput."""
    msg = llm.inputs.make_core_request(rid, prompt, sp, kv_transfer_params=params)
    state = RequestState(rid, msg.prompt_token_ids, sp, llm.tokenizer)
    assert llm.core.add(msg) is None
    out = None
    deadline = time.monotonic() + 60
    while llm.core.has_work() and time.monotonic() < deadline:
        for o in llm.core.step():
            if o.request_id == rid:
                out = state.process([o])
    assert out is not None and out.finished, "the request did not finish"
    return out


def prefill(a: LLM, rid: str, prompt: list[int]) -> dict:
    """The prefill leg on a; its kv_transfer_params (asserted present)."""
    out = leg(a, rid, prompt, ONE, {"do_remote_decode": True})
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def peer_tokens(llm: LLM) -> int:
    return llm.core.tiers.hit_tokens_by_source().get("peer", 0) if llm.core.tiers else 0
