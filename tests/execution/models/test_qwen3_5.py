"""Qwen3.5 dense (Qwen3_5ForCausalLM: Gated DeltaNet with separate input projections, gated
attention, dense SwiGLU MLPs) against transformers, fp32, on tests/fixtures/tiny-qwen3-5: every
way a step can be cut (cold, chunked, a mixed batch, a prefix hit restoring a state checkpoint,
through the ModelRunner) gives HF's logits; the released vision-language layout loads the same
weights; -tp 2 equals one rank; the chat template's parsers. The MoE variant:
test_qwen3_5_moe.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from loomserve.execution.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForCausalLM
from tests.execution.models import test_linear_layers as hybrid
from tests.execution.models.conftest import FIXTURES

NAME = "tiny-qwen3-5"
PATH = str(FIXTURES / NAME)


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM

    model = hybrid.load_fixture(NAME, Qwen3_5ForCausalLM, Qwen3_5Config)
    ref = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    return model, ref


def _hf_config() -> dict:
    with open(os.path.join(PATH, "config.json")) as f:
        return json.load(f)


def _build(cfg: Qwen3_5Config) -> Qwen3_5ForCausalLM:
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
    return model.to_empty(device="cpu")


def _checkpoint() -> list[tuple[str, torch.Tensor]]:
    from loomserve.execution.models.loading.checkpoint import iter_safetensors

    return list(iter_safetensors(PATH))


def test_fixture_exercises_every_part(pair):
    model, ref = pair
    assert ref.config.model_type == "qwen3_5_text"
    kinds = [layer.kind for layer in model.model.layers]
    assert kinds == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert kinds == list(ref.config.layer_types)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SwiGLU"] * 4
    assert all(layer.linear_attn.split_projections for i, layer in enumerate(model.model.layers)
               if i != 2)
    assert model.model.layers[2].self_attn.rotary_dim == 4
    assert any(n.endswith("linear_attn.in_proj_z.weight") for n, _ in _checkpoint())


def test_prefill_then_decode(pair):
    hybrid.scenario_prefill_then_decode(*pair)


def test_chunked_prefill(pair):
    hybrid.scenario_chunked_prefill(*pair)


def test_mixed_batch(pair):
    hybrid.scenario_mixed_batch(*pair)


def test_saves_and_prefix_hit(pair):
    hybrid.scenario_saves_and_prefix_hit(*pair)


def test_through_model_runner(pair):
    hybrid.scenario_runner(NAME, pair[1])


def test_vision_language_layout_loads_the_same(pair):
    """A Qwen3_5ForConditionalGeneration checkpoint (the released layout): config under
    text_config, weights under model.language_model.*, a vision tower and an MTP head beside
    them. The registry serves its text model; the same parameters load."""
    from loomserve.execution.models.registry import resolve

    model, _ = pair
    text = _hf_config()
    wrapped = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "text_config": {**text, "tie_word_embeddings": True}, "tie_word_embeddings": False,
               "vision_config": {"depth": 1}}
    cls, cfg = resolve(wrapped)
    assert cls is Qwen3_5ForCausalLM and cfg == model.config  # the top level's tie wins
    weights = [("model.language_model." + n[len("model."):] if n.startswith("model.") else n, t)
               for n, t in _checkpoint()]
    weights += [("model.visual.blocks.0.attn.qkv.weight", torch.zeros(48, 16)),
                ("mtp.layers.0.mlp.gate_proj.weight", torch.zeros(8, 64))]
    other = _build(cfg)
    other.load_weights(weights)
    a, b = dict(model.named_parameters()), dict(other.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_wrong_layout_or_missing_projection_is_refused():
    cfg = Qwen3_5Config.from_hf(_hf_config())
    weights = _checkpoint()
    missing = r"missing \['model.layers.0.linear_attn.in_proj.weight#b'\]"
    with pytest.raises(ValueError, match=missing):
        _build(cfg).load_weights([(n, t) for n, t in weights
                                  if n != "model.layers.0.linear_attn.in_proj_b.weight"])
    qkvz = ("model.layers.0.linear_attn.in_proj_qkvz.weight", torch.zeros(192, 64))
    with pytest.raises(ValueError, match="in_proj_qkvz"):  # Qwen3-Next's fused layout
        _build(cfg).load_weights(weights + [qkvz])
    # a dense config never builds experts, whatever the dict carries
    assert Qwen3_5Config.from_hf({**_hf_config(), "num_experts": 4}).num_experts == 0


def test_chat_template_picks_qwen3_coder_and_qwen3_parsers():
    """Qwen3.5's template writes Qwen3-Coder's XML calls and opens <think> in the generation
    prompt: auto-detection picks the matching parsers, the prompt opens the reasoning, and a
    call the template renders parses back."""
    from loomserve.api.chat.frontend import ChatFrontend, ChatRequest
    from loomserve.api.chat.output_parser import ChatOutputParser
    from loomserve.engine.tokenizer import Tokenizer
    from tests.api.parsers.helpers import calls_of, fold, run

    fe = ChatFrontend(Tokenizer.from_folder(PATH), model_type="qwen3_5_text")
    assert (fe.tool_parser_name, fe.reasoning_parser_name) == ("qwen3_coder", "qwen3")
    tools = [{"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "limit": {"type": "integer"}}}}}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "search", "arguments": '{"query": "fox", "limit": 3}'}}
    prepared = fe.prepare(ChatRequest([
        {"role": "user", "content": "find the fox"},
        {"role": "assistant", "content": "", "reasoning_content": "search it",
         "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a fox"},
        {"role": "user", "content": "thanks"}], tools=tools))
    text = prepared.prompt_text
    assert "<function>\n<name>search</name>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")  # the prompt opens the reasoning
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parser = ChatOutputParser(prepared.tool_parser_cls(prepared.tools),
                              prepared.reasoning_parser_cls())
    result = fold(run(parser, [turn]))
    assert result.reasoning.strip() == "search it"
    assert calls_of(result) == [("search", {"query": "fox", "limit": 3})]


def run_two_rounds(path: str, tp: int = 1, **kw) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs and cached tokens of two rounds sharing a 150-token prefix: long enough to
    span whole blocks whatever block size the hybrid page sizing picks (kv/planning.py)."""
    from loomserve.engine.llm import LLM
    from loomserve.sampling_params import SamplingParams

    system = [3 + (7 * i) % 400 for i in range(150)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(path, tensor_parallel_size=tp, kv_cache_memory="4MiB", dtype="float32", **kw)
    try:
        outs = (llm.generate([system + [50, 51], system + [60] * 9], greedy)
                + llm.generate([system + [70, 71, 72], system + [50, 51]], greedy))
        return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]
    finally:
        llm.close()


def test_tensor_parallel_2_matches_one_rank(monkeypatch):
    """-tp 2 (attention and Gated DeltaNet heads with their state pages split, the separate
    input projections sliced by head, SwiGLU columns split): the same greedy tokens and prefix
    hits (state checkpoints restored) as one rank."""
    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")  # the worker inherits the environment
    tokens1, cached1 = run_two_rounds(PATH, 1)
    tokens2, cached2 = run_two_rounds(PATH, 2)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] >= 64 and cached1[3] >= 64  # the hits happened
