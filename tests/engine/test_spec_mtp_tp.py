"""MTP drafts under tensor parallelism (-tp 2, gloo on the CPU) on tiny-deepseek-v3, and on
tiny-glm4-moe, tiny-qwen3-next, tiny-qwen3-5-moe and tiny-deepseek-v32 (their MTP layer split as
their target's layers).

Oracles: the same engine at one rank, without drafts (greedy outputs) and with MTP drafts (every
draft list the core received, and so the acceptance counts). Rank 1 holds half the MTP module's
MLA heads and MoE columns and half its head's vocabulary rows; its own embedding (a checkpoint
variant) half the vocabulary. The all-reduces sum in another order than one rank's products, so
equal drafts hold on the tiny fixture, not in general (a near-tie could flip a draft; the
outputs stay exact whatever the drafts). The vocabulary-split argmax is checked on its own over
real gloo ranks: padding rows, ties across ranks, a rank holding padding only.
"""

from __future__ import annotations

import json
import shutil
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from loomserve import SamplingParams
from tests.engine.test_spec_decode import fixture, make
from tests.engine.test_spec_mtp import MTP, PROMPTS, assert_clean_mtp

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")  # the worker inherits the environment


def _drafting(model: str, tp: int, spec: dict | None = MTP):
    """(outputs of PROMPTS twice: cold then warm, every drafts dict the core received, stats,
    the engine; the caller closes it). 32-token steps: prompts run as several chunks."""
    llm = make(model, spec, tensor_parallel_size=tp, max_num_batched_tokens=32)
    seen: list = []
    if spec is not None:
        receive = llm.core.spec.receive
        llm.core.spec.receive = lambda d: (seen.append(sorted(d.items())), receive(d))
    outs = [o.token_ids for _ in range(2) for o in llm.generate(PROMPTS, GREEDY)]
    return outs, seen, llm.core.spec.stats if spec is not None else None, llm


def _closed(model: str, tp: int, spec: dict | None = MTP):
    outs, seen, stats, llm = _drafting(model, tp, spec)
    llm.close()
    return outs, seen, stats


def test_tp2_mtp_matches_one_rank_outputs_and_drafts_and_leaves_nothing():
    model = fixture("tiny-deepseek-v3")
    plain, _, _ = _closed(model, 1, None)
    one, one_drafts, one_stats = _closed(model, 1)
    outs, drafts, stats, llm = _drafting(model, 2)
    try:
        mtp = llm.core.executor.driver_runner.model.mtp.layers[0]  # rank 0's slice
        assert mtp.block.self_attn.heads == 2 and mtp.block.mlp.experts_gate_up.shape[1] == 32
        assert mtp.shared_head.head.weight.shape[0] == 256 and mtp.eh_proj.weight.shape[0] == 64
        assert outs == plain == one
        assert drafts == one_drafts and len(drafts) > 10
        assert stats.num_draft_tokens > stats.num_drafts  # chained drafts (k = 3) ran
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert (stats.num_accepted_tokens, stats.accepted_per_pos) == \
            (one_stats.num_accepted_tokens, one_stats.accepted_per_pos)
        # rank 0's view: every block back, no request or held chunk row; rank 1 runs the same
        # proposer over the same step messages and ids, so it holds what rank 0 holds
        assert_clean_mtp(llm)
    finally:
        llm.close()


def _glm_slice(mtp) -> tuple:
    return (mtp.self_attn.num_heads, mtp.self_attn.num_kv_heads, mtp.mlp.experts_gate_up.shape[1],
            mtp.shared_head.head.weight.shape[0], mtp.eh_proj.weight.shape)


def _qwen3_next_slice(mtp) -> tuple:
    block = mtp.model.layers[0]
    return (block.self_attn.num_heads, block.self_attn.num_kv_heads,
            block.mlp.experts_gate_up.shape[1], None, mtp.fc.weight.shape)


@pytest.mark.parametrize("name, slice_of", [("tiny-glm4-moe", _glm_slice),
                                            ("tiny-qwen3-next", _qwen3_next_slice),
                                            ("tiny-qwen3-5-moe", _qwen3_next_slice)])
def test_glm_and_qwen3_next_mtp_split_as_their_targets(name, slice_of):
    """GLM-4.5's MTP layer (GQA with q/k/v bias, MoE with a shared expert, its own head) and
    Qwen3-Next's (gated attention, MoE with a gated shared expert, the target's head; Qwen3.5's
    alike, from the released layout, by Qwen3_5TP) at -tp 2:
    rank 0 holds half the heads (one of the two KV heads), half the expert columns, half the
    own head's vocabulary rows; outputs equal one rank's without drafts, drafts one rank's."""
    model = fixture(name)
    plain, _, _ = _closed(model, 1, None)
    one, one_drafts, one_stats = _closed(model, 1)
    outs, drafts, stats, llm = _drafting(model, 2)
    try:
        mtp = llm.core.executor.driver_runner.model.mtp.layers[0]  # rank 0's slice
        head = 256 if name == "tiny-glm4-moe" else None
        assert slice_of(mtp) == (2, 1, 32, head, (64, 128))
        assert outs == plain == one
        assert drafts == one_drafts and len(drafts) > 10
        assert stats.num_draft_tokens > stats.num_drafts  # chained drafts (k = 3) ran
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert stats.accepted_per_pos == one_stats.accepted_per_pos
        assert_clean_mtp(llm)
    finally:
        llm.close()


