"""The attention backends against a dense reference written from the definition.

Property tests draw random block tables (blocks scattered over a pool whose other pages hold
garbage), block sizes, head shapes (head_dim multiple of 8 or not: the kernel's vector and
scalar paths), windows, sinks, dtypes, and batches mixing decodes with fresh and continued
prefill chunks; every backend must give the reference's output.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loomserve.execution.attention import (
    BlockTables,
    build_metadata,
    paged_attention,
    select_backend,
    tables_from_lists,
)

CPU = torch.device("cpu")
NARROW_KV = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def reference(q, keys, values, positions, window, scale, sinks):
    """Per query row: softmax over keys 0..p (p - W + 1 .. p with a window) [+ sink]."""
    heads, kv_heads = q.shape[1], keys[0].shape[1]
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, (seq, p) in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        k = keys[seq][lo:p + 1].double().repeat_interleave(group, 1)  # [keys, heads, hd]
        v = values[seq][lo:p + 1].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", q[r].double(), k) * scale
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], dim=1)
        pr = torch.softmax(s, dim=1)[:, :k.shape[0]]
        out[r] = torch.einsum("hk,khd->hd", pr, v)
    return out


def run_case(backend, seqs, block_size, kv_heads, group, head_dim, window, sinks, dtype, seed,
             device=CPU, kv_dtype=None):
    """seqs: (context_before, new_tokens) per seq; new_tokens == 1 with context > 0 is a decode.
    Returns (ours, reference) outputs for every new token; ours computed on `device`.
    kv_dtype: the pages' dtype (None: dtype); keys and values are drawn representable in both,
    so every path (fresh rows or rows read back from the pages) sees the same values."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    need = sum((c + n + block_size - 1) // block_size for c, n in seqs)
    num_blocks = need + 7
    kv_dtype = kv_dtype or dtype
    pages = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=g)
    pages[pages.abs() > 3.5] = 1e4  # garbage that would show if a stray page were read
    pages = pages.to(kv_dtype)  # (fp8: saturated at 448 / 57344)
    order = torch.randperm(num_blocks, generator=g).tolist()
    keys, values, tables, at = [], [], [], 0
    for c, n in seqs:
        nb = (c + n + block_size - 1) // block_size
        tables.append(order[at:at + nb])
        at += nb
        keys.append(torch.randn(c + n, kv_heads, head_dim, generator=g).to(kv_dtype).to(dtype))
        values.append(torch.randn(c + n, kv_heads, head_dim, generator=g).to(kv_dtype).to(dtype))
        for pos in range(c):  # the cached context, written where the table says
            b, o = tables[-1][pos // block_size], pos % block_size
            pages[b, 0, o], pages[b, 1, o] = keys[-1][pos], values[-1][pos]
    order_idx = sorted(range(len(seqs)), key=lambda i: not (seqs[i][1] == 1 and seqs[i][0] > 0))
    decodes = [(seqs[i][0], tables[i]) for i in order_idx if seqs[i][1] == 1 and seqs[i][0] > 0]
    prefills = [(seqs[i][0], seqs[i][1], tables[i]) for i in order_idx
                if not (seqs[i][1] == 1 and seqs[i][0] > 0)]
    dec_t = tables_from_lists([t for _, t in decodes])
    pre_t = tables_from_lists([t for _, _, t in prefills])
    meta, _ = build_metadata([(p, t) for (p, _), t in zip(decodes, dec_t)],
                             [(s, n, t) for (s, n, _), t in zip(prefills, pre_t)],
                             block_size, device, dtype, backend, window)
    rows = [(i, seqs[i][0] + j) for i in order_idx for j in range(seqs[i][1])]
    q = torch.randn(len(rows), heads, head_dim, generator=g).to(dtype)
    k = torch.stack([keys[i][p] for i, p in rows])
    v = torch.stack([values[i][p] for i, p in rows])
    on = [t.to(device) for t in (q, k, v, pages)] + [None if sinks is None else sinks.to(device)]
    ours = paged_attention(on[0], on[1], on[2], on[3][:, 0], on[3][:, 1], meta, head_dim ** -0.5,
                           on[4])
    return ours.cpu(), reference(q, keys, values, rows, window, head_dim ** -0.5, sinks)


seq_st = st.tuples(st.integers(0, 90), st.integers(1, 12))


@pytest.mark.parametrize("name", ["torch", "cpu_paged"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=st.lists(seq_st, min_size=1, max_size=5), block_size=st.sampled_from([1, 4, 16, 32]),
       kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([8, 12, 32]), window=st.sampled_from([None, 5, 40]),
       with_sinks=st.booleans(), bf16=st.booleans(), seed=st.integers(0, 1000))
def test_backend_matches_reference(name, seqs, block_size, kv_heads, group, head_dim, window,
                                   with_sinks, bf16, seed):
    dtype = torch.bfloat16 if bf16 else torch.float32
    backend = select_backend(name, CPU, dtype)
    assert backend.name == name
    sinks = torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(seed)) if with_sinks else None
    ours, ref = run_case(backend, seqs, block_size, kv_heads, group, head_dim, window, sinks, dtype, seed)
    tol = 3e-2 if bf16 else 2e-5
    torch.testing.assert_close(ours.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["torch", "cpu_paged"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=st.lists(seq_st, min_size=1, max_size=5), block_size=st.sampled_from([1, 4, 16]),
       kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([8, 12, 32]), window=st.sampled_from([None, 5, 40]),
       with_sinks=st.booleans(), kv_dtype=st.sampled_from(NARROW_KV), seed=st.integers(0, 1000))
def test_narrow_kv_cache_under_fp32_queries(name, seqs, block_size, kv_heads, group, head_dim,
                                            window, with_sinks, kv_dtype, seed):
    """--kv-cache-dtype bfloat16, float16, fp8_e4m3 or fp8_e5m2 beside a float32 model: rows
    are written rounded and read widened, so with values the cache dtype can hold, every path
    gives the fp32 reference to fp32 accuracy."""
    backend = select_backend(name, CPU, torch.float32)
    sinks = torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(seed)) if with_sinks else None
    ours, ref = run_case(backend, seqs, block_size, kv_heads, group, head_dim, window, sinks,
                         torch.float32, seed, kv_dtype=kv_dtype)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=2e-5)


