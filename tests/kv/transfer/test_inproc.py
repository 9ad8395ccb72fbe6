"""Prefill/decode disaggregation between two engines of one process (in-process backend): the
KV a decode instance imports equals what it would have computed (greedy outputs identical to a
single instance), later turns hit the imported blocks, and every fault (a transfer that dies
mid-way, expired or stale params, a different layout) is a recompute with the same output."""

from __future__ import annotations

import copy

import pytest

from loomserve.kv.transfer import InProcTransfer
from tests.kv.transfer.conftest import GREEDY, leg, make, peer_tokens, prefill, reference, tokens

PROMPT = tokens(100, 1)
BS = 16


def fresh(b):
    """Forget B's device cache, so its next import starts from nothing."""
    assert b.core.kv.reset_prefix_cache()


def test_decode_imports_prefill_kv_and_matches_single_instance(engines):
    ref, a, b = engines
    want = reference(ref, PROMPT, "r1")
    params = prefill(a, "p1", PROMPT)
    assert params["num_tokens"] == (len(PROMPT) - 1) // BS * BS == 96
    fresh(b)
    before = peer_tokens(b)
    out = leg(b, "d1", PROMPT, GREEDY, params)
    assert out.token_ids == want
    # 96 imported as prefix-cache pages, the tail block's 3 more: only the last token computed
    assert out.num_cached_tokens == 99 and out.num_tier_cached_tokens == 96
    assert peer_tokens(b) - before == 96
    a.core.idle()  # the release notice frees A's staging
    src = a.core.transfer.source
    assert not src.staged and src.counters["released"] >= 1
    # the next turn hits the imported blocks on B's device
    turn2 = PROMPT + out.token_ids + tokens(20, 2)
    out2 = leg(b, "d2", turn2, GREEDY)
    assert out2.token_ids == reference(ref, turn2, "r2")
    assert out2.num_cached_tokens >= 96 and out2.num_tier_cached_tokens == 0


def test_transfer_failing_midway_recomputes(engines):
    ref, a, b = engines
    prompt = tokens(90, 3)
    want = reference(ref, prompt, "r3")
    params = prefill(a, "p3", prompt)
    fresh(b)
    tr = b.core.transfer.transfer
    assert isinstance(tr, InProcTransfer)
    fails = b.core.transfer.peer.counters["failed_reads"]
    tr.fail_after_bytes = params["page_bytes"] * 2 + 100  # dies inside the third page
    try:
        out = leg(b, "d3", prompt, GREEDY, params)
    finally:
        tr.fail_after_bytes = None
    assert out.token_ids == want
    assert out.num_cached_tokens == 0  # nothing imported: all computed
    assert b.core.transfer.peer.counters["failed_reads"] > fails  # (one per load round)


def test_expired_params_recompute(engines):
    ref, a, b = engines
    prompt = tokens(70, 4)
    params = prefill(a, "p4", prompt)
    params["expires_at"] = 1.0
    fresh(b)
    expired = b.core.transfer.peer.counters["expired"]
    out = leg(b, "d4", prompt, GREEDY, params)
    assert out.token_ids == reference(ref, prompt, "r4")
    assert out.num_cached_tokens == 0
    assert b.core.transfer.peer.counters["expired"] == expired + 1


def test_stale_params_after_release_recompute(engines):
    """Params whose staging A already freed and reused for another prompt: every page fails
    its checksum, so B computes (never imports another prompt's KV)."""
    ref, a, b = engines
    p5, p6 = tokens(80, 5), tokens(80, 6)
    old = prefill(a, "p5", p5)
    fresh(b)
    assert leg(b, "d5", p5, GREEDY, copy.deepcopy(old)).num_tier_cached_tokens > 0
    a.core.idle()  # released: the slots go back to A's free list
    new = prefill(a, "p6", p6)
    assert set(new["groups"][0]["addrs"]) & set(old["groups"][0]["addrs"])  # reused
    fresh(b)
    bad = b.core.transfer.peer.counters["bad_checksums"]
    old["transfer_id"] = "replayed"  # as if a router retried an old leg
    out = leg(b, "d5b", p5, GREEDY, old)
    assert out.token_ids == reference(ref, p5, "r5")
    assert out.num_cached_tokens == 0
    assert b.core.transfer.peer.counters["bad_checksums"] > bad


def test_unknown_engine_or_wrong_layout_never_imports(engines):
    ref, a, b = engines
    prompt = tokens(60, 7)
    want = reference(ref, prompt, "r7")
    params = prefill(a, "p7", prompt)
    wrong_fp = copy.deepcopy(params)
    wrong_fp["transfer_id"] = "fp"
    wrong_fp["groups"][0]["fingerprint"] = "00" * 16  # another model / layout
    fresh(b)
    read = b.core.transfer.peer.counters["pages_read"]
    out = leg(b, "d7", prompt, GREEDY, wrong_fp)
    assert out.token_ids == want and out.num_cached_tokens == 0
    assert b.core.transfer.peer.counters["pages_read"] == read
    gone = dict(params, transfer_id="gone", remote_engine="inproc:999999")
    fresh(b)
    out = leg(b, "d7b", prompt, GREEDY, gone)
    assert out.token_ids == want and out.num_cached_tokens == 0
    unusable = b.core.transfer.counters["unusable_params"]
    other_backend = dict(params, transfer_id="mc", backend="mooncake")
    fresh(b)
    out = leg(b, "d7c", prompt, GREEDY, other_backend)
    assert out.token_ids == want and out.num_cached_tokens == 0
    assert b.core.transfer.counters["unusable_params"] == unusable + 1


def test_different_prompt_does_not_import(engines):
    """The decode leg's own prompt names the keys: params of another prompt import nothing."""
    ref, a, b = engines
    p8, p9 = tokens(64, 8), tokens(64, 9)
    params = prefill(a, "p8", p8)
    fresh(b)
    out = leg(b, "d9", p9, GREEDY, params)
    assert out.token_ids == reference(ref, p9, "r9") and out.num_cached_tokens == 0


def test_malformed_params_are_a_value_error(engines):
    _, a, _ = engines
    for bad in ("x", {"remote_engine": "h:1"}, {"do_remote_decode": "yes"},
                {"remote_engine": "h:1", "backend": "inproc", "transfer_id": "t",
                 "expires_at": 1e12, "page_bytes": 8, "num_tokens": 0, "hash_start": 0,
                 "hashes": ["zz"], "groups": []}):
        with pytest.raises(ValueError, match="kv_transfer_params"):
            a.inputs.make_core_request("bad", [1, 2, 3], GREEDY, kv_transfer_params=bad)


def test_decode_with_configured_tiers_pulls_through_the_peer_tier(engines):
    """With a host tier configured the peer tier joins below it at the first decode leg."""
    ref, a, _ = engines
    b = make("tiny-llama", "decode", host_cache_memory="1MiB")
    try:
        assert [t.name for t in b.core.tiers.store.tiers] == ["host"]
        prompt = tokens(100, 10)
        params = prefill(a, "p10", prompt)
        out = leg(b, "d10", prompt, GREEDY, params)
        assert [t.name for t in b.core.tiers.store.tiers] == ["host", "peer"]
        assert out.token_ids == reference(ref, prompt, "r10")
        assert out.num_tier_cached_tokens == 96 and peer_tokens(b) == 96
    finally:
        b.close()
