"""Prefill/decode disaggregation of hybrid and MoE models (in-process backend): sliding-window blocks and
linear/SSM state checkpoints are handed over with the attention blocks, and the decode
instance's greedy output equals a single instance's."""

from __future__ import annotations

import pytest

from tests.kv.transfer.conftest import GREEDY, ONE, leg, make, peer_tokens, prefill, tokens

BS = 4
# 41 tokens: the prompt's last full boundary (40 // 4 = 10 blocks) is where the prefill's state
# checkpoint lands, so state models import the whole prefix.
PROMPT = tokens(41, 1)


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-mistral-swa", "tiny-gemma3",
                                  "tiny-qwen3-5", "tiny-qwen3-5-moe", "tiny-qwen3-moe",
                                  "tiny-glm4-moe", "tiny-minimax-m2"])
def test_hybrid_decode_matches_single_instance(name):
    ref, a, b = make(name), make(name, "prefill"), make(name, "decode")
    try:
        want = leg(ref, "r", PROMPT, GREEDY).token_ids
        params = prefill(a, "p", PROMPT)
        assert params["num_tokens"] == 40
        # every group's pages are handed over (attention, window, state checkpoint)
        assert len(params["groups"]) == len(b.core.runner.kv_cache_config.groups)
        out = leg(b, "d", PROMPT, GREEDY, params)
        assert out.token_ids == want
        assert out.num_tier_cached_tokens == 40 and peer_tokens(b) == 40
        turn2 = PROMPT + out.token_ids + tokens(5, 2)
        ref.core.kv.reset_prefix_cache()
        assert leg(b, "d2", turn2, GREEDY).token_ids == leg(ref, "r2", turn2, GREEDY).token_ids
    finally:
        for e in (ref, a, b):
            e.close()


def test_state_model_prompt_on_a_block_boundary_still_correct():
    """40 tokens: the prefill's checkpoint is at the prompt's end (block 10), but the decode
    side must compute the last token, so it needs the state at block 9: without one the
    decode instance computes; the output is the same either way."""
    name = "tiny-qwen3-next"
    prompt = tokens(40, 3)
    ref, a, b = make(name), make(name, "prefill"), make(name, "decode")
    try:
        want = leg(ref, "r", prompt, GREEDY).token_ids
        out = leg(a, "p", prompt, ONE, {"do_remote_decode": True})
        assert leg(b, "d", prompt, GREEDY, out.kv_transfer_params).token_ids == want
    finally:
        for e in (ref, a, b):
            e.close()
