"""DeepSeek-V3.2 (DeepSeek Sparse Attention) against transformers' deepseek_v32, fp32, on
tiny-deepseek-v32 (index_topk 8, prompts of 20-40 tokens: the indexer's choice decides the
logits): the latent rows and the indexer keys in their own KV groups give HF's logits cold, in
chunks, on a prefix hit, in mixed batches, through the host tier, over a P/D handover and under
-tp 2, -dcp 2, -tp 2 -dcp 2, -pcp 2 and DEP; decode reads only the selected latent rows (CPU
path and the Triton kernel, the latter under Triton's interpreter here, compiled for sm_90 ahead
of time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from loomserve.execution.batch import ScheduledSeq
from tests.execution.models.conftest import FIXTURES, GREEDY, logits_of, ref_logits, tiny_runner

NAME = "tiny-deepseek-v32"
PATH = str(FIXTURES / NAME)
ATOL = 1e-4


@pytest.fixture(scope="module")
def ref():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runner():
    return tiny_runner(NAME)


GROUPS = 3  # the fixture's KV groups: layer 0's latent rows, layer 1's, both layers' indexer keys
IDX = 2  # the indexer keys' group


class Tables:
    """Fresh block ids for every KV group of one pool."""

    def __init__(self, block_size: int = 4) -> None:
        self.bs, self.next = block_size, 0

    def cover(self, tabs: list[list[int]] | None, n: int) -> list[list[int]]:
        tabs = tabs if tabs is not None else [[] for _ in range(GROUPS)]
        for t in tabs:
            while len(t) * self.bs < n:
                t.append(self.next)
                self.next += 1
        return tabs


def seq(rid, tokens, start, tabs, sample=True) -> ScheduledSeq:
    return ScheduledSeq(rid, list(tokens), start, tabs, sample, GREEDY, 0)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


def _close(ours: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(ours, want, atol=ATOL, rtol=1e-4)


def _greedy(n: int):
    from loomserve.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _hf_generate(ref, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def test_sparsity_bites_and_the_indexer_keys_are_their_own_group(runner, ref):
    """index_topk 8 changes HF's logits at 30 tokens (so the comparisons below test the
    selection); the pool holds two full-attention groups, latent rows and indexer keys."""
    toks = _tokens(30, 0)
    sparse = ref_logits(ref, toks)
    for layer in ref.model.layers:
        layer.self_attn.indexer.index_topk = 10_000
    try:
        dense = ref_logits(ref, toks)
    finally:
        for layer in ref.model.layers:
            layer.self_attn.indexer.index_topk = 8
    assert torch.equal(sparse[:8], dense[:8])  # contexts <= index_topk: every key chosen
    assert (sparse[20:] - dense[20:]).abs().max() > 0.05
    kc, cfg = runner.kv_cache_config, runner.model_config
    # both layers' keys side by side in one entry (a 32-wide row beside the 40-wide latent
    # rows), so the planner gives each layer's latent rows a group of its own: every page
    # >= 80% in use (one key per layer per entry: 40%)
    assert runner.model.keys_per_entry == 2 and runner.model.groups == [0, 1, IDX]
    assert [(type(g.spec).__name__, g.layer_ids, g.spec.kind) for g in kc.groups] == [
        ("MLAAttentionSpec", (0,), "full_attention"), ("MLAAttentionSpec", (1,), "full_attention"),
        ("IndexerKeySpec", (2,), "full_attention")]
    assert kc.groups[IDX].bytes_per_block() == 4 * 2 * cfg.index_head_dim * 4  # 2 layers' keys
    assert min(g.bytes_per_block() for g in kc.groups) / kc.page_bytes == 0.8
    k0, k1 = (layer.self_attn.indexer.key_cache for layer in runner.model.model.layers)
    assert k0.shape == (kc.num_blocks, kc.block_size, cfg.index_head_dim)
    assert k1.data_ptr() - k0.data_ptr() == cfg.index_head_dim * 4  # the next columns


def test_prefill_then_decode_matches_hf(runner, ref):
    t, toks = Tables(), _tokens(30, 1)
    want = ref_logits(ref, toks)
    tabs = t.cover(None, 20)
    _close(logits_of(runner, [seq("a", toks[:20], 0, tabs)])["a"], want[19])
    for pos in range(20, 30):  # sparse decodes over 21-30 keys, top 8
        got = logits_of(runner, [seq("a", [toks[pos]], pos, t.cover(tabs, pos + 1))])
        _close(got["a"], want[pos])


def test_chunked_prefill(runner, ref):
    t, toks = Tables(), _tokens(33, 2)
    want = ref_logits(ref, toks)
    tabs, start = None, 0
    for size in (5, 12, 16):  # later chunks score the cached indexer keys of earlier ones
        tabs = t.cover(tabs, start + size)
        got = logits_of(runner, [seq("a", toks[start:start + size], start, tabs)])
        _close(got["a"], want[start + size - 1])
        start += size


def test_prefix_hit_reuses_both_groups(runner, ref):
    t = Tables()
    prefix = _tokens(24, 3)
    first, second = prefix + _tokens(6, 4), prefix + _tokens(7, 5)
    t1 = t.cover(None, len(first))
    logits_of(runner, [seq("one", first, 0, t1)])
    t2 = t.cover([t[:6] for t in t1], len(second))  # 6 cached blocks of 4 in each group
    want = ref_logits(ref, second + [9])
    _close(logits_of(runner, [seq("two", second[24:], 24, t2)])["two"], want[len(second) - 1])
    got = logits_of(runner, [seq("two", [9], len(second), t.cover(t2, len(second) + 1))])
    _close(got["two"], want[len(second)])


def test_mixed_decodes_and_prefill(runner, ref):
    t = Tables()
    a, b, c = _tokens(22, 6), _tokens(27, 7), _tokens(12, 8)
    wa, wb, wc = ref_logits(ref, a), ref_logits(ref, b), ref_logits(ref, c)
    tb, tc = t.cover(None, 24), t.cover(None, 9)
    got = logits_of(runner, [seq("b", b[:24], 0, tb), seq("c", c[:9], 0, tc)])
    _close(got["b"], wb[23])
    _close(got["c"], wc[8])
    ta = None
    for step, (lo, hi) in enumerate([(0, 13), (13, 22)]):  # A prefills while B and C decode
        pb, pc = 24 + step, 9 + step
        ta = t.cover(ta, hi)
        got = logits_of(runner, [seq("b", [b[pb]], pb, t.cover(tb, pb + 1)),
                                 seq("a", a[lo:hi], lo, ta, sample=hi == 22),
                                 seq("c", [c[pc]], pc, t.cover(tc, pc + 1))])
        _close(got["b"], wb[pb])
        _close(got["c"], wc[pc])  # 10-11 keys: past top-k too, in the same padded pass
    _close(got["a"], wa[21])


def test_narrow_kv_cache_same_cold_chunked_and_decoded():
    """--kv-cache-dtype fp8_e4m3 under an fp32 model: fresh latent rows and indexer keys are
    rounded as their pages keep them, so a prompt prefilled cold, in chunks, or decoded token
    by token gives the same logits (unrounded fresh indexer keys move the cold top-k: fails)."""
    from loomserve.config import EngineConfig
    from loomserve.execution.model_runner import ModelRunner

    r = ModelRunner(EngineConfig.from_kwargs(model=PATH, dtype="float32", device="cpu", block_size=4,
                                             kv_cache_memory="2MB", kv_cache_dtype="fp8_e4m3"))
    assert r.model.model.layers[0].self_attn.indexer.key_cache.dtype == torch.float8_e4m3fn
    t, toks = Tables(), _tokens(28, 12)
    cold = logits_of(r, [seq("a", toks, 0, t.cover(None, 28))])["a"]
    tabs = t.cover(None, 28)
    logits_of(r, [seq("b", toks[:13], 0, tabs)])
    chunked = logits_of(r, [seq("b", toks[13:], 13, tabs)])["b"]
    tabs = t.cover(None, 28)
    logits_of(r, [seq("c", toks[:26], 0, tabs)])
    logits_of(r, [seq("c", [toks[26]], 26, tabs)])
    decoded = logits_of(r, [seq("c", [toks[27]], 27, tabs)])["c"]
    torch.testing.assert_close(chunked, cold, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decoded, cold, atol=1e-5, rtol=1e-5)


def test_decode_reads_only_the_selected_latent_rows(runner, ref, monkeypatch):
    """Corrupting a latent row the indexer did not select leaves the decode bit for bit the
    same; corrupting a selected one, or one indexer key, changes it."""
    from loomserve.execution.layers import sparse_mla

    t, toks = Tables(), _tokens(30, 9)
    tabs = t.cover(None, 30)
    logits_of(runner, [seq("a", toks[:29], 0, tabs)])
    picked = []
    real = sparse_mla.select_decode
    monkeypatch.setattr(sparse_mla, "select_decode",
                        lambda *a: picked.append(real(*a)) or picked[-1])
    step = [seq("a", [toks[29]], 29, tabs)]  # rewrites its own row each time: repeatable
    base = logits_of(runner, step)["a"]
    _close(base, ref_logits(ref, toks)[29])
    slots, valid = picked[0]  # layer 0's choice
    assert slots.shape == (1, 8) and bool(valid.all())
    cache = runner.model.model.layers[0].self_attn.latent_cache
    flat = [b * 4 + o for b in tabs[0][:8] for o in range(4)][:29]
    chosen = set(slots[0].tolist())
    other = next(s for s in flat if s not in chosen)
    keep = cache[other // 4, other % 4].clone()
    cache[other // 4, other % 4] = 1e3
    assert torch.equal(logits_of(runner, step)["a"], base)
    cache[other // 4, other % 4] = keep
    sel = next(s for s in slots[0].tolist() if s != tabs[0][7] * 4 + 1)  # not the decode's own
    keep = cache[sel // 4, sel % 4].clone()
    cache[sel // 4, sel % 4] = 1e3
    assert not torch.allclose(logits_of(runner, step)["a"], base, atol=1e-3)
    cache[sel // 4, sel % 4] = keep
    keys = runner.model.model.layers[0].self_attn.indexer.key_cache
    keep = keys.clone()
    keys[tabs[IDX][:7]] *= -1  # positions 0-27's indexer keys: another top-k
    assert not torch.allclose(logits_of(runner, step)["a"], base, atol=1e-3)
    keys.copy_(keep)
    assert torch.equal(logits_of(runner, step)["a"], base)


def test_triton_sparse_decode_matches_torch():
    """The kernel (interpreted here) against the CPU path: random pages, slots scattered over
    blocks, some invalid, splits, heads not a multiple of the tile, odd latent widths."""
    pytest.importorskip("triton")
    from loomserve.execution.layers.sparse_mla import sparse_decode_torch, sparse_decode_triton

    g = torch.Generator().manual_seed(0)
    for heads, rank, rope, k, dtype in ((4, 32, 8, 40, torch.float32), (20, 48, 16, 600, torch.float32),
                                        (16, 64, 16, 300, torch.bfloat16)):
        cache = torch.randn(50, 4, rank + rope + 2, generator=g).to(dtype)[..., :rank + rope]
        q = torch.randn(3, heads, rank + rope, generator=g).to(dtype)
        slots = torch.randint(0, 200, (3, k), generator=g)
        valid = torch.rand(3, k, generator=g) > 0.2
        want = sparse_decode_torch(q.float(), cache.float(), slots, valid, rank, 0.1)
        got = sparse_decode_triton(q, cache, slots, valid, rank, 0.1)
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_model_on_the_triton_backend_matches_hf(ref):
    """The whole model with the Triton backend (the kernel reads the selected rows in place)."""
    pytest.importorskip("triton")
    r = tiny_runner(NAME, attention_backend="triton")
    t, toks = Tables(), _tokens(26, 10)
    want = ref_logits(ref, toks)
    tabs = t.cover(None, 24)
    logits_of(r, [seq("a", toks[:24], 0, tabs)])
    for pos in (24, 25):
        _close(logits_of(r, [seq("a", [toks[pos]], pos, t.cover(tabs, pos + 1))])["a"], want[pos])


COMPILE = """
import json, torch
from loomserve.execution.attention import triton_kernels as k
from tests.execution.triton_ahead import compile_variant
sig = {"q_ptr": "*DT", "c_ptr": "*DT", "slot_ptr": "*i32", "part_acc": "*fp32",
       "part_ml": "*fp32", "sq_d": "i32", "sq_h": "i32", "sc_b": "i32", "sc_o": "i32",
       "s_slot": "i32", "scale": "fp32", "block_size": "i32", "k_total": "i32",
       "heads": "i32", "n_split": "i32"}