def test_deepseek_v32_mtp_splits_as_its_target():
    """DeepSeek-V3.2's MTP layer (sparse MLA: heads split, its lightning indexer and so its
    keys whole on every rank, as the target's): outputs and drafts equal one rank's with MTP
    (which equal the plain engine's: test_spec_mtp_v32.py)."""
    model = fixture("tiny-deepseek-v32")
    one, one_drafts, one_stats = _closed(model, 1)
    outs, drafts, stats, llm = _drafting(model, 2)
    try:
        attn = llm.core.executor.driver_runner.model.mtp.layers[0].block.self_attn
        assert (attn.heads, attn.indexer.heads) == (2, 16)
        assert outs == one and drafts == one_drafts and len(drafts) > 10
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert stats.accepted_per_pos == one_stats.accepted_per_pos
        assert_clean_mtp(llm)
    finally:
        llm.close()


def test_own_embedding_target_head_and_padded_vocab_split_alike(tmp_path):
    """A checkpoint variant whose MTP module has its own embed_tokens (a copy of the model's:
    under TP a VocabParallelEmbedding of its own) and no shared_head.head (the target's LM head,
    through the split argmax), with a vocabulary of 511 (the last rank's slice padded)."""
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "own-embed"
    shutil.copytree(fixture("tiny-deepseek-v3"), dst)
    w = load_file(dst / "model.safetensors")
    w["model.layers.3.embed_tokens.weight"] = w["model.embed_tokens.weight"]
    del w["model.layers.3.shared_head.head.weight"]
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.3.embed_tokens.weight"):
        w[k] = w[k][:511].clone()
    save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "vocab_size": 511}))
    one, one_drafts, _ = _closed(str(dst), 1)
    two, two_drafts, stats = _closed(str(dst), 2)
    assert two == one and two_drafts == one_drafts
    assert stats.num_draft_tokens > stats.num_drafts > 10


def _gloo_ranks(size: int, fn) -> list:
    """fn(TPGroup) on `size` real gloo ranks, one thread each in this process (their own
    process groups over one in-memory store); the results in rank order."""
    from loomserve.execution.parallel.state import TPGroup

    store, out = dist.HashStore(), [None] * size

    def rank(r: int) -> None:
        group = dist.ProcessGroupGloo(dist.PrefixStore("argmax", store), r, size,
                                      timedelta(seconds=30))
        out[r] = fn(TPGroup(r, size, group, None, tp_size=size))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_vocab_split_argmax_equals_the_whole_argmax_on_every_rank():
    """3 gloo ranks. Logits all negative (a padding row's 0 would win if counted); a maximum
    repeated across two ranks' slices (the lowest id wins, as torch.argmax); vocabulary 7
    (per rank 3, the last one real id) and 4 (per rank 2, the last rank padding only)."""
    from loomserve.execution.layers.parallel_linear import argmax_logits, vocab_per_rank

    g = torch.Generator().manual_seed(0)
    seven = -1 - torch.rand(4, 7, generator=g)
    seven[1, 2] = seven[1, 5] = -0.5  # a tie between rank 0's and rank 1's slices
    seven[2, 6] = -0.1  # the best id is the last rank's only real one
    four = -1 - torch.rand(3, 4, generator=g)
    four[0, 1] = four[0, 3] = -0.2
    for full in (seven, four):
        vocab = full.shape[-1]
        per = vocab_per_rank(vocab, 3)
        padded = torch.zeros(full.shape[0], per * 3)  # the zero rows a padded head gives
        padded[:, :vocab] = full
        got = _gloo_ranks(3, lambda tp: argmax_logits(
            padded[:, tp.rank * per:(tp.rank + 1) * per], vocab, tp).tolist())
        assert got == [full.argmax(dim=-1).tolist()] * 3, vocab


def test_context_parallelism_is_still_refused():
    """DCP splits the KV by token, which the MTP rows' writes do not follow yet: refused at
    start, naming why (the worker rank is stopped with the engine)."""
    from loomserve import LLM

    with pytest.raises(ValueError, match="context parallelism"):
        LLM(fixture("tiny-deepseek-v3"), dtype="float32", decode_context_parallel_size=2,
            speculative_config=MTP, kv_cache_memory="4MiB")


def test_expert_parallel_over_dp_ranks_is_refused():
    """DEP: the DP lockstep runs dummy MoE steps through every expert-parallel module, which
    would take in the MTP layer's experts on some ranks only; refused at start, naming why."""
    from loomserve import LLM

    with pytest.raises(ValueError, match="expert parallelism over data-parallel"):
        LLM(fixture("tiny-deepseek-v3"), dtype="float32", data_parallel_size=2,
            enable_expert_parallel=True, speculative_config=MTP, kv_cache_memory="4MiB")
