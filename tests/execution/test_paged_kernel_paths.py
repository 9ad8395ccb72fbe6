"""The CPU decode kernel's vector paths and prefetch placement (kernels/paged_attention.c).

Groups of more than 4 query rows per kv head take the AVX-512 path where the build has it;
every case also runs forced onto the AVX2 and portable paths, and each must equal the dense
reference. Prefetching never changes a result; the backend tells the kernel whether a step's
keys stream from DRAM from their bytes against the last-level cache (capped).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loomserve.execution import kernels
from loomserve.execution.attention import select_backend
from loomserve.execution.attention.cpu_backend import load_library
from tests.execution.test_paged_attention import CPU, run_case

AVX512 = {"avx512f", "avx512dq"} <= set(kernels.cpu_flags().split())
AVX2 = {"avx2", "fma"} <= set(kernels.cpu_flags().split())


@pytest.fixture
def lib():
    lib = load_library()
    assert lib is not None
    yield lib
    lib.paged_decode_set_isa(2)
    lib.paged_decode_set_prefetch(0)
    lib.paged_decode_set_runs(1)


@pytest.mark.parametrize("group,head_dim,window", [(5, 16, None), (8, 32, 40), (16, 64, None),
                                                   (6, 128, None), (24, 32, 300), (64, 16, None)])
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                            (torch.float32, torch.bfloat16),
                                            (torch.float32, torch.float16),
                                            (torch.float32, torch.float8_e4m3fn),
                                            (torch.float32, torch.float8_e5m2)],
                         ids=["fp32", "bf16", "fp32-bf16kv", "fp32-fp16kv", "fp32-e4m3kv",
                              "fp32-e5m2kv"])
def test_every_vector_path_equals_the_reference(lib, group, head_dim, window, dtype, kv_dtype):
    """Padded groups (5, 6, 24 -> batches of 8 / 16 lanes), batches of 16 heads (24, 64),
    windows, sinks, contexts over many chunks and splits, odd key counts per chunk; fp32, bf16,
    and bf16, fp16 or fp8 rows under fp32 queries (--kv-cache-dtype: fp32 math, so fp32 accuracy)."""
    sinks = torch.randn(2 * group, generator=torch.Generator().manual_seed(group))
    paths = set()
    for cap in (2, 1, 0):
        lib.paged_decode_set_isa(cap)
        paths.add(lib.paged_decode_path(head_dim, group))
        backend = select_backend("cpu_paged", CPU, dtype)
        ours, ref = run_case(backend, [(700, 1), (37, 1), (1500, 1)], 16, 2, group, head_dim,
                             window, sinks if cap != 1 else None, dtype, seed=group + head_dim,
                             kv_dtype=kv_dtype)
        tol = 3e-2 if dtype == torch.bfloat16 else 2e-5
        torch.testing.assert_close(ours.double(), ref, atol=tol, rtol=tol)
        assert backend.calls["decode_kernel"] == 1 and backend.calls["decode_fallback"] == 0
    assert paths == {0} | ({1} if AVX2 else set()) | ({2} if AVX512 and AVX2 else set())


@pytest.mark.parametrize("kv_heads,group,head_dim", [(10, 16, 128), (3, 3, 64), (4, 1, 32)])
@pytest.mark.parametrize("bf16", [False, True])
def test_a_task_over_many_kv_heads_equals_the_reference(lib, kv_heads, group, head_dim, bf16):
    """A task walks its split once for every kv head (paged_attention.c's run_task): MHA,
    SmolLM2's 3 kv heads x 3, and 10 kv heads x 16 rows x head_dim 128, whose packed queries
    overflow one pass of the AVX-512 path (QBUF_BYTES: two passes over the split)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    for cap in (2, 1, 0):
        lib.paged_decode_set_isa(cap)
        backend = select_backend("cpu_paged", CPU, dtype)
        ours, ref = run_case(backend, [(300, 1), (45, 1), (900, 1)], 16, kv_heads, group,
                             head_dim, None, None, dtype, seed=kv_heads + group)
        tol = 3e-2 if bf16 else 2e-5
        torch.testing.assert_close(ours.double(), ref, atol=tol, rtol=tol)
        assert backend.calls["decode_kernel"] == 1 and backend.calls["decode_fallback"] == 0


def test_groups_of_four_or_less_stay_on_avx2(lib):
    """At <= 4 query rows per kv head the read, not the arithmetic, sets the speed (see
    paged_decode_path): the AVX-512 path is not taken."""
    assert lib.paged_decode_path(32, 4) == (1 if AVX2 else 0)
    assert lib.paged_decode_path(40, 8) == (1 if AVX2 else 0)  # not a multiple of 16
    assert lib.paged_decode_path(12, 8) == 0


@pytest.mark.parametrize("group", [4, 8])
def test_prefetch_placement_gives_the_same_bits(lib, group):
    """Keys from the cache or from DRAM (prefetches into L1 or L2), same bits."""
    outs = []
    for from_dram in (0, 1, 0):
        backend = select_backend("cpu_paged", CPU, torch.float32)
        backend.kv_bytes_per_token, backend.resident_bytes = 512, 0 if from_dram else 1 << 40
        outs.append(run_case(backend, [(3000, 1), (90, 1)], 16, 1, group, 32, None, None,
                             torch.float32, seed=5)[0])
        assert backend._from_dram == from_dram
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_keys_from_dram_follows_the_steps_kv_bytes(lib):
    """From the cache while the step's keys fit in resident_bytes, from DRAM past it."""
    backend = select_backend("cpu_paged", CPU, torch.float32)
    backend.kv_bytes_per_token, backend.resident_bytes = 512, 512 * 1000
    run_case(backend, [(900, 1)], 16, 1, 4, 32, None, None, torch.float32, seed=1)
    assert backend._from_dram == 0
    run_case(backend, [(900, 1), (200, 1)], 16, 1, 4, 32, None, None, torch.float32, seed=1)
    assert backend._from_dram == 1


def test_resident_bytes_are_half_the_capped_llc(lib):
    from loomserve.execution.attention.cpu_backend import RESIDENT_CAP, CpuPagedBackend
    assert CpuPagedBackend(lib).resident_bytes == min(kernels.llc_bytes(), RESIDENT_CAP) // 2


def test_llc_is_the_largest_cache_sysfs_lists():
    import glob
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = open(path).read().strip()
        sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM"
                     else int(text))
    assert kernels.llc_bytes() == (max(sizes) if sizes else 32 << 20)


