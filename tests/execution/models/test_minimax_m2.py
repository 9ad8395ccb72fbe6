"""MiniMax-M2 (MiniMaxM2ForCausalLM) against transformers, fp32, on tests/fixtures/tiny-minimax-m2:
q and k RMSNormed over all their heads, partial RoPE (rotary_dim 8 of 16), sigmoid top-2 routing
with e_score_correction_bias and no shared expert; config and checkpoint as the Hub writes them
(block_sparse_moe, w1/w3/w2, an MTP module to skip). Every way a step can be cut (the Llama
family's scenarios, run here on this fixture), HF's greedy generate, both weight layouts at load,
tensor parallelism (-tp 2, the q/k norms' mean squares all-reduced) equal to one rank, and the
chat template's parsers. (DEP runs the MoE block as layers/moe.py's DeepseekMoE, whose expert
all-to-all tests/engine/test_dep.py checks on tiny-deepseek-v3.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

from loomserve.execution.layers.moe import DeepseekMoE
from loomserve.execution.models.minimax_m2 import MiniMaxM2Config, MiniMaxM2ForCausalLM
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

NAME = "tiny-minimax-m2"
PATH = str(FIXTURES / NAME)


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    return tiny_runner(NAME), ref


def _hf_config() -> dict:
    with open(os.path.join(PATH, "config.json")) as f:
        return json.load(f)


def _load(weights) -> MiniMaxM2ForCausalLM:
    with torch.device("meta"):
        model = MiniMaxM2ForCausalLM(MiniMaxM2Config.from_hf(_hf_config()))
    model = model.to_empty(device="cpu")
    model.load_weights(weights)
    return model


def _checkpoint() -> list[tuple[str, torch.Tensor]]:
    from loomserve.execution.models.loading.checkpoint import iter_safetensors

    return list(iter_safetensors(PATH))


def test_fixture_exercises_every_part(tiny):
    runner, ref = tiny
    cfg = runner.model.config
    assert (cfg.rotary_dim, cfg.head_dim, cfg.num_local_experts, cfg.num_experts_per_tok) == (8, 16, 8, 2)
    assert ref.config.rope_parameters["partial_rotary_factor"] == 0.5  # read from rotary_dim
    attn = runner.model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)  # all heads
    names = [n for n, _ in _checkpoint()]
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names  # the Hub's layout
    assert any(n.startswith("model.layers.2.") for n in names)  # the MTP module
    # every expert gets tokens, and the correction bias changes the picks
    layer = runner.model.model.layers[1]
    gate = layer.mlp.gate
    with torch.no_grad():
        x = layer.post_attention_layernorm(runner.model.model.embed_tokens(torch.arange(3, 60)))
        w, ids = gate(x)
        plain = torch.sigmoid(x @ gate.weight.T).topk(2, dim=-1).indices
    assert len(torch.unique(ids)) == 8
    assert (ids.sort(-1).values != plain.sort(-1).values).any(-1).float().mean() > 0.1
    torch.testing.assert_close(w.sum(-1), torch.ones(len(x)))  # renormalized, no scaling


def test_blocks_match_hf(tiny):
    """One MoE block and one attention's q/k norms against HF's modules."""
    runner, ref = tiny
    ours, theirs = runner.model.model.layers[1], ref.model.layers[1]
    assert isinstance(ours.mlp, DeepseekMoE)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.mlp(x), theirs.mlp(x[None])[0], atol=1e-6, rtol=1e-5)
        q, k, _ = ours.self_attn.qkv_proj(x).split([64, 32, 32], dim=-1)
        nq, nk = ours.self_attn._norms(q, k)
        a = theirs.self_attn
        torch.testing.assert_close(nq, a.q_norm(a.q_proj(x)), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(nk, a.k_norm(a.k_proj(x)), atol=1e-6, rtol=1e-5)


def test_transformers_layout_loads_the_same():
    """transformers 5's names (mlp.gate, mlp.e_score_correction_bias) and stacked experts
    (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) fill the same parameters as the
    Hub's block_sparse_moe with per-expert w1 / w3 / w2."""
    weights = _checkpoint()
    hub = _load(weights)
    ours, parts = [], {}
    for name, t in weights:
        if ".block_sparse_moe.experts." in name:
            pre, rest = name.split(".block_sparse_moe.experts.")
            e, w = rest.split(".")[:2]
            parts.setdefault(pre, {}).setdefault(w, {})[int(e)] = t
        else:
            ours.append((name.replace(".block_sparse_moe.", ".mlp."), t))
    for pre, p in parts.items():
        n = len(p["w2"])
        ours.append((f"{pre}.mlp.experts.gate_up_proj", torch.stack(
            [torch.cat([p["w1"][e], p["w3"][e]]) for e in range(n)])))
        ours.append((f"{pre}.mlp.experts.down_proj", torch.stack([p["w2"][e] for e in range(n)])))
    other = _load(ours)
    a, b = dict(hub.named_parameters()), dict(other.named_parameters())
    assert a.keys() == b.keys() and "model.layers.1.mlp.gate.e_score_correction_bias" in a
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_or_duplicated_weights_are_refused():
    weights = _checkpoint()
    drop = "model.layers.1.block_sparse_moe.experts.5.w3.weight"
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.experts_gate_up#5.1'\]"):
        _load([(n, t) for n, t in weights if n != drop])
    twice = [(n, t) for n, t in weights if n == "model.layers.0.block_sparse_moe.experts.0.w2.weight"]
    with pytest.raises(ValueError, match="duplicated"):
        _load(weights + twice)
    with pytest.raises(ValueError, match="lacks weights"):
        _load([(n, t) for n, t in weights if not n.endswith("e_score_correction_bias")])


