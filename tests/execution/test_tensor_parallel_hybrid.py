"""Tensor parallelism for the families beyond the Llama class: Qwen3-Next (Gated DeltaNet heads
and their state pages split, gated attention, MoE experts' columns split), Nemotron-H (Mamba2
heads and groups split), gpt-oss (sinks split with their heads, biases added once, experts'
columns split), Gemma 3 (the Llama split), DeepSeek-V3 (MLA heads split, latent cache
replicated).

Oracle: the same engine at tensor_parallel_size 1 (itself checked against transformers in the
family tests). The all-reduce sums partial products in another order than one matmul, so
logits may differ in the last bits; the documented tolerance is identical greedy tokens on the
tiny fixtures, and prefix-cache hits (state checkpoints included) must be the same.
Each tp 2 run spawns one worker process; every rank runs one torch thread.
"""

from __future__ import annotations

import pytest

from tests.execution.tp_util import FIXTURES, GREEDY, SYSTEM, _fixture, _run, one_thread_per_rank  # noqa: F401


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-nemotron-h", "tiny-gpt-oss",
                                  "tiny-gemma3"])
def test_greedy_and_prefix_hits_match_one_rank(name):
    model = _fixture(name)
    # 16-token blocks (hybrid page sizing off: tiny-nemotron-h's would be 64 tokens, longer
    # than the shared prefix; test_hybrid_blocks_raised_alike_on_every_rank runs it on)
    tokens1, cached1, blocks1, page1 = _run(model, 1, max_hybrid_block_size=0)
    tokens2, cached2, blocks2, page2 = _run(model, 2, max_hybrid_block_size=0)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] >= 32 and cached1[3] >= 32  # the hits happened
    # each rank holds half the KV heads and half the linear-state heads: half a page, so the
    # same budget holds twice the blocks on every rank
    assert page2 * 2 == page1 and blocks2 == 2 * blocks1


def test_hybrid_blocks_raised_alike_on_every_rank():
    """tiny-nemotron-h at the default sizing: 64-token blocks at tp 1 and tp 2 (each rank's
    state and attention rows halve together), the same tokens and prefix hits."""
    model = _fixture("tiny-nemotron-h")
    system = list(range(3, 150))  # 147 tokens: two 64-token blocks (nine 16-token ones)
    tokens1, cached1, blocks1, page1 = _run(model, 1, system, kv_cache_memory="4MiB")
    tokens2, cached2, blocks2, page2 = _run(model, 2, system, kv_cache_memory="4MiB")
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] == cached1[3] == 128
    assert page2 * 2 == page1 and blocks2 == 2 * blocks1


def test_step_message_carries_state_directives():
    """A hybrid model's workers need each seq's StateDirective (zero / copy a checkpoint into the
    running page, checkpoints to take): it travels in the step message, absent for Llama."""
    from loomserve.execution.batch import ModelInput, ScheduledSeq
    from loomserve.execution.parallel.step_message import (
        BlockSyncReceiver,
        BlockSyncSender,
        decode,
        encode,
    )
    from loomserve.kv.directives import StateDirective
    states = {1: StateDirective(7, init_from=3, saves=[(32, 9), (48, 10)]),
              2: StateDirective(8, zero_init=True)}
    a = ScheduledSeq("a", [1, 2], 30, [[1, 2], [7], [8]], True, GREEDY, states=states)
    b = ScheduledSeq("b", [5], 4, [[4]], True, GREEDY)
    sender, receiver = BlockSyncSender(), BlockSyncReceiver()
    msg = sender.message(ModelInput([a, b], []))
    got = receiver.model_input(decode(encode(msg))).seqs
    assert got[0].states == states and got[1].states == {}
    assert msg.seqs[1].states == []  # nothing extra for a seq without state groups


def test_mla_heads_split_latent_cache_replicated():
    """DeepSeek-V3: MLA heads split, the one latent row per token replicated on every rank (so
    the page and block count are the single rank's); MoE experts split by columns."""
    model = _fixture("tiny-deepseek-v3")  # q-LoRA + YaRN; the q_proj variant shares the rule
    tokens1, cached1, blocks1, page1 = _run(model, 1)
    tokens2, cached2, blocks2, page2 = _run(model, 2)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] >= 32 and cached1[3] >= 32
    assert page2 == page1 and blocks2 == blocks1