def test_the_runner_gives_the_backend_its_kv_bytes_per_token():
    """What _set_prefetch multiplies by a step's key count: every layer's K and V of a token."""
    from tests.execution.test_decode_stack import FIXTURES, drive, runner
    r = runner(str(FIXTURES / "tiny-llama"), "none", True)
    cfg = r.model.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert r.attention.kv_bytes_per_token == per_token
    drive(r, [list(range(5, 30))], 3)
    assert r.attention._from_dram == 0  # a few KB of keys: resident


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_result_does_not_depend_on_its_batch(threads):
    """Batch invariance: a decode row gives the same bits alone as beside other rows (the rows
    of a verified draft, other requests' rows), at any thread count: each row's split of its
    context follows from its own key count only (paged_attention.c row_split). Before, the
    split followed the batch size and the threads, and greedy speculative decoding drifted
    from plain decoding at near-ties."""
    from loomserve.execution.attention import build_metadata, paged_attention, select_backend

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        bs, kvh, group, hd, n = 16, 2, 4, 32, 3000
        nb = (n + 8 + bs - 1) // bs
        pages = torch.randn(2 * nb, 2, bs, kvh, hd, generator=g)
        tables = [np.arange(nb, dtype=np.int32), np.arange(nb, 2 * nb, dtype=np.int32)]
        q = torch.randn(7, kvh * group, hd, generator=g)
        backend = select_backend("cpu_paged", CPU, torch.float32)

        def run(rows):  # rows: (table index, position); returns the attention of every row
            meta, _ = build_metadata([(p, tables[t]) for t, p in rows], [], bs, CPU,
                                     torch.float32, backend)
            at = [(int(tables[t][p // bs]), p % bs) for t, p in rows]
            k = torch.stack([pages[b, 0, o] for b, o in at])  # the rows' own keys and values,
            v = torch.stack([pages[b, 1, o] for b, o in at])  # as already stored
            return paged_attention(q[:len(rows)], k, v, pages[:, 0], pages[:, 1], meta,
                                   hd ** -0.5, None)

        alone = run([(0, n - 1)])[0]  # query q[0]
        q[4] = q[1] = q[0]  # the same query as row 4 of a draft-shaped batch, row 1 beside
        drafts = run([(0, n - 5), (0, n - 4), (0, n - 3), (0, n - 2), (0, n - 1), (1, 40)])
        assert torch.equal(drafts[4], alone)
        assert torch.equal(run([(1, 700), (0, n - 1)])[1], alone)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("head_dim,kv_dtype", [(64, torch.float32), (32, torch.bfloat16),
                                               (128, torch.float16), (64, torch.float8_e4m3fn)],
                         ids=["fp32-64", "bf16-32", "fp16-128", "e4m3-64"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_drafts_rows_read_together_give_each_rows_bits_alone(lib, head_dim, kv_dtype, threads):
    """A verified request's 1 + d rows (one sequence, consecutive positions) run as one task
    per split that reads each K/V row once for all of them (paged_attention.c continues_run);
    every row must still give the bits it gives alone: ends inside a block, on a block's end,
    across a split's end (some rows have keys in the last split, some none), a run beside
    other sequences, a run longer than MAX_RUN, and rows whose splits differ (past 16 x 256
    keys), which do not share a task."""
    from loomserve.execution.attention import build_metadata, paged_attention

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(head_dim)
        bs, kvh, group = 16, 3, 3
        nb = 4200 // bs + 2
        pages = torch.randn(nb, 2, bs, kvh, head_dim, generator=g).to(kv_dtype)
        table = np.random.default_rng(head_dim).permutation(nb).astype(np.int32)
        other = np.arange(nb, dtype=np.int32)
        q = torch.randn(24, kvh * group, head_dim, generator=g)
        backend = select_backend("cpu_paged", CPU, torch.float32)

        def run(rows):  # rows: (table, position); the attention of each row, q[i] for row i
            meta, _ = build_metadata([(p, t) for t, p in rows], [], bs, CPU, torch.float32,
                                     backend)
            at = [(int(t[p // bs]), p % bs) for t, p in rows]
            k = torch.stack([pages[b, 0, o] for b, o in at])
            v = torch.stack([pages[b, 1, o] for b, o in at])
            return paged_attention(q[:len(rows)], k, v, pages[:, 0], pages[:, 1], meta,
                                   head_dim ** -0.5, None)

        for first, d in [(253, 4), (507, 8), (40, 20), (4090, 6)]:
            rows = [(other, 77)] + [(table, first + j) for j in range(d + 1)] + [(other, 300)]
            together = run(rows)
            lib.paged_decode_set_runs(0)  # every row its own task (LOOMSERVE_DECODE_RUNS=0)
            assert torch.equal(run(rows), together)
            lib.paged_decode_set_runs(1)
            for i, row in enumerate(rows):
                saved = q[0].clone()
                q[0] = q[i]
                alone = run([row])[0]
                q[0] = saved
                assert torch.equal(together[i], alone), (first, d, i)
    finally:
        torch.set_num_threads(before)
