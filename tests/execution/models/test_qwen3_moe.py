"""Qwen3-MoE (Qwen3MoeForCausalLM) against transformers, fp32, on tests/fixtures/tiny-qwen3-moe:
Qwen3 attention (q/k norms, GQA), softmax top-2 of 8 experts renormalized, one dense layer
(mlp_only_layers), checkpoint stored per expert as the Hub's. Every way a step can be cut (the
Llama family's scenarios, run here on this fixture), HF's greedy generate, both expert layouts
at load, tensor parallelism (-tp 2) equal to one rank (DEP: tests/engine/test_dep.py),
and the chat template's parsers."""

from __future__ import annotations

import json
import os

import pytest
import torch

from loomserve.execution.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM, SparseMoE
from tests.execution.models.conftest import FIXTURES, tiny_runner

# The Llama family's scenarios (prefill then decode, chunked prefill, mixed prefill + decode
# batch, prefix hit, greedy generate), collected here again over this module's `tiny`.
from tests.execution.models.test_llama_vs_hf import (  # noqa: F401
    test_chunked_prefill,
    test_execute_greedy_matches_hf_generate,
    test_mixed_prefill_and_decode_batch,
    test_prefill_then_decode,
    test_prefix_hit_reuses_blocks,
)

NAME = "tiny-qwen3-moe"
PATH = str(FIXTURES / NAME)


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    return tiny_runner(NAME), ref


def _config() -> Qwen3MoeConfig:
    with open(os.path.join(PATH, "config.json")) as f:
        return Qwen3MoeConfig.from_hf(json.load(f))


def _load(weights) -> Qwen3MoeForCausalLM:
    cfg = _config()
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    model.load_weights(weights)
    return model


def _checkpoint() -> list[tuple[str, torch.Tensor]]:
    from loomserve.execution.models.loading.checkpoint import iter_safetensors

    return list(iter_safetensors(PATH))


def test_fixture_exercises_every_part(tiny):
    runner, ref = tiny
    cfg = runner.model.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.qk_norm) == (8, 2, True, True)
    layers = runner.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["SparseMoE", "SwiGLU", "SparseMoE"]
    assert [type(layer.mlp).__name__ for layer in ref.model.layers] == [
        "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]
    assert any(".mlp.experts.3.up_proj.weight" in n for n, _ in _checkpoint())  # the Hub's layout
    # the router spreads a prompt over most experts, and renormalizing changes the weights
    moe = layers[0].mlp
    x = runner.model.model.embed_tokens(torch.arange(3, 60))
    probs = torch.softmax(moe.gate(x), dim=-1)
    top = probs.topk(2, dim=-1)
    assert len(torch.unique(top.indices)) >= 6
    assert (top.values.sum(-1) < 0.9).all()


def test_stacked_expert_layout_loads_the_same():
    """transformers 5's stacked tensors (mlp.experts.gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) and the Hub's per-expert ones fill the same parameters."""
    weights = _checkpoint()
    per_expert = _load(weights)
    stacked, parts = [], {}
    for name, t in weights:
        if ".mlp.experts." in name:
            pre, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".")[:2]
            parts.setdefault(pre, {}).setdefault(proj, {})[int(e)] = t
        else:
            stacked.append((name, t))
    for pre, p in parts.items():
        n = len(p["down_proj"])
        stacked.append((f"{pre}.mlp.experts.gate_up_proj", torch.stack(
            [torch.cat([p["gate_proj"][e], p["up_proj"][e]]) for e in range(n)])))
        stacked.append((f"{pre}.mlp.experts.down_proj", torch.stack([p["down_proj"][e] for e in range(n)])))
    other = _load(stacked)
    a, b = dict(per_expert.named_parameters()), dict(other.named_parameters())
    assert a.keys() == b.keys() and "model.layers.2.mlp.experts.gate_up_proj" in a
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_or_duplicated_expert_is_refused():
    weights = _checkpoint()
    drop = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(ValueError, match=r"missing \['model.layers.2.mlp.experts.gate_up_proj#5.1'\]"):
        _load([(n, t) for n, t in weights if n != drop])
    twice = [(n, t) for n, t in weights if n == drop]
    with pytest.raises(ValueError, match="duplicated"):
        _load(weights + twice)


def test_config_refusals():
    with open(os.path.join(PATH, "config.json")) as f:
        d = json.load(f)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Qwen3MoeConfig.from_hf({**d, "num_experts_per_tok": 9})
    # a sliding window is switched off unless use_sliding_window (transformers' default)
    assert Qwen3MoeConfig.from_hf({**d, "sliding_window": 32}).sliding_window is None
    slides = Qwen3MoeConfig.from_hf({**d, "sliding_window": 32, "use_sliding_window": True})
    assert slides.sliding_window == 32 and all(slides.is_sliding(i) for i in range(3))
    # decoder_sparse_step: layers off the grid are dense
    sparse = Qwen3MoeConfig.from_hf({**d, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert [sparse.is_moe(i) for i in range(3)] == [False, True, False]


def test_chat_template_picks_qwen3_coder_and_qwen3_parsers():
    """The fixture's template writes Qwen3-Coder's XML calls and <think> blocks: auto-detection
    picks the matching parsers, and a call the template renders parses back."""
    from loomserve.api.chat.frontend import ChatFrontend, ChatRequest
    from loomserve.api.chat.output_parser import ChatOutputParser
    from loomserve.engine.tokenizer import Tokenizer
    from tests.api.parsers.helpers import calls_of, fold, run

    fe = ChatFrontend(Tokenizer.from_folder(PATH), model_type="qwen3_moe")
    assert (fe.tool_parser_name, fe.reasoning_parser_name) == ("qwen3_coder", "qwen3")
    tools = [{"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "limit": {"type": "integer"}}}}}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "search", "arguments": '{"query": "fox", "limit": 3}'}}
    prepared = fe.prepare(ChatRequest([
        {"role": "user", "content": "find the fox"},
        {"role": "assistant", "content": "", "reasoning_content": "search it", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a fox"},
        {"role": "user", "content": "thanks"}], tools=tools))
    text = prepared.prompt_text
    assert "<function>\n<name>search</name>" in text and "<tool_response>\na fox\n" in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parser = ChatOutputParser(prepared.tool_parser_cls(prepared.tools), prepared.reasoning_parser_cls())
    result = fold(run(parser, [turn]))
    assert result.reasoning.strip() == "search it"
    assert calls_of(result) == [("search", {"query": "fox", "limit": 3})]


def test_tensor_parallel_2_matches_one_rank(monkeypatch):
    """-tp 2 (heads, dense and expert columns split; each block's output all-reduced): the same
    greedy tokens and prefix hits as one rank, half the KV page per rank."""
    from tests.execution.tp_util import _run

    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    tokens1, cached1, blocks1, page1 = _run(PATH, 1)
    tokens2, cached2, blocks2, page2 = _run(PATH, 2)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] >= 32 and cached1[3] >= 32
    assert page2 * 2 == page1 and blocks2 // 2 == blocks1  # floor(budget / page)


def test_sparse_moe_matches_hf_block(tiny):
    """One MoE block on random rows, our routing and experts against HF's block."""
    runner, ref = tiny
    ours, theirs = runner.model.model.layers[2].mlp, ref.model.layers[2].mlp
    assert isinstance(ours, SparseMoE)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x[None])[0], atol=1e-6, rtol=1e-5)
