"""Grouped MoE experts (layers/grouped_experts.py, kernels/moe.c) against the per-expert loop
(ExpertParallel._loop) on real MoE blocks: random routings, experts with no token, one token,
every token on one expert, a token routed twice to one expert, a DEP slice of the experts; fp32
equal up to summation order, bf16 close to the fp32 reference; SwiGLU and relu^2 (Nemotron-H)
experts; and the blocks take the path."""

from __future__ import annotations

import json

import pytest
import torch

from loomserve.execution.layers import grouped_experts
from loomserve.execution.layers.moe import DeepseekMoE
from loomserve.execution.models.nemotron_h import MoE as NemotronMoE
from loomserve.execution.models.nemotron_h import NemotronHConfig
from loomserve.execution.models.qwen3_moe import Qwen3MoeConfig, SparseMoE
from loomserve.execution.models.qwen3_next import SparseMoE as NextSparseMoE
from tests.execution.models.conftest import FIXTURES

E, H, INTER, K = 8, 64, 40, 2  # INTER = 40: a partial 32-column tile in the kernel


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    if not grouped_experts.usable("swiglu", torch.empty(1, 2 * INTER, H), torch.empty(1, H, INTER)):
        pytest.skip("the moe C kernel did not build")


def _qwen3_moe(dtype=torch.float32) -> SparseMoE:
    cfg = Qwen3MoeConfig.from_hf({
        "model_type": "qwen3_moe", "hidden_size": H, "moe_intermediate_size": INTER,
        "num_experts": E, "num_experts_per_tok": K, "norm_topk_prob": True,
        "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 32})
    torch.manual_seed(0)
    block = SparseMoE(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block.to(dtype)


@pytest.fixture(scope="module")
def block() -> SparseMoE:
    return _qwen3_moe()


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=g)
    return x, w, ids


def _both(block, x, w, ids, first=0, count=E):
    before = grouped_experts.calls
    grouped = block._local(x, w, ids, first, count)
    assert grouped_experts.calls == before + 1  # the grouped path ran, not the loop
    return grouped, block._loop(x, w, ids, first, count)


@pytest.mark.parametrize("tokens,seed", [(1, 0), (3, 1), (17, 2)])
def test_random_routing_matches_loop_fp32(block, tokens, seed):
    x, w, ids = _routing(tokens, seed)
    if tokens <= 3:
        assert len(torch.unique(ids)) < E  # experts with no token
    grouped, loop = _both(block, x, w, ids)
    assert grouped.dtype == torch.float32 and grouped.shape == (tokens, H)
    assert loop.abs().max() > 0.1
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)


def test_every_token_on_one_expert_and_twice_on_one(block):
    x, w, ids = _routing(9, 3)
    ids[:] = 5  # every pair on expert 5, each token in both its slots
    grouped, loop = _both(block, x, w, ids)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    # twice on one expert equals once with the summed weight
    once = block._local(x, (w[:, :1] + w[:, 1:]), ids[:, :1], 0, E)
    torch.testing.assert_close(grouped, once, rtol=1e-5, atol=1e-5)


def test_no_tokens(block):
    x, w, ids = torch.zeros(0, H), torch.zeros(0, K), torch.zeros(0, K, dtype=torch.long)
    grouped, loop = _both(block, x, w, ids)
    assert grouped.shape == loop.shape == (0, H)


def test_dep_slice_drops_other_ranks_experts(block):
    """Experts [2, 6) of the block as a DEP rank holds them: pairs on others add nothing."""
    part = _qwen3_moe()
    for name in part.expert_params:
        module, attr, p = part._stacked(name)
        setattr(module, attr, torch.nn.Parameter(p.data[2:6].clone(), requires_grad=False))
    x, w, ids = _routing(11, 5)
    grouped, loop = _both(part, x, w, ids, first=2, count=4)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    whole = block._loop(x, w * ((ids >= 2) & (ids < 6)), ids, 0, E)
    torch.testing.assert_close(grouped, whole, rtol=1e-5, atol=1e-5)


def test_bf16_close_to_fp32_reference(block):
    x, w, ids = _routing(13, 6)
    ref = block._loop(x, w, ids, 0, E)
    b16 = _qwen3_moe(torch.bfloat16)
    grouped, loop = _both(b16, x.bfloat16(), w.bfloat16(), ids)
    assert grouped.dtype == torch.bfloat16
    scale = ref.abs().max()
    err_grouped = (grouped.float() - ref).abs().max() / scale
    err_loop = (loop.float() - ref).abs().max() / scale
    assert err_grouped < 0.02 and err_grouped <= err_loop * 1.5  # no worse than the loop


def test_blocks_forward_through_grouped_path():
    """Every SwiGLU block declares its stacks; forward runs one grouped call and equals the
    loop (USE off)."""
    torch.manual_seed(1)
    ds = DeepseekMoE(H, INTER, E, K, n_group=2, topk_group=1, norm_topk_prob=True, scale=2.5,
                     n_shared=1)
    nxt = NextSparseMoE(type("Cfg", (), {"num_experts": E, "hidden_size": H,
                                         "moe_intermediate_size": INTER, "num_experts_per_tok": K,
                                         "norm_topk_prob": True,
                                         "shared_expert_intermediate_size": 48})())
    x = torch.randn(6, H)
    for blk in (ds, nxt, _qwen3_moe()):
        with torch.no_grad():
            for p in blk.parameters():
                p.normal_(0, 0.2)
            before = grouped_experts.calls
            out = blk(x)
            assert grouped_experts.calls == before + 1, type(blk).__name__
            grouped_experts.USE = False
            try:
                ref = blk(x)
            finally:
                grouped_experts.USE = True
            assert grouped_experts.calls == before + 1
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_relu2_experts_nemotron_h():
    """Nemotron-H's relu^2 experts (no gate, fp32 sums) through the same kernel."""
    with open(FIXTURES / "tiny-nemotron-h" / "config.json") as f:
        cfg = NemotronHConfig.from_hf(json.load(f))
    torch.manual_seed(2)
    blk = NemotronMoE(cfg)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0, 0.2)
    width, experts = blk.routed_width, blk.local_experts
    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, width, generator=g)
    ids = torch.randint(0, experts, (7, 3), generator=g)
    ids[0] = ids[0, 0]  # one token three times on one expert
    w = torch.rand(7, 3, generator=g)
    grouped, loop = _both(blk, x, w, ids, count=experts)
    assert loop.abs().max() > 0.01
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


def test_fp32_many_rows_per_expert_keep_the_loop(block):
    """fp32 with FP32_LOOP_ROWS rows per expert on average runs torch's GEMMs; bf16 does not."""
    x, w, ids = _routing(grouped_experts.FP32_LOOP_ROWS * E // K + 1, 8)  # just over it
    before = grouped_experts.calls
    block.run_experts(x, w, ids)
    assert grouped_experts.calls == before
    _qwen3_moe(torch.bfloat16).run_experts(x.bfloat16(), w.bfloat16(), ids)
    assert grouped_experts.calls == before + 1
