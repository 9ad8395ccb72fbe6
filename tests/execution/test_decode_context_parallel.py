"""Decode context parallelism: the LSE merge, the token layout, the per-rank partials, and the
engine at D = 2 (two processes on gloo) against D = 1.

Oracle for the partials: full attention (SDPA) over the whole context. Oracle for the engine:
the same engine at decode_context_parallel_size 1. The merge sums the ranks' partials in
another order than one softmax does, so logits may differ in the last bits; the documented
tolerance is identical greedy tokens on the tiny fixtures (as for tensor parallelism).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from loomserve.execution.attention.metadata import AttentionMetadata, PrefillChunk
from loomserve.execution.parallel.context_parallel import (
    DcpLayout,
    decode_partial,
    merge_partials,
    prefill_partial,
    softmax_partial,
)
from tests.execution.tp_util import GREEDY, SYSTEM, _fixture, one_thread_per_rank  # noqa: F401


def _full(q, k, v, scale, q_pos=None, window=None):
    """Reference: q [n, H, hd] over k, v [keys, KVH, hd]; causal by position when q_pos given
    (and keys within `window` of it)."""
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, 1).transpose(0, 1)
    vv = v.repeat_interleave(group, 1).transpose(0, 1)
    mask = None
    if q_pos is not None:
        key = torch.arange(k.shape[0])[None, :]
        mask = key <= q_pos[:, None]
        if window is not None:
            mask &= key > q_pos[:, None] - window
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask,
                                          scale=scale).transpose(0, 1)


@pytest.mark.parametrize("splits", [[7], [3, 4], [1, 5, 1], [0, 4, 3], [2, 2, 2, 1]])
def test_merge_of_partials_is_full_attention(splits):
    torch.manual_seed(len(splits))
    n, heads, hd = 3, 4, 16
    keys = sum(splits)
    q, k, v = torch.randn(n, heads, hd), torch.randn(keys, heads, hd), torch.randn(keys, heads, hd)
    outs, lses, a = [], [], 0
    for s in splits:  # each "rank" sees a disjoint key range (an empty one too)
        o, lse = softmax_partial(q.transpose(0, 1), k[a:a + s].transpose(0, 1),
                                 v[a:a + s].transpose(0, 1), torch.ones(n, s, dtype=torch.bool),
                                 0.25)
        outs.append(o.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
        a += s
    out, lse = merge_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(out, _full(q, k, v, 0.25), rtol=1e-5, atol=1e-5)
    ref = torch.logsumexp(torch.einsum("nhd,khd->nhk", q, k) * 0.25, dim=-1)
    torch.testing.assert_close(lse, ref, rtol=1e-5, atol=1e-5)


def test_merge_of_no_keys_anywhere_is_zero_not_nan():
    out, lse = merge_partials(torch.zeros(2, 3, 4), torch.full((2, 3), float("-inf")))
    assert torch.equal(out, torch.zeros(3, 4)) and torch.isinf(lse).all()


@pytest.mark.parametrize("size,interleave,block", [(2, 1, 16), (2, 4, 16), (4, 2, 16), (3, 1, 12)])
def test_layout_places_every_token_once(size, interleave, block):
    """owner/local_slot, local_count and global_positions describe one bijection."""
    lays = [DcpLayout(r, size, block, interleave) for r in range(size)]
    pos = np.arange(5 * block + 3)
    owner = lays[0].owner(pos)
    for lay in lays:
        mine = pos[owner == lay.rank]
        assert np.array_equal(lay.global_positions(len(mine)), mine)
        # local index = block * b + local slot, dense and increasing
        assert np.array_equal(mine // block * lay.local_block_size + lay.local_slot(mine),
                              np.arange(len(mine)))
        for n in range(len(pos) + 1):
            assert lay.local_count(n) == int((mine < n).sum())
    if interleave == 1:
        assert np.array_equal(owner[:2 * size], np.tile(np.arange(size), 2))


def test_layout_refuses_a_block_it_cannot_split():
    with pytest.raises(ValueError, match="multiple of"):
        DcpLayout(0, 2, 16, 3)


def _scatter(k, v, lay: DcpLayout, table: list[int], nblocks: int):
    """Rank lay.rank's paged caches [nblocks, b, KVH, hd] holding its tokens of k, v."""
    b = lay.local_block_size
    kc = torch.randn(nblocks, b, *k.shape[1:])  # garbage where nothing is written
    vc = torch.randn(nblocks, b, *k.shape[1:])
    pos = np.arange(k.shape[0])
    mine = pos[lay.owner(pos) == lay.rank]
    blk = torch.tensor([table[p // lay.block_size] for p in mine], dtype=torch.long)
    off = torch.from_numpy(lay.local_slot(mine))
    kc[blk, off], vc[blk, off] = k[mine], v[mine]
    return kc, vc


def _rank_meta(lay: DcpLayout, length: int, tab: np.ndarray, window: int | None = None):
    """A rank's localized metadata for one decode at position length - 1 (as localize leaves
    it: local key count, the row's global position kept for the window)."""
    meta = AttentionMetadata(torch.empty(0), torch.empty(0), lay.local_block_size, None,
                             num_decode=1, decode_lens=lay.local_count([length]).astype(np.int32),
                             decode_tables=[tab], sliding_window=window)
    meta.derived["dcp_decode_pos"] = np.array([length - 1])
    return meta


@pytest.mark.parametrize("interleave,flash", [(1, True), (2, True), (1, False), (2, False)])
def test_rank_partials_merge_to_full_attention(interleave, flash, monkeypatch):
    """Decode rows (C kernel and torch) and a prefill chunk over cached context (flash and
    matmul paths, tiles of 16 keys: several per rank), each rank on its pages only, merged:
    full attention over the whole sequence."""
    from loomserve.execution.parallel import context_parallel
    monkeypatch.setattr(context_parallel, "TILE_KEYS", 16)
    monkeypatch.setattr(context_parallel, "TILE_ROWS", 4)
    from loomserve.execution.attention import select_backend
    torch.manual_seed(interleave)
    size, block, heads, kvh, hd = 2, 8, 4, 2, 16
    length = 37  # a decode at position 36; the chunk covers positions 30..36
    k, v = torch.randn(length, kvh, hd), torch.randn(length, kvh, hd)
    q = torch.randn(1, heads, hd)
    qc = torch.randn(7, heads, hd)
    table = [5, 2, 7, 0, 3]  # scheduler blocks of 8 tokens
    tab = np.asarray(table, dtype=np.int32)
    cpu = select_backend("cpu_paged", torch.device("cpu"), torch.float32)
    dec_k, dec_t, pre = [], [], []
    for r in range(size):
        lay = DcpLayout(r, size, block, interleave)
        kc, vc = _scatter(k, v, lay, table, 8)
        meta = _rank_meta(lay, length, tab)
        dec_k.append(cpu.decode_lse(q, kc, vc, meta, 0.3, heads // kvh))
        dec_t.append(decode_partial(q, kc, vc, meta, 0.3, heads // kvh))
        chunk = PrefillChunk(0, 7, 30, tab)
        pre.append(prefill_partial(qc, kc, vc, meta, chunk, lay, 0.3, heads // kvh, flash))
    want = _full(q, k, v, 0.3)
    for parts in (dec_k, dec_t):
        out, _ = merge_partials(torch.stack([o for o, _ in parts]),
                                torch.stack([s for _, s in parts]))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    out, _ = merge_partials(torch.stack([o for o, _ in pre]), torch.stack([s for _, s in pre]))
    torch.testing.assert_close(out, _full(qc, k, v, 0.3, torch.arange(30, 37)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleave,flash", [(1, True), (2, False)])
def test_windowed_rank_partials_merge_to_windowed_attention(interleave, flash, monkeypatch):
    """A sliding window of 10 (Mistral's layers): the decode row and the chunk's rows see only
    keys within it by global position; merged across ranks, windowed full attention."""
    from loomserve.execution.parallel import context_parallel
    monkeypatch.setattr(context_parallel, "TILE_KEYS", 8)
    torch.manual_seed(3 + interleave)
    size, block, heads, kvh, hd, w = 2, 8, 4, 2, 16, 10
    length = 37
    k, v = torch.randn(length, kvh, hd), torch.randn(length, kvh, hd)
    q, qc = torch.randn(1, heads, hd), torch.randn(7, heads, hd)
    table = [5, 2, 7, 0, 3]
    tab = np.asarray(table, dtype=np.int32)
    dec, pre = [], []
    for r in range(size):
        lay = DcpLayout(r, size, block, interleave)
        kc, vc = _scatter(k, v, lay, table, 8)
        meta = _rank_meta(lay, length, tab, w)
        dec.append(decode_partial(q, kc, vc, meta, 0.3, heads // kvh, lay))
        pre.append(prefill_partial(qc, kc, vc, meta, PrefillChunk(0, 7, 30, tab), lay, 0.3,
                                   heads // kvh, flash))
    for parts, qq, pos in ((dec, q, torch.tensor([36])), (pre, qc, torch.arange(30, 37))):
        out, _ = merge_partials(torch.stack([o for o, _ in parts]),
                                torch.stack([s for _, s in parts]))
        torch.testing.assert_close(out, _full(qq, k, v, 0.3, pos, w), rtol=1e-5, atol=1e-5)


def test_a_rank_without_keys_gives_an_empty_partial():
    """A decode whose only keys live on the other rank: out 0, lse -inf (the kernel path)."""
    from loomserve.execution.attention import select_backend
    cpu = select_backend("cpu_paged", torch.device("cpu"), torch.float32)
    kc = torch.randn(2, 4, 1, 16)
    meta = AttentionMetadata(torch.empty(0), torch.empty(0), 4, None, num_decode=1,
                             decode_lens=np.array([0], dtype=np.int32),
                             decode_tables=[np.array([1], dtype=np.int32)])
    out, lse = cpu.decode_lse(torch.randn(1, 2, 16), kc, kc.clone(), meta, 0.25, 2)
    assert torch.equal(out, torch.zeros(1, 2, 16)) and torch.isinf(lse).all()


# --- configuration --------------------------------------------------------------------------

def test_unsupported_combinations_fail_at_start():
    from loomserve.config import ParallelConfig
    with pytest.raises(ValueError, match="tensor-parallel-size 1"):
        ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2)
    assert ParallelConfig(decode_context_parallel_size=2).world_size == 2
    # TP x DCP: the same two ranks split the weights and the KV
    assert ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2).world_size == 2
    from loomserve.config import EngineConfig
    from loomserve.execution.models.llama import LlamaForCausalLM
    from loomserve.execution.parallel.context_parallel import preflight
    with pytest.raises(NotImplementedError, match="MLA models"):
        preflight(EngineConfig.from_kwargs(model=_fixture("tiny-llama"), tensor_parallel_size=2,
                                           decode_context_parallel_size=2), LlamaForCausalLM)
    with pytest.raises(NotImplementedError, match="supports_dcp"):  # a plugin, or a subclass
        preflight(EngineConfig.from_kwargs(model=_fixture("tiny-llama"),
                                           decode_context_parallel_size=2),
                  type("PluginForCausalLM", (LlamaForCausalLM,), {}))


def test_a_block_it_cannot_split_fails_before_any_process_starts():
    from loomserve.config import EngineConfig
    from loomserve.engine.llm import LLM
    from loomserve.execution.models.llama import LlamaForCausalLM
    from loomserve.execution.parallel.context_parallel import preflight
    kw = dict(decode_context_parallel_size=2, block_size=16, dcp_kv_cache_interleave_size=16)
    with pytest.raises(ValueError, match="multiple of"):
        preflight(EngineConfig.from_kwargs(model=_fixture("tiny-llama"), **kw), LlamaForCausalLM)
    with pytest.raises(ValueError, match="multiple of"):  # the engine calls it before its ranks
        LLM(_fixture("tiny-llama"), **kw)


# --- the engine at D = 2 ----------------------------------------------------------------------

def _run(model: str, dcp: int, interleave: int = 1, tp: int = 1, kv_cache_dtype: str = "auto"):
    """Greedy outputs and cached tokens of two prefix-sharing rounds, and the pool's numbers."""
    from loomserve.engine.llm import LLM
    # hybrid page sizing stays off under DCP; off at dcp 1 too, so both runs use 16-token blocks
    llm = LLM(model, decode_context_parallel_size=dcp, kv_cache_memory="2MiB", dtype="float32",
              dcp_kv_cache_interleave_size=interleave, tensor_parallel_size=tp,
              kv_cache_dtype=kv_cache_dtype, max_hybrid_block_size=0)
    try:
        first = llm.generate([SYSTEM + [50, 51], SYSTEM + [60] * 9], GREEDY)
        second = llm.generate([SYSTEM + [70, 71, 72], SYSTEM + [50, 51]], GREEDY)
        r = llm.core.runner
        outs = first + second
        return ([o.token_ids for o in outs], [o.num_cached_tokens for o in outs],
                r.kv_cache_config, r.kv_layout, r.attention)
    finally:
        llm.close()


WINDOWED = ("tiny-mistral-swa", "tiny-gemma3", "tiny-gpt-oss")  # 32-token windows


@pytest.mark.parametrize("name,interleave", [("tiny-llama", 1), ("tiny-llama", 8),
                                             ("tiny-deepseek-v3", 1), ("tiny-qwen3", 1),
                                             ("tiny-mistral-swa", 2), ("tiny-gemma3", 2),
                                             ("tiny-gpt-oss", 2), ("tiny-qwen3-next", 2),
                                             ("tiny-nemotron-h", 2)])
def test_greedy_prefix_hits_and_capacity_match_one_rank(name, interleave):
    """Two processes on gloo against one rank. Interleave 1: tokens alternate between the
    ranks; 8: each rank holds one half of every 16-token block. DeepSeek-V3: MLA's latent
    rows split by token. Qwen3; Mistral, Gemma 3 (windowed and full layers) and gpt-oss (its
    sinks and MoE too), whose prompts and outputs run past their windows; Qwen3-Next and
    Nemotron-H, whose linear-state / Mamba layers run replicated on every rank (their state is
    not split)."""
    model = _fixture(name)
    tokens1, cached1, view1, pool1, _ = _run(model, 1)
    tokens2, cached2, view2, pool2, attn = _run(model, 2, interleave)
    assert tokens2 == tokens1
    assert cached2 == cached1 and cached1[2] >= 32 and cached1[3] >= 32  # the hits happened
    assert attn.gathered_bytes > 0
    assert view2.block_size == 16 and pool2.block_size == 8
    if name in ("tiny-qwen3-next", "tiny-nemotron-h"):
        # the page holds a whole state per rank, which outweighs half a block's attention
        # here: no capacity gain on this fixture (the attention share of the page halves)
        attn_bytes = [g.bytes_per_block() for p in (pool1, pool2) for g in p.groups
                      if type(g.spec).__name__ == "FullAttentionSpec"]
        assert attn_bytes[1] * 2 == attn_bytes[0] and view2.num_blocks >= view1.num_blocks
        return
    # a rank's page holds half of each block's tokens: the same budget plans twice the blocks
    assert pool2.page_bytes * 2 == pool1.page_bytes
    assert view2.num_blocks == 2 * view1.num_blocks
    null = int(name in WINDOWED)  # a sliding-window pool reserves a null block
    assert view2.capacity_tokens == 2 * view1.capacity_tokens + null * 16
    assert pool2.capacity_tokens == view1.capacity_tokens + null * 8  # one rank's share
    if name == "tiny-llama":  # (MLA runs its own partials, layers/mla.py)
        assert attn.calls["decode_kernel"] > 0 and attn.calls["prefill"] > 0
    if null:  # windowed decodes take the torch partial
        assert attn.calls["decode_torch"] > 0


@pytest.mark.parametrize("name,kvd", [("tiny-llama", "bfloat16"), ("tiny-deepseek-v3", "bfloat16"),
                                      ("tiny-llama", "fp8_e4m3")])
def test_a_narrow_kv_cache_splits_across_ranks_as_on_one(name, kvd):
    """--kv-cache-dtype bfloat16 / fp8_e4m3 under DCP: each rank rounds and reads its share of
    the rows (MLA: its latent rows) as one rank does: the same greedy tokens and hits, each
    rank's pages half of one rank's."""
    model = _fixture(name)
    tokens1, cached1, _, pool1, _ = _run(model, 1, kv_cache_dtype=kvd)
    tokens2, cached2, _, pool2, _ = _run(model, 2, kv_cache_dtype=kvd)
    assert tokens2 == tokens1 and cached2 == cached1
    dtype = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[kvd]
    assert all(g.spec.dtype == dtype for g in pool2.groups)
    assert pool2.page_bytes * 2 == pool1.page_bytes


def test_tp_x_dcp_mla_matches_one_rank_and_tp_alone():
    """-tp 2 -dcp 2 on the MLA fixture: the two ranks split the heads (TP) and the latent rows
    by token (DCP): greedy tokens and cached_tokens equal one rank's, and the pool holds twice
    the tokens of -tp 2 alone (whose latent cache is replicated per rank)."""
    model = _fixture("tiny-deepseek-v3")
    tokens1, cached1, view1, _, _ = _run(model, 1)
    tokens_tp, _, view_tp, _, _ = _run(model, 1, tp=2)
    tokens2, cached2, view2, pool2, attn = _run(model, 2, 1, tp=2)
    assert tokens2 == tokens1 == tokens_tp
    assert cached2 == cached1 and cached1[2] >= 32 and cached1[3] >= 32
    assert attn.gathered_bytes > 0 and pool2.block_size == 8
    assert view_tp.capacity_tokens == view1.capacity_tokens  # TP alone: latent replicated
    assert view2.capacity_tokens == 2 * view1.capacity_tokens


def test_mla_rank_partials_merge_to_the_single_rank_layer():
    """MLA: each rank's absorbed-decode partial (latent space) and decompressed-prefill partial
    over its latent rows, merged (decodes then through W_UV): the layer's own one-rank paths."""
    from loomserve.execution.layers.mla import MultiHeadLatentAttention
    torch.manual_seed(3)
    block, heads, rank, nope, rope, vd = 8, 4, 16, 8, 8, 8
    layer = MultiHeadLatentAttention(32, heads, None, rank, nope, rope, vd, False, 0.3)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    length, table = 29, [3, 0, 6, 1]
    tab = np.asarray(table, dtype=np.int32)
    latent = torch.randn(length, rank + rope)
    q_nope, q_pe = torch.randn(6, heads, nope), torch.randn(6, heads, rope)
    full = torch.randn(8, block, rank + rope)
    pos = np.arange(length)
    full[torch.tensor([table[p // block] for p in pos]), torch.from_numpy(pos % block)] = latent
    layer.latent_cache = full
    meta = AttentionMetadata(torch.empty(0), torch.empty(0), block, None, num_decode=1,
                             decode_lens=np.array([length], dtype=np.int32), decode_tables=[tab])
    chunk = PrefillChunk(1, 6, length - 5, tab)  # rows 1..5: positions 24..28
    want_dec = layer._decode(q_nope[:1], q_pe[:1], meta)
    want_pre = layer._prefill(q_nope[1:], q_pe[1:], latent[-5:], chunk, meta)
    dec, pre = [], []
    for r in range(2):
        lay = DcpLayout(r, 2, block)
        local = torch.randn(8, lay.local_block_size, rank + rope)
        mine = pos[lay.owner(pos) == r]
        local[torch.tensor([table[p // block] for p in mine]),
              torch.from_numpy(lay.local_slot(mine))] = latent[mine]
        layer.latent_cache = local
        m = AttentionMetadata(torch.empty(0), torch.empty(0), lay.local_block_size, None,
                              num_decode=1, decode_lens=lay.local_count([length]).astype(np.int32),
                              decode_tables=[tab])
        dec.append(layer._dcp_decode_partial(q_nope[:1], q_pe[:1], m))
        pre.append(layer._dcp_prefill_partial(q_nope[1:], q_pe[1:], chunk, m, lay))
    o_lat, _ = merge_partials(torch.stack([o for o, _ in dec]), torch.stack([s for _, s in dec]))
    _, w_uv_t = layer.kv_b_proj.absorbed()
    got_dec = torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)
    torch.testing.assert_close(got_dec, want_dec, rtol=1e-4, atol=1e-5)
    pre_t = torch.stack(pre)
    got_pre, _ = merge_partials(pre_t[..., :-1], pre_t[..., -1])
    torch.testing.assert_close(got_pre, want_pre, rtol=1e-4, atol=1e-5)
