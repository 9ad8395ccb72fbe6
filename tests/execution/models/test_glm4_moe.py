"""GLM-4.5 MoE (Glm4MoeForCausalLM) against transformers, fp32, on tests/fixtures/tiny-glm4-moe:
partial RoPE (half of each head), q/k norms, a bias on q/k/v, one dense layer
(first_k_dense_replace), then group-limited sigmoid routing with e_score_correction_bias and a
shared expert; checkpoint stored per expert as the Hub's, with an MTP layer to skip. Every way a
step can be cut (the Llama family's scenarios, run here on this fixture), HF's greedy generate,
both expert layouts at load, tensor parallelism (-tp 2) equal to one rank, and the chat
template's parsers."""

from __future__ import annotations

import json
import os

import pytest
import torch

from loomserve.execution.layers.moe import DeepseekMoE
from loomserve.execution.models.glm4_moe import Glm4MoeConfig, Glm4MoeForCausalLM
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

NAME = "tiny-glm4-moe"
PATH = str(FIXTURES / NAME)


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    return tiny_runner(NAME), ref


def _hf_config() -> dict:
    with open(os.path.join(PATH, "config.json")) as f:
        return json.load(f)


def _load(weights) -> Glm4MoeForCausalLM:
    with torch.device("meta"):
        model = Glm4MoeForCausalLM(Glm4MoeConfig.from_hf(_hf_config()))
    model = model.to_empty(device="cpu")
    model.load_weights(weights)
    return model


def _checkpoint() -> list[tuple[str, torch.Tensor]]:
    from loomserve.execution.models.loading.checkpoint import iter_safetensors

    return list(iter_safetensors(PATH))


def test_fixture_exercises_every_part(tiny):
    runner, ref = tiny
    cfg = runner.model.config
    assert (cfg.rotary_dim, cfg.head_dim, cfg.qk_norm, cfg.attention_bias) == (8, 16, True, True)
    assert (cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == (8, 2, 1, 1)
    assert ref.config.rope_parameters["partial_rotary_factor"] == 0.5
    layers = runner.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["SwiGLU", "DeepseekMoE", "DeepseekMoE"]
    assert [type(layer.mlp).__name__ for layer in ref.model.layers] == [
        "Glm4MoeMLP", "Glm4MoeMoE", "Glm4MoeMoE"]
    names = [n for n, _ in _checkpoint()]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names  # the Hub's layout
    assert any(n.startswith("model.layers.3.") for n in names)  # the MTP layer
    # the group limit and the correction bias both change which experts a token gets
    gate = layers[1].mlp.gate
    with torch.no_grad():
        x = layers[1].post_attention_layernorm(runner.model.model.embed_tokens(torch.arange(3, 60)))
        _, ids = gate(x)
        plain = torch.sigmoid(x @ gate.weight.T).topk(2, dim=-1).indices
    assert len(torch.unique(ids)) == 8
    assert (ids.sort(-1).values != plain.sort(-1).values).any(-1).float().mean() > 0.3


def test_block_matches_hf(tiny):
    """One MoE block (group-limited routing, experts, shared expert) against HF's."""
    runner, ref = tiny
    ours, theirs = runner.model.model.layers[2].mlp, ref.model.layers[2].mlp
    assert isinstance(ours, DeepseekMoE)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x[None])[0], atol=1e-6, rtol=1e-5)


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
    assert a.keys() == b.keys() and "model.layers.2.mlp.experts_gate_up" in a
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_or_duplicated_weights_are_refused():
    weights = _checkpoint()
    for drop, missing in (("model.layers.2.mlp.experts.5.up_proj.weight",
                           "model.layers.2.mlp.experts_gate_up#5.1"),
                          ("model.layers.1.mlp.shared_experts.gate_proj.weight",
                           "model.layers.1.mlp.shared_experts.gate_up_proj#0")):
        with pytest.raises(ValueError, match=f"missing \\['{missing}'\\]"):
            _load([(n, t) for n, t in weights if n != drop])
    twice = [(n, t) for n, t in weights if n == "model.layers.1.mlp.experts.0.down_proj.weight"]
    with pytest.raises(ValueError, match="duplicated"):
        _load(weights + twice)
    with pytest.raises(ValueError, match="lacks weights"):
        _load([(n, t) for n, t in weights if "self_attn.q_norm" not in n])


def test_config_reading_and_refusals():
    d = _hf_config()
    # the Hub configs' top-level partial_rotary_factor, or transformers 5's in rope_parameters
    moved = {**d, "rope_parameters": {**d["rope_parameters"], "partial_rotary_factor": 0.25}}
    del moved["partial_rotary_factor"]
    assert Glm4MoeConfig.from_hf(moved).rotary_dim == 4
    plain = {k: v for k, v in d.items() if k != "partial_rotary_factor"}
    assert Glm4MoeConfig.from_hf(plain).rotary_dim == 8  # transformers' default: 0.5
    assert not Glm4MoeConfig.from_hf({**d, "use_qk_norm": False}).qk_norm  # GLM-4.5-Air
    assert [Glm4MoeConfig.from_hf({**d, "first_k_dense_replace": 2}).is_moe(i)
            for i in range(3)] == [False, False, True]
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Glm4MoeConfig.from_hf({**d, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="n_group"):
        Glm4MoeConfig.from_hf({**d, "n_group": 3})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        Glm4MoeConfig.from_hf({**d, "partial_rotary_factor": 0.1})


def test_chat_template_picks_glm45_and_think_parsers():
    """The fixture's template writes GLM-4.5's <arg_key>/<arg_value> calls and <think> blocks:
    auto-detection picks the matching parsers, and a call the template renders parses back."""
    from loomserve.api.chat.frontend import ChatFrontend, ChatRequest
    from loomserve.api.chat.output_parser import ChatOutputParser
    from loomserve.engine.tokenizer import Tokenizer
    from tests.api.parsers.helpers import calls_of, fold, run

    fe = ChatFrontend(Tokenizer.from_folder(PATH), model_type="glm4_moe")
    assert (fe.tool_parser_name, fe.reasoning_parser_name) == ("glm45", "qwen3")
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
    assert "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>fox</arg_value>" in text
    assert "<|observation|>\n<tool_response>\na fox\n</tool_response>" in text
    assert text.endswith("<|user|>\nthanks<|assistant|>")
    turn = text.split("<|assistant|>")[1].split("<|observation|>")[0].lstrip("\n")
    parser = ChatOutputParser(prepared.tool_parser_cls(prepared.tools), prepared.reasoning_parser_cls())
    result = fold(run(parser, [turn]))
    assert result.reasoning.strip() == "search it"
    assert calls_of(result) == [("search", {"query": "fox", "limit": 3})]


def test_tensor_parallel_2_matches_one_rank(monkeypatch):
    """-tp 2 (heads, dense, routed and shared expert columns split; each block's output
    all-reduced): the same greedy tokens and prefix hits as one rank, half the KV page per
    rank."""
    from tests.execution.tp_util import _run

    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    tokens1, cached1, blocks1, page1 = _run(PATH, 1)
    tokens2, cached2, blocks2, page2 = _run(PATH, 2)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] >= 32 and cached1[3] >= 32
    assert page2 * 2 == page1 and blocks2 // 2 == blocks1  # floor(budget / page)