def test_bf16_kv_cache_rounds_new_rows_as_torch_does():
    """A float32 row written into a bf16 page is torch's round-to-nearest-even of it."""
    backend = select_backend("cpu_paged", CPU, torch.float32)
    dec = tables_from_lists([[0]])
    meta, _ = build_metadata([(0, dec[0])], [], 4, CPU, torch.float32, backend, None)
    q, k, v = (torch.randn(1, 2, 8, dtype=torch.float32) for _ in range(3))
    pages = torch.zeros(1, 2, 4, 2, 8, dtype=torch.bfloat16)
    paged_attention(q, k, v, pages[:, 0], pages[:, 1], meta, 8 ** -0.5)
    assert torch.equal(pages[0, 0, 0], k[0].to(torch.bfloat16))
    assert torch.equal(pages[0, 1, 0], v[0].to(torch.bfloat16))


def test_cpu_kernel_runs_for_decodes_and_long_contexts():
    """Contexts long enough to split over many tasks, GQA, both dtypes: the C kernel (not the
    fallback) serves the decodes and a short continued chunk's context; a chunk with more
    queries per kv head than CONTEXT_KERNEL_QUERIES (16) takes the gathered tiles."""
    for dtype in (torch.float32, torch.bfloat16):
        backend = select_backend("cpu_paged", CPU, dtype)
        seqs = [(3000, 1), (700, 1), (1, 1), (2500, 4)]
        ours, ref = run_case(backend, seqs, 16, 2, 4, 64, None, None, dtype, 3)
        torch.testing.assert_close(ours.double(), ref, atol=3e-2 if dtype == torch.bfloat16 else 2e-5,
                                   rtol=3e-2 if dtype == torch.bfloat16 else 2e-5)
        assert backend.calls["decode_kernel"] == 1 and backend.calls["decode_fallback"] == 0
        assert backend.calls["prefill_tiled"] == 1
        assert backend.calls["prefill_context_kernel"] == 1  # 4 queries x 4 heads per kv head
        long_chunk = select_backend("cpu_paged", CPU, dtype)
        ours, ref = run_case(long_chunk, [(2500, 5), (900, 3)], 16, 2, 4, 64, None, None, dtype, 4)
        torch.testing.assert_close(ours.double(), ref, atol=3e-2 if dtype == torch.bfloat16 else 2e-5,
                                   rtol=3e-2 if dtype == torch.bfloat16 else 2e-5)
        assert long_chunk.calls["prefill_tiled"] == 2 and long_chunk.calls["prefill_context_kernel"] == 1


