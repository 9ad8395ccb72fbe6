"""The prompt's tail block in the handover (loomserve.kv.transfer.tail): the decode instance
copies it into its own fresh block and computes only the last prompt token, with outputs
identical to a single instance's; a tail that fails its checksum, or that belongs to other
tokens, is never used (the tokens are computed)."""

from __future__ import annotations

import copy

import pytest

from tests.kv.transfer.conftest import GREEDY, leg, make, prefill, reference, tokens

BS = 16


def applied(b) -> int:
    return b.core.transfer.counters["tails_applied"]


@pytest.mark.parametrize("n", [96, 97, 111])
def test_tail_leaves_only_the_last_token_to_compute(engines, n):
    """On a block boundary (the tail is the last full block, then cached for later turns),
    one past it and one short of the next: identical greedy tokens, n - 1 tokens not computed."""
    ref, a, b = engines
    prompt = tokens(n, n)
    want = reference(ref, prompt, f"r{n}")
    params = prefill(a, f"p{n}", prompt)
    start = (n - 1) // BS * BS
    assert params["num_tokens"] == start and params["tail"]["tokens"] == prompt[start:]
    assert b.core.kv.reset_prefix_cache()
    before = applied(b)
    out = leg(b, f"d{n}", prompt, GREEDY, params)
    assert out.token_ids == want
    assert applied(b) == before + 1, b.core.transfer.stats()
    assert out.num_cached_tokens == n - 1 and out.num_tier_cached_tokens == start
    turn2 = prompt + out.token_ids + tokens(20, n + 1)  # the next turn hits the tail's block too
    out2 = leg(b, f"d{n}b", turn2, GREEDY)
    assert out2.token_ids == reference(ref, turn2, f"r{n}b")
    assert out2.num_cached_tokens >= (n // BS) * BS


def test_corrupt_tail_is_computed(engines):
    ref, a, b = engines
    prompt = tokens(100, 21)
    params = prefill(a, "p21", prompt)
    params["tail"]["checksums"][0] ^= 1  # as a torn or reused slot would read
    assert b.core.kv.reset_prefix_cache()
    before, bad = applied(b), b.core.transfer.tails.counters["tails_bad"]
    out = leg(b, "d21", prompt, GREEDY, params)
    assert out.token_ids == reference(ref, prompt, "r21")
    assert out.num_cached_tokens == 96  # the full blocks only
    assert applied(b) == before and b.core.transfer.tails.counters["tails_bad"] == bad + 1


def test_tail_of_other_tokens_is_not_used(engines):
    """Same full blocks, another ending: the blocks import, the tail does not."""
    ref, a, b = engines
    prompt = tokens(100, 22)
    params = prefill(a, "p22", prompt)
    other = prompt[:96] + [7, 8, 9, 10]
    assert b.core.kv.reset_prefix_cache()
    before = applied(b)
    out = leg(b, "d22", other, GREEDY, copy.deepcopy(params))
    assert out.token_ids == reference(ref, other, "r22")
    assert out.num_cached_tokens == 96 and applied(b) == before


def test_malformed_tail_is_a_value_error(engines):
    _, a, _ = engines
    params = prefill(a, "p23", tokens(40, 23))
    for bad in ({**params["tail"], "start": 1}, {**params["tail"], "addrs": []}, "x"):
        with pytest.raises(ValueError, match="tail"):
            a.inputs.make_core_request("bad", [1, 2], GREEDY,
                                       kv_transfer_params={**params, "tail": bad})


@pytest.mark.parametrize("name", ["tiny-mistral-swa", "tiny-gemma3", "tiny-qwen3-next"])
def test_hybrid_tails(name):
    """Sliding-window groups send their tail block too (one page per group); a model with
    state groups sends none (its state at the last token is not checkpointed)."""
    prompt = tokens(43, 24)  # block size 4: 40 tokens in pages, a 3-token tail
    ref, a, b = make(name), make(name, "prefill"), make(name, "decode")
    try:
        want = leg(ref, "r", prompt, GREEDY).token_ids
        params = prefill(a, "p", prompt)
        out = leg(b, "d", prompt, GREEDY, params)
        assert out.token_ids == want
        if name == "tiny-qwen3-next":
            assert "tail" not in params and out.num_cached_tokens == 40
        else:
            assert len(params["tail"]["addrs"]) == len(b.core.runner.kv_cache_config.groups)
            assert out.num_cached_tokens == 42 and applied(b) == 1
    finally:
        for e in (ref, a, b):
            e.close()
