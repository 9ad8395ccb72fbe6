"""P/D legs under --async-scheduling (engine/step_overlap.py), on either or both sides, while
other requests keep a step in flight: the decode side's greedy tokens and cached counts are the
synchronous pair's (test_inproc), the tail copies with no step in flight and no import's load
writes a row the step in flight uses, an abort mid-transfer or mid-prefill stays clean, and no
blocks leak on either side."""

from __future__ import annotations

import pytest

from loomserve import SamplingParams
from loomserve.engine.processor import RequestState
from loomserve.kv.tiers import TieredStore
from tests.engine.test_async_tiers import rows_in_flight
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


def watch_imports(llm, monkeypatch) -> dict[str, list]:
    """Whether a step was in flight at each claim of rows for a tier load ("claims") and each
    tail copy ("tails"); the rows a tier load wrote that the step in flight when it started
    read or wrote ("clashes": loads start only once the step in flight at their claim ran)."""
    seen, core = {"claims": [], "tails": [], "clashes": []}, llm.core
    for obj, name in ((core.kv, "claim_pages"), (core.transfer, "apply_tail")):
        def spy(*args, _f=getattr(obj, name), _key={"claim_pages": "claims"}.get(name, "tails")):
            seen[_key].append(core.overlap.in_flight)
            return _f(*args)
        monkeypatch.setattr(obj, name, spy)

    def load_async(store, keys, dst, rows=None, _f=TieredStore.load_async):
        if core.tiers is not None and store is core.tiers.store:
            clash = rows_in_flight(core, written_only=False) & set(rows or ())
            if clash:
                seen["clashes"].append(clash)
        return _f(store, keys, dst, rows)
    monkeypatch.setattr(TieredStore, "load_async", load_async)
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
    if dec is b:  # the tail copied with no step in flight; no load wrote a row one used
        assert writes["tails"] and not any(writes["tails"]), writes
        assert writes["claims"] and not writes["clashes"], writes


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
        # no tail (state groups), so no drain: the load claims its rows beside a step and
        # writes them only once that step ran
        assert any(writes["claims"]) and not writes["tails"] and not writes["clashes"], writes
        a.core.idle()
        assert_clean(a)
        assert_clean(b)
    finally:
        for e in (ref, a, b):
            e.close()


def test_decode_leg_load_waits_for_the_step_writing_its_claimed_rows(monkeypatch):
    """A decode leg without a tail (state groups) claims rows right after a running request was
    aborted with its row in the step in flight: the freed blocks at the front of the free queue
    are that request's. The import's load writes them only once that step ran (without the
    wait it would write a row the step writes: the clash below)."""
    name, prompt = "tiny-qwen3-next", tokens(41, 16)
    ref = make(name, block_size=4)
    a = make(name, "prefill", block_size=4, async_scheduling=True)
    b = make(name, "decode", block_size=4, async_scheduling=True)
    try:
        b.free_at_start = b.core.kv.num_free_blocks
        writes = watch_imports(b, monkeypatch)
        busy_claims = []  # rows each claim took that the step in flight then wrote
        core = b.core

        def claim(keep, num_new, _f=core.kv.claim_pages):
            pages = _f(keep, num_new)
            busy_claims.append({p.block_id for p in pages or ()} & rows_in_flight(core, True))
            return pages
        monkeypatch.setattr(core.kv, "claim_pages", claim)
        want = leg(ref, "r", prompt, GREEDY).token_ids
        params = prefill(a, "p", prompt)
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        assert core.add(b.inputs.make_core_request("bg", tokens(30, 17), long)) is None
        for _ in range(3):
            core.step()
        assert core.add(b.inputs.make_core_request("d", prompt, GREEDY,
                                                   kv_transfer_params=params)) is None
        core.step()  # the leg's lookup in the peer tier starts
        assert core.tiers.loads.pending["d"].handle.wait(10)
        assert core.abort("bg") and core.overlap.in_flight  # bg's rows: in the step in flight
        core.step()  # the leg claims rows, bg's among them
        assert busy_claims and busy_claims[-1], busy_claims
        out = []
        while core.has_work():
            out += [t for o in core.step() if o.request_id == "d" for t in o.new_token_ids]
        assert out == want
        assert not writes["tails"] and not writes["clashes"], writes
        a.core.idle()
        assert_clean(b)
    finally:
        for e in (ref, a, b):
            e.close()