for dt, rank, rope, bk, ieee in (("bf16", 512, 64, 16, False),):
    const = dict(RANK=rank, RANK_PAD=max(16, rank), ROPE=rope, ROPE_PAD=max(16, rope),
                 BLOCK_H=16, BLOCK_K=bk, IEEE=ieee)
    c = compile_variant(k.sparse_mla_decode, {n: t.replace("DT", dt) for n, t in sig.items()},
                        const, 90)
    print(json.dumps({"dtype": dt, "rank": rank, "shared": c.metadata.shared}))
"""


def test_sparse_kernel_compiles_for_sm90():
    """Ahead-of-time compile (Triton's ptxas, no GPU) at DeepSeek-V3.2's dims (rank 512, rope
    64, bf16; the launcher's BLOCK_K 16 there: 230 registers, no spills): tl.dot shapes and
    types the interpreter runs past."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = FIXTURES.parents[1]
    p = subprocess.run([sys.executable, "-c", COMPILE], cwd=root, env=env, capture_output=True,
                       text=True, timeout=300)
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0 and len(rows) == 1, p.stderr[-2000:]


def test_served_through_llm_prefix_hit_and_host_tier(ref):
    """The engine: greedy tokens equal HF's generate cold, on a prefix hit (both groups'
    blocks reused) and with the prefix evicted to the host tier and brought back (latent
    rows and indexer keys: a missing key would move the top-k and the tokens)."""
    from loomserve import LLM

    bs = 4
    a = _tokens(36, 11)
    others = [_tokens(36, 20 + i) for i in range(3)]
    want = {tuple(p): _hf_generate(ref, p, 6) for p in [a, *others]}
    plain = LLM(PATH, dtype="float32", device="cpu", block_size=bs, kv_cache_memory="1MiB")
    try:
        page = plain.core.runner.kv_cache_config.page_bytes
        assert plain.generate(a, _greedy(6))[0].token_ids == want[tuple(a)]
        warm = plain.generate(a[:32] + [7, 8], _greedy(6))[0]
        assert warm.num_cached_tokens == 32
        assert warm.token_ids == _hf_generate(ref, a[:32] + [7, 8], 6)
    finally:
        plain.close()
    from tests.kv.connector.conftest import settle

    llm = LLM(PATH, dtype="float32", device="cpu", block_size=bs,
              kv_cache_memory=str(page * 12 * GROUPS), host_cache_memory=str(page * 160))
    try:
        assert llm.generate(a, _greedy(6))[0].token_ids == want[tuple(a)]
        settle(llm)
        for p in others:  # 12 blocks a group: room for one 42-token request, A is pushed out
            assert llm.generate(p, _greedy(6))[0].token_ids == want[tuple(p)]
        again = llm.generate(a, _greedy(6))[0]
        assert again.token_ids == want[tuple(a)]
        assert again.num_tier_cached_tokens >= 32
    finally:
        llm.close()


def test_tensor_parallel_2_matches_hf(ref, monkeypatch):
    """-tp 2: MLA heads split, the indexer and both caches replicated; HF's greedy tokens, and
    the second round's shared prefix served from the cache."""
    from tests.execution.tp_util import SYSTEM, _run

    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")  # the worker inherits the environment
    tokens2, cached2, _, _ = _run(PATH, 2)
    prompts = [SYSTEM + [50, 51], SYSTEM + [60] * 9, SYSTEM + [70, 71, 72], SYSTEM + [50, 51]]
    assert tokens2 == [_hf_generate(ref, p, 8) for p in prompts]
    assert cached2[2] >= 32 and cached2[3] >= 32


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_context_parallel_2_matches_hf(ref, monkeypatch, tp):
    """-dcp 2 (tokens alternate between the ranks, in both groups): each rank scores its own
    indexer keys, the top-k is taken over both ranks' candidates; HF's greedy tokens, the
    prefix hits of one rank, each rank's pages half a block. -tp 2 -dcp 2: the same ranks
    also split the heads (decode: every head over each rank's selected rows; prefill: the
    context's rows and keys gathered)."""
    from tests.execution.test_decode_context_parallel import _run
    from tests.execution.tp_util import SYSTEM

    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    tokens, cached, view, pool, attn = _run(PATH, 2, 1, tp=tp)
    prompts = [SYSTEM + [50, 51], SYSTEM + [60] * 9, SYSTEM + [70, 71, 72], SYSTEM + [50, 51]]
    assert tokens == [_hf_generate(ref, p, 8) for p in prompts]
    assert cached == [0, 32, 32, 32] and attn.gathered_bytes > 0
    assert [type(g.spec).__name__ for g in pool.groups] == ["MLAAttentionSpec"] * 2 + ["IndexerKeySpec"]
    assert pool.block_size == 8 and view.block_size == 16


def test_prefill_context_parallel_2_matches_hf(ref, monkeypatch):
    """-pcp 2: each rank computes half of every prefill chunk; the latent rows and the indexer
    keys of the other half are exchanged, then each rank's rows select and attend as a chunk
    over a cached prefix. A 150-token prompt in 48-token steps beside decodes, and its hit."""
    from tests.execution.test_prefill_context_parallel import _run
    from tests.execution.tp_util import SYSTEM

    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    tokens, cached, runner = _run(PATH, 2)
    long = [3 + (i * 7) % 300 for i in range(150)]
    prompts = [(SYSTEM + [50, 51], 8), (SYSTEM + [60] * 9, 8), (long, 8),
               (SYSTEM + [70, 71, 72], 12), (long + [9, 8, 7], 12)]
    assert tokens == [_hf_generate(ref, p, n) for p, n in prompts]
    assert cached[3] >= 32 and cached[4] >= 144
    assert runner.attention.name == "pcp" and runner.attention.exchanged_bytes > 0


def test_config_refuses_what_the_model_cannot_run():
    from loomserve.execution.models.deepseek_v32 import DeepseekV32Config

    d = json.loads((FIXTURES / NAME / "config.json").read_text())
    with pytest.raises(ValueError, match="q_lora_rank"):
        DeepseekV32Config.from_hf({**d, "q_lora_rank": None})
    with pytest.raises(ValueError, match="mlp_layer_types"):
        DeepseekV32Config.from_hf({**d, "mlp_layer_types": ["sparse", "dense"]})
    c = DeepseekV32Config.from_hf(d)
    assert (c.index_topk, c.index_head_dim, c.index_n_heads) == (8, 16, 16)


def test_pd_handover_matches_one_instance(ref):
    """P/D (in-process transfer): the prefill instance hands over both groups' pages (latent
    rows and indexer keys); the decode instance's greedy tokens equal HF's and one instance's."""
    from tests.kv.transfer.conftest import GREEDY as PD_GREEDY
    from tests.kv.transfer.conftest import leg, make, peer_tokens, prefill

    prompt = _tokens(41, 30)
    a, b = make(NAME, "prefill"), make(NAME, "decode")
    try:
        params = prefill(a, "p", prompt)
        assert params["num_tokens"] == 40 and len(params["groups"]) == GROUPS
        out = leg(b, "d", prompt, PD_GREEDY, params)
        assert out.token_ids == _hf_generate(ref, prompt, 8)
        assert out.num_tier_cached_tokens == 40 and peer_tokens(b) == 40
    finally:
        a.close()
        b.close()


def test_dep_dp2_matches_hf(ref, monkeypatch, capfd):
    """DEP (-dp 2 --enable-expert-parallel): two engine cores, the 8 experts split between them;
    HF's greedy tokens for prompts of 5-30 tokens decoding past index_topk, and both ranks
    really exchanged tokens for their experts."""
    from tests.engine.test_dep import LOCKSTEP, MAX_TOKENS, PROMPTS, run

    monkeypatch.setenv("LOOMSERVE_NUM_THREADS", "1")
    capfd.readouterr()
    got = run(PATH, data_parallel_size=2, enable_expert_parallel=True, prefill_schedule_interval=2)
    assert got == [_hf_generate(ref, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    ranks = [(int(p), int(b)) for p, b in LOCKSTEP.findall(capfd.readouterr().err)]
    assert len(ranks) == 2 and all(p > 0 and b > 0 for p, b in ranks), ranks


def test_chat_template_picks_dsml_and_think_parsers():
    """The fixture's template writes DeepSeek-V3.2's DSML calls: auto-detection picks deepseek_v32
    and deepseek_r1; a call the template renders into the history parses back; the prompt ends
    with </think> (chat) or <think> (thinking=True), and the output starts inside the reasoning
    only in the latter. A V3.1-style template (V3.2-Exp's) still gets deepseek_v3."""
    from loomserve.api.chat.frontend import ChatFrontend, ChatRequest
    from loomserve.api.chat.output_parser import ChatOutputParser
    from loomserve.api.tool_parsers import detect_tool_parser
    from loomserve.engine.tokenizer import Tokenizer
    from tests.api.parsers.helpers import calls_of, fold, run

    fe = ChatFrontend(Tokenizer.from_folder(PATH), model_type="deepseek_v32")
    assert (fe.tool_parser_name, fe.reasoning_parser_name) == ("deepseek_v32", "deepseek_r1")
    tools = [{"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                        "limit": {"type": "integer"}}}}}]
    call = {"id": "c1", "type": "function",
            "function": {"name": "search", "arguments": '{"query": " fox ", "limit": 3}'}}
    history = [{"role": "user", "content": "find the fox"},
               {"role": "assistant", "content": "On it.", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "a fox"}]
    block = ('\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="search">\n'
             '<｜DSML｜parameter name="query" string="true"> fox </｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="limit" string="false">3</｜DSML｜parameter>\n'
             "</｜DSML｜invoke>\n</｜DSML｜function_calls>")
    for thinking in (False, True):
        prepared = fe.prepare(ChatRequest(history, tools=tools,
                                          template_kwargs={"thinking": thinking}))
        text = prepared.prompt_text
        head = "<｜Assistant｜><think></think>" if thinking else "<｜Assistant｜></think>"
        assert head + "On it." + block + "<｜end▁of▁sentence｜>" in text
        assert "\n\n<function_results>\n<result>a fox</result>\n</function_results>" in text
        assert text.endswith("<think>" if thinking else "</think>")
        assert prepared.starts_in_reasoning == thinking
    turn = "Looking.</think>On it." + block  # what the model writes after <think>
    parser = ChatOutputParser(prepared.tool_parser_cls(prepared.tools),
                              prepared.reasoning_parser_cls(prepared.starts_in_reasoning))
    result = fold(run(parser, list(turn)))
    assert (result.reasoning, result.content) == ("Looking.", "On it.\n\n")
    assert calls_of(result) == [("search", {"query": " fox ", "limit": 3})]
    v31 = "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}<think>"
    assert detect_tool_parser(v31, "deepseek_v32") == "deepseek_v3"