def test_config_reading_and_refusals():
    d = _hf_config()
    # transformers 5's spelling: partial_rotary_factor in rope_parameters, no rotary_dim
    moved = {k: v for k, v in d.items() if k not in ("rotary_dim", "rope_theta")}
    moved["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25}
    cfg = MiniMaxM2Config.from_hf(moved)
    assert (cfg.rotary_dim, cfg.rope_theta) == (4, 5e6)
    assert MiniMaxM2Config.from_hf(d).sliding_window is None
    for bad, match in (({"num_experts_per_tok": 9}, "num_experts_per_tok"),
                       ({"scoring_func": "softmax"}, "sigmoid"),
                       ({"use_routing_bias": False}, "sigmoid"),
                       ({"shared_intermediate_size": 64}, "shared experts"),
                       ({"qk_norm_type": "per_head"}, "per_layer"),
                       ({"attn_type_list": [0, 1]}, "lightning"),
                       ({"rotary_dim": 20}, "rotary_dim")):
        with pytest.raises(ValueError, match=match):
            MiniMaxM2Config.from_hf({**d, **bad})


def test_chat_template_picks_minimax_m2_and_think_parsers():
    """The fixture's template writes MiniMax-M2's <minimax:tool_call> calls and opens <think> in
    the generation prompt: auto-detection picks the matching parsers, the output starts inside
    the reasoning, and a call the template renders parses back."""
    from loomserve.api.chat.frontend import ChatFrontend, ChatRequest
    from loomserve.api.chat.output_parser import ChatOutputParser
    from loomserve.engine.tokenizer import Tokenizer
    from tests.api.parsers.helpers import calls_of, fold, run

    fe = ChatFrontend(Tokenizer.from_folder(PATH), model_type="minimax_m2")
    assert (fe.tool_parser_name, fe.reasoning_parser_name) == ("minimax_m2", "qwen3")
    tools = [{"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "limit": {"type": "integer"}}}}}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "search", "arguments": '{"query": "fox", "limit": 3}'}}
    prepared = fe.prepare(ChatRequest([
        {"role": "user", "content": "find the fox"},
        {"role": "assistant", "content": "", "reasoning_content": "search it", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a fox"}], tools=tools))
    text = prepared.prompt_text
    assert ('<minimax:tool_call>\n<invoke name="search">\n<parameter name="query">fox</parameter>'
            '\n<parameter name="limit">3</parameter>\n</invoke>\n</minimax:tool_call>[e~[') in text
    assert "]~b]tool\n<response>a fox</response>[e~[\n" in text
    assert text.endswith("]~b]ai\n<think>\n") and prepared.starts_in_reasoning
    turn = text.split("]~b]ai\n<think>\n")[1].split("[e~[")[0]  # the rendered assistant turn
    parser = ChatOutputParser(prepared.tool_parser_cls(prepared.tools),
                              prepared.reasoning_parser_cls(prepared.starts_in_reasoning))
    result = fold(run(parser, [turn]))
    assert result.reasoning.strip() == "search it" and result.content == ""
    assert calls_of(result) == [("search", {"query": "fox", "limit": 3})]


def test_tensor_parallel_2_matches_one_rank(monkeypatch):
    """-tp 2 (heads and the q/k norm weights with them, expert columns split; the norms' mean
    squares and each block's output all-reduced): the same greedy tokens and prefix hits as one
    rank, half the KV page per rank."""
    from tests.execution.tp_util import _run

    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    tokens1, cached1, blocks1, page1 = _run(PATH, 1)
    tokens2, cached2, blocks2, page2 = _run(PATH, 2)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] >= 32 and cached1[3] >= 32
    assert page2 * 2 == page1 and blocks2 // 2 == blocks1  # floor(budget / page)

