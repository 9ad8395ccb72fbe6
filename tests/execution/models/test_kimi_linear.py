"""Kimi Linear (Kimi Delta Attention + NoPE MLA + DeepSeek-style MoE) against transformers, fp32,
on tests/fixtures/tiny-kimi-linear: the KDA kernels against transformers' torch fallbacks; every
way a step can be cut (cold, chunked, a mixed batch, a prefix hit restoring a state checkpoint,
through the ModelRunner) gives HF's logits; a second turn's prefix and KDA checkpoint come back
from the host tier; a P/D handover, -tp 2, -dcp 2, -tp 2 -dcp 2 and DEP (-dp 2 with expert
parallelism) equal one instance; the chat template picks the kimi_k2 tool parser."""

from __future__ import annotations

import pytest
import torch

from loomserve.execution.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
from tests.execution.models import test_linear_layers as hybrid
from tests.execution.models.conftest import FIXTURES

NAME = "tiny-kimi-linear"
PATH = str(FIXTURES / NAME)


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM

    model = hybrid.load_fixture(NAME, KimiLinearForCausalLM, KimiLinearConfig)
    ref = AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    return model, ref


def test_kda_kernels_match_transformers_and_each_other():
    """Chunked form (partial last chunk, per-channel decays, a start state) and the decode step
    against transformers' chunk_kda / fused_recurrent_kda fallbacks; a channel forgetting at
    e^-200 per token stays finite (decays are exp of masked log differences)."""
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        chunk_kimi_delta_attention,
        recurrent_kimi_delta_attention,
    )

    from loomserve.execution.layers.gated_deltanet import l2norm, recurrent_gated_delta_step
    from loomserve.execution.layers.kimi_delta import chunk_kda

    g = torch.Generator().manual_seed(0)
    n, h, d = 75, 3, 16  # two 32-token chunks and a partial one
    q, k, v = (torch.randn(n, h, d, generator=g) for _ in range(3))
    gl, beta = -4 * torch.rand(n, h, d, generator=g), torch.rand(n, h, generator=g)
    s0 = torch.randn(h, d, d, generator=g)
    qn, kn = l2norm(q) * d ** -0.5, l2norm(k)
    o, s = chunk_kda(qn, kn, v, gl, beta, s0)
    kw = dict(initial_state=s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref, ref_s = chunk_kimi_delta_attention(q[None], k[None], v[None], gl[None], beta[None], **kw)
    torch.testing.assert_close(o, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, ref_s[0], atol=1e-5, rtol=1e-5)
    st, outs = s0[None].clone(), []
    for t in range(n):
        ot, st = recurrent_gated_delta_step(qn[t:t + 1], kn[t:t + 1], v[t:t + 1], gl[t:t + 1],
                                            beta[t:t + 1], st)
        outs.append(ot)
    torch.testing.assert_close(torch.cat(outs), o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st[0], s, atol=1e-5, rtol=1e-5)
    r1, _ = recurrent_kimi_delta_attention(q[None, :1], k[None, :1], v[None, :1], gl[None, :1],
                                           beta[None, :1], **kw)
    torch.testing.assert_close(outs[0], r1[0], atol=1e-5, rtol=1e-5)
    o2, s2 = chunk_kda(qn, kn, v, -200 * torch.rand(n, h, d, generator=g), beta, s0)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()


def test_fixture_exercises_every_part(pair):
    model, ref = pair
    cfg = model.config
    assert ref.config.model_type == "kimi_linear"
    assert list(cfg.layer_types) == list(ref.config.layer_types) == [
        "linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert [type(x.mlp).__name__ for x in model.model.layers] == ["SwiGLU"] + ["DeepseekMoE"] * 3
    assert (cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == (2, 1, 1)
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0
    kda = model.model.layers[0].linear_attn
    assert kda.A_log.std() > 0 and kda.dt_bias.std() > 0  # per-head and per-channel gates
    mla = model.model.layers[2].self_attn
    assert mla.q_proj is not None and mla.rope == 8  # no query LoRA, a shared unrotated key part
    specs = model.kv_cache_specs(4, torch.float32)
    assert [s.kind for s in specs] == ["linear_state"] * 2 + ["full_attention", "linear_state"]
    assert specs[0].state_shapes == ((192, 3), (4, 16, 16))
    logits = hybrid.hf_logits(ref, hybrid.tokens(8, 9))
    assert logits.std() > 0.1  # not flat: the comparisons below bite


def test_positions_do_not_matter(pair):
    """NoPE: the same tokens at other positions give the same logits (a model that rotated the
    MLA's shared key part would not)."""
    model, ref = pair
    toks = hybrid.tokens(12, 3)
    h = hybrid.Harness(model)
    want = hybrid.hf_logits(ref, toks)[-1]
    with torch.no_grad():
        shifted = ref(torch.tensor([toks]), position_ids=torch.arange(100, 112)[None]).logits[0, -1]
    hybrid.close(shifted, want)
    hybrid.close(h.step([hybrid.Chunk(h.new(toks), 12)])[0], want)


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


def test_runtime_layout_loads_the_same(pair):
    """transformers' runtime names (one stacked conv1d, forget_gate.*, mlp.*, experts stacked)
    load the same parameters as the Hub layout the fixture is saved in; a missing conv is named."""
    from loomserve.execution.models.loading.checkpoint import iter_safetensors

    model, ref = pair
    other = _build(model.config)
    other.load_weights((n, t.detach()) for n, t in ref.state_dict().items())
    a, b = dict(model.named_parameters()), dict(other.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    weights = [(n, t) for n, t in iter_safetensors(PATH)
               if n != "model.layers.1.self_attn.k_conv1d.weight"]
    with pytest.raises(ValueError, match=r"layers\.1\.linear_attn\.conv_weight#k"):
        _build(model.config).load_weights(weights)


def test_config_from_the_hub_fields_and_refusals(pair):
    """The checkpoint's config.json spelling (1-based linear_attn_config lists, no layer_types /
    mlp_layer_types, num_experts_per_token, ...) parses to the same config; options transformers'
    kimi_linear lacks are refused by name."""
    import json

    model, _ = pair
    with open(FIXTURES / NAME / "config.json") as f:
        d = json.load(f)
    hub = {k: v for k, v in d.items() if k not in ("layer_types", "mlp_layer_types",
                                                   "linear_num_heads", "linear_head_dim")}
    assert KimiLinearConfig.from_hf({**hub, "mla_use_nope": True}) == model.config
    for bad, name in (({"mla_use_nope": False}, "mla_use_nope"),
                      ({"linear_attn_config": {**d["linear_attn_config"], "gate_lower_bound": -5.0}},
                       "gate_lower_bound"),
                      ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func")):
        with pytest.raises(ValueError, match=name):
            KimiLinearConfig.from_hf({**hub, **bad})


def _build(cfg: KimiLinearConfig) -> KimiLinearForCausalLM:
    with torch.device("meta"):
        model = KimiLinearForCausalLM(cfg)
    return model.to_empty(device="cpu")


def test_chat_template_picks_kimi_k2_parser():
    """The Kimi-K2-shaped template's <|tool_calls_section_begin|> picks the kimi_k2 parser
    (model_type kimi_linear alone picks it too), and a call the template renders parses back."""
    from loomserve.api.chat.frontend import ChatFrontend, ChatRequest
    from loomserve.api.chat.output_parser import ChatOutputParser
    from loomserve.api.tool_parsers import detect_tool_parser
    from loomserve.engine.tokenizer import Tokenizer
    from tests.api.parsers.helpers import calls_of, fold, run

    assert detect_tool_parser(None, "kimi_linear") == "kimi_k2"
    fe = ChatFrontend(Tokenizer.from_folder(PATH), model_type="kimi_linear")
    assert fe.tool_parser_name == "kimi_k2"
    tools = [{"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]
    call = {"id": "functions.search:0", "type": "function",
            "function": {"name": "search", "arguments": '{"query": "fox"}'}}
    prepared = fe.prepare(ChatRequest([
        {"role": "user", "content": "find the fox"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.search:0", "content": "a fox"},
        {"role": "user", "content": "thanks"}], tools=tools))
    text = prepared.prompt_text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>")
    turn = text.split("<|im_assistant|>assistant<|im_middle|>")[1].split("<|im_end|>")[0]
    assert prepared.reasoning_parser_cls is None  # Kimi Linear Instruct does not think
    for cut in (7, 31, 60):  # streamed in pieces split inside the markers
        parser = ChatOutputParser(prepared.tool_parser_cls(prepared.tools), None)
        assert calls_of(fold(run(parser, [turn[:cut], turn[cut:]]))) == [("search", {"query": "fox"})]


# --- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_rank():
    """Two prefix-sharing rounds on one rank (test_decode_context_parallel._run: 16-token
    blocks, hybrid page sizing off, as DCP needs), shared by the TP and DCP comparisons."""
    from tests.execution.test_decode_context_parallel import _run

    return _run(PATH, 1)


def test_tensor_parallel_2_matches_one_rank(one_rank, monkeypatch):
    """-tp 2: MLA query heads and KDA heads (their conv channels, gates and state pages) split,
    the latent rows replicated, dense and expert columns split: the same greedy tokens and
    prefix hits (KDA checkpoints restored) as one rank; the KDA state share of a page halves."""
    from tests.execution.test_decode_context_parallel import _run

    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    tokens1, cached1, _, pool1, _ = one_rank
    tokens2, cached2, _, pool2, _ = _run(PATH, 1, tp=2)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] >= 32 and cached1[3] >= 32  # the hits happened
    state = [g.bytes_per_block() for p in (pool1, pool2) for g in p.groups
             if g.spec.kind == "linear_state"]
    assert state[1] * 2 == state[0]


def test_decode_context_parallel_2_matches_one_rank(one_rank, monkeypatch):
    """-dcp 2: the MLA layer's latent rows split by token between two ranks (interleave 2),
    the KDA layers replicated: the same greedy tokens and prefix hits as one rank, and each
    rank's page holds half of every block's latent rows; likewise -tp 2 -dcp 2."""
    from tests.execution.test_decode_context_parallel import _run

    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    tokens1, cached1, view1, pool1, _ = one_rank
    tokens2, cached2, view2, pool2, _ = _run(PATH, 2, 2)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] >= 32 and cached1[3] >= 32
    assert view2.block_size == 16 and pool2.block_size == 8
    latent = [g.bytes_per_block() for p in (pool1, pool2) for g in p.groups
              if g.spec.kind == "full_attention"]
    assert latent[1] * 2 == latent[0]
    # -tp 2 -dcp 2 on the same two ranks (vLLM's Kimi configuration): heads and KDA state
    # split by TP, latent rows by DCP
    tokens3, cached3, _, pool3, _ = _run(PATH, 2, 2, tp=2)
    assert tokens3 == tokens1 and cached3 == cached1
    by_kind = {g.spec.kind: g.bytes_per_block() for g in pool3.groups}
    one = {g.spec.kind: g.bytes_per_block() for g in pool1.groups}
    assert by_kind["full_attention"] * 2 == one["full_attention"]
    assert by_kind["linear_state"] * 2 == one["linear_state"]


def test_dep_dp2_greedy_matches_dp1(monkeypatch, capfd):
    """DEP: two data-parallel cores, 4 of the 8 experts on each, tokens exchanged by all-to-all;
    greedy outputs equal one rank's, and both ranks really routed pairs to each other."""
    from tests.engine.test_dep import LOCKSTEP, MAX_TOKENS, run

    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    expected = run(PATH, in_process=True)
    capfd.readouterr()
    got = run(PATH, data_parallel_size=2, enable_expert_parallel=True, prefill_schedule_interval=2)
    assert got == expected
    assert [len(t) for t in got] == MAX_TOKENS
    ranks = [(int(p), int(b)) for p, b in LOCKSTEP.findall(capfd.readouterr().err)]
    assert len(ranks) == 2 and all(p > 0 and b > 0 for p, b in ranks), ranks


def test_prefill_decode_handover_matches_one_instance():
    """P/D (in-process backend): the prefill instance hands over the MLA blocks and the KDA
    state checkpoint; the decode instance's greedy output equals one instance's
    (tests/kv/transfer/test_hybrid.py's handover, on this fixture)."""
    from tests.kv.transfer.test_hybrid import test_hybrid_decode_matches_single_instance

    test_hybrid_decode_matches_single_instance(NAME)


def test_second_turn_prefix_and_checkpoint_from_host_tier(monkeypatch):
    """A pool too small to keep a session between turns: the second turn's MLA blocks and the
    KDA checkpoint at the boundary come back from the host tier; outputs equal a run without
    any cache (tests/kv/tiers/test_hybrid_tiers.py's round trip, on this fixture)."""
    from tests.kv.tiers import test_hybrid_tiers as tiers

    monkeypatch.setitem(tiers.POOL, NAME, 24)
    tiers.test_second_turn_prefix_comes_from_host_tier((NAME, tiers.reference(NAME)))