@pytest.mark.parametrize("head_dim", [128, 40])
def test_cpu_kernel_wide_and_odd_heads(head_dim):
    """head_dim 128 (the chunked split's accumulators in two passes of 64 lanes) and 40 (a
    multiple of 8 with no specialized copy), chunks crossing blocks and splits."""
    backend = select_backend("cpu_paged", CPU, torch.float32)
    ours, ref = run_case(backend, [(1000, 1), (129, 1), (300, 5)], 16, 2, 2, head_dim, None, None,
                         torch.float32, 7)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=2e-5)
    assert backend.calls["decode_kernel"] == 1


def test_prefill_tiles_cover_long_cached_context(monkeypatch):
    from loomserve.execution.attention import cpu_backend
    monkeypatch.setattr(cpu_backend, "TILE_TOKENS", 48)  # many tiles, edges inside blocks
    backend = select_backend("cpu_paged", CPU, torch.float32)
    ours, ref = run_case(backend, [(301, 17), (0, 30)], 16, 1, 4, 32, None, torch.randn(4), torch.float32, 5)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window, tile", [(2, 512), (40, 512), (64, 16), (300, 512)])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("path", ["tiles", "rows"])
def test_windowed_prefill_runs_maskless(monkeypatch, window, tile, bf16, path):
    """Sliding-window chunks take the kernel's rows or the tiles (not the torch fallback's dense
    mask): fresh prompts longer than the window (clipped at position 0), chunks over a cached
    context, tiles of window - 1 tokens and shorter ones (the all-visible keys between), a sink."""
    from loomserve.execution.attention import cpu_backend
    monkeypatch.setattr(cpu_backend, "WINDOW_TILE", tile)
    monkeypatch.setattr(cpu_backend, "ROWS_WINDOW", {2: 1 << 20, 1: 1 << 20} if path == "rows" else {})
    dtype = torch.bfloat16 if bf16 else torch.float32
    backend = select_backend("cpu_paged", CPU, dtype)
    seqs = [(0, 350), (500, 130), (max(window - 3, 1), 7), (37, 1), (0, 1)]
    ours, ref = run_case(backend, seqs, 16, 2, 4, 32, window, torch.randn(8), dtype, window)
    tol = 3e-2 if bf16 else 2e-5
    torch.testing.assert_close(ours.double(), ref, atol=tol, rtol=tol)
    assert backend.calls["prefill_fallback"] == 0 and backend.calls["prefill_tiled"] == 1
    assert backend.calls["prefill_windowed" if path == "tiles" else "prefill_windowed_rows"] == 3


def test_decode_metadata_does_not_grow_with_context():
    """A decode at a 200K context: the step's metadata holds the runner's table by reference and
    no tensor sized by the context (no padded table, no mask)."""
    backend = select_backend("cpu_paged", CPU, torch.float32)
    tables = BlockTables()
    ids = list(range(200_000 // 16 + 1))
    table = tables.get("r", 0, ids)
    meta, _ = build_metadata([(200_000, table)], [], 16, CPU, torch.float32, backend)
    assert meta.decode_tables[0] is table
    sizes = [v.numel() for v in vars(meta).values() if isinstance(v, torch.Tensor)]
    assert max(sizes) == 1


def test_block_tables_grow_incrementally_and_rebuild_on_new_lists():
    tables = BlockTables()
    ids = [5, 6]
    t1 = tables.get("a", 0, ids)
    ids.extend(range(7, 100))  # the scheduler's list grows in place
    t2 = tables.get("a", 0, ids)
    assert t1.tolist() == [5, 6] and t2.tolist() == ids
    again = tables.get("a", 0, ids)
    assert again.ctypes.data == t2.ctypes.data  # nothing new: same array, nothing copied
    fresh = [9, 8, 7]  # preempted and re-admitted: a new list object, maybe shorter
    assert tables.get("a", 0, fresh).tolist() == fresh
    longer = [1] * 200  # a new list object as long as the old one: still rebuilt
    assert tables.get("a", 0, longer).tolist() == longer
    tables.get("b", 1, [3])
    tables.drop(["a"])
    assert len(tables) == 1
    tables.keep_only(set())
    assert len(tables) == 0


def test_auto_picks_the_kernel_on_cpu_and_torch_elsewhere(monkeypatch):
    assert select_backend("auto", CPU, torch.float32).name == "cpu_paged"
    assert select_backend("auto", CPU, torch.float16).name == "torch"
    monkeypatch.setenv("LOOMSERVE_KERNELS", "0")
    from loomserve.execution import kernels
    monkeypatch.setattr(kernels, "_loaded", {})
    assert select_backend("auto", CPU, torch.float32).name == "torch"
    with pytest.raises(ValueError, match="cpu_paged is unavailable"):
        select_backend("cpu_paged", CPU, torch.float32)
