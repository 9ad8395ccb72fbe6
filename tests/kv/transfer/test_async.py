"""P/D legs under --async-scheduling (engine/step_overlap.py), on either or both sides, while
other requests keep a step in flight: the decode side's greedy tokens and cached counts are the
synchronous pair's (test_inproc), an abort mid-transfer or mid-prefill stays clean, and no
blocks leak on either side."""

from __future__ import annotations

import pytest

from loomserve.engine.processor import RequestState
from tests.kv.transfer.conftest import (
    GREEDY,
    ONE,
    leg,
    make,
    peer_tokens,
    prefill,
    reference,
    tokens,
)

PROMPT = tokens(100, 11)


@pytest.fixture(scope="module")
def trio():
    """A reference instance (synchronous), a prefill instance A and a decode instance B, both
    with async scheduling."""
    ref = make("tiny-llama")
    a = make("tiny-llama", "prefill", async_scheduling=True)
    b = make("tiny-llama", "decode", async_scheduling=True)
    for e in (ref, a, b):
        e.free_at_start = e.core.kv.num_free_blocks
    yield ref, a, b
    for e in (ref, a, b):
        e.close()


def background(llm, tag: str, n: int = 3) -> None:
    """Decoding requests of other lengths, so a step is in flight whenever a leg finishes."""
    for i in range(n):
        rid = f"{tag}-bg{i}"
        llm.core.add(llm.inputs.make_core_request(rid, tokens(9 + 13 * i, 50 + i), GREEDY))


def watch_imports(llm, monkeypatch) -> list[bool]:
    """Whether a step was in flight at each claim of rows for a tier load and each tail copy."""
    seen, core = [], llm.core
    for obj, name in ((core.kv, "claim_pages"), (core.transfer, "apply_tail")):
        def spy(*args, _f=getattr(obj, name)):
            seen.append(core.overlap.in_flight)
            return _f(*args)
        monkeypatch.setattr(obj, name, spy)
    return seen


def assert_clean(llm) -> None:
    core = llm.core
    assert not core.has_work() and not core.scheduler.requests
    assert core.kv.num_free_blocks == llm.free_at_start


@pytest.mark.parametrize("sides", ["async-async", "sync-async", "async-sync"])
def test_handover_matches_the_synchronous_pair(trio, sides, monkeypatch):
    ref, a, b = trio
    writes = watch_imports(b, monkeypatch)
    pre, dec = {"async-async": (a, b), "sync-async": (ref, b), "async-sync": (a, ref)}[sides]
    prompt = tokens(100, 20 + len(sides) + ord(sides[0]) + ord(sides[-1]))
    want = reference(ref, prompt, f"r-{sides}")
    background(pre, f"p-{sides}")
    params = prefill(pre, f"p-{sides}", prompt)
    assert params["num_tokens"] == 96
    dec.core.kv.reset_prefix_cache()
    before = peer_tokens(dec)
    background(dec, f"d-{sides}")
    out = leg(dec, f"d-{sides}", prompt, GREEDY, params)
    assert out.token_ids == want
    # as without async scheduling (test_inproc): 96 imported, the tail's 3 more, 1 computed
    assert out.num_cached_tokens == 99 and out.num_tier_cached_tokens == 96
    assert peer_tokens(dec) - before == 96
    pre.core.idle()  # the decode side's release notice frees the staging
    assert not pre.core.transfer.source.staged
    assert_clean(pre)
    assert_clean(dec)
    if dec is b:  # each import wrote its rows with no step in flight
        assert writes and not any(writes), writes


def test_async_prefill_aborted_with_its_step_in_flight_stages_nothing(trio):
    _, a, _ = trio
    staged = a.core.transfer.source.counters["staged"] if a.core.transfer.source else 0
    background(a, "p2")
    msg = a.inputs.make_core_request("p2", tokens(120, 12), ONE,
                                     kv_transfer_params={"do_remote_decode": True})
    state = RequestState("p2", msg.prompt_token_ids, ONE, a.tokenizer)
    assert a.core.add(msg) is None
    a.core.step()
    assert a.core.overlap.in_flight
    a.core.abort("p2")
    outs = []
    while a.core.has_work():
        outs += [o for o in a.core.step() if o.request_id == "p2"]
    final = state.process(outs) if outs else None
    assert final is None or final.kv_transfer_params is None
    source = a.core.transfer.source
    assert (source.counters["staged"] if source else 0) == staged
    assert_clean(a)


def test_decode_leg_aborted_mid_transfer_stays_clean(trio):
    ref, a, b = trio
    prompt = tokens(110, 14)
    params = prefill(a, "p4", prompt)
    b.core.kv.reset_prefix_cache()
    background(b, "d4")
    assert b.core.add(b.inputs.make_core_request("d4", prompt, GREEDY,
                                                 kv_transfer_params=params)) is None
    b.core.step()
    assert b.core.transfer._legs  # registered, not admitted yet
    b.core.abort("d4")
    while b.core.has_work():
        b.core.step()
    assert not b.core.transfer._legs and not b.core.transfer.peer._transfers
    assert_clean(b)
    a.core.idle()
    assert not a.core.transfer.source.staged
    assert_clean(a)
    out = leg(b, "d4b", prompt, GREEDY)  # the pool still computes right
    assert out.token_ids == reference(ref, prompt, "r4")


def test_hybrid_state_checkpoint_hands_over_with_async_on_both_sides(monkeypatch):
    """A linear-attention model (its state checkpoint travels with the pages), as in
    test_hybrid, with async scheduling on both sides and other requests in flight."""
    name, prompt = "tiny-qwen3-next", tokens(41, 15)
    ref = make(name, block_size=4)
    a = make(name, "prefill", block_size=4, async_scheduling=True)
    b = make(name, "decode", block_size=4, async_scheduling=True)
    try:
        for e in (a, b):
            e.free_at_start = e.core.kv.num_free_blocks
        writes = watch_imports(b, monkeypatch)
        want = leg(ref, "r", prompt, GREEDY).token_ids
        background(a, "p")
        params = prefill(a, "p", prompt)
        assert params["num_tokens"] == 40
        background(b, "d")
        out = leg(b, "d", prompt, GREEDY, params)
        assert out.token_ids == want and out.num_tier_cached_tokens == 40
        assert writes and not any(writes)
        a.core.idle()
        assert_clean(a)
        assert_clean(b)
    finally:
        for e in (ref, a, b):
            e.close()
