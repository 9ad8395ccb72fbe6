"""The Triton backend (CUDA's default) against the dense reference.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports triton), so CI checks the same kernel code the GPU
compiles (test_triton_compile.py compiles it for sm_90); where CUDA is present they run
compiled on the GPU (benchmarks/gpu_check.py runs this file there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from loomserve.execution.attention import (  # noqa: E402
    build_metadata,
    select_backend,
    triton_backend,  # noqa: E402
)
from tests.execution.test_paged_attention import run_case  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def tolerance(dtype: torch.dtype) -> float:
    return 3e-2 if dtype == torch.bfloat16 else 2e-5


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 12)), min_size=1, max_size=4),
       block_size=st.sampled_from([1, 4, 16, 32]), kv_heads=st.integers(1, 3),
       group=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([8, 12, 32]),
       window=st.sampled_from([None, 5, 40]), with_sinks=st.booleans(), bf16=st.booleans(),
       seed=st.integers(0, 1000))
def test_triton_matches_reference(seqs, block_size, kv_heads, group, head_dim, window,
                                  with_sinks, bf16, seed):
    """Random block tables over garbage-filled pools, mixed decodes and fresh/continued chunks,
    GQA, windows, sinks, odd head dims, both dtypes."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    backend = select_backend("triton", DEVICE, dtype)
    assert backend.name == "triton"
    sinks = torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(seed)) \
        if with_sinks else None
    ours, ref = run_case(backend, seqs, block_size, kv_heads, group, head_dim, window, sinks,
                         dtype, seed, DEVICE)
    tol = tolerance(dtype)
    torch.testing.assert_close(ours.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.float32),
                                             (torch.float32, torch.float8_e4m3fn),
                                             (torch.bfloat16, torch.float8_e5m2)])
def test_triton_kv_cache_dtype_other_than_the_model(dtype, kv_dtype):
    """--kv-cache-dtype narrower (or wider) than the queries: the kernels widen what they load
    to the queries' dtype (8-bit floats by bits, from uint8 views); values both dtypes hold give
    the reference to the queries' accuracy."""
    backend = select_backend("triton", DEVICE, dtype)
    seqs = [(70, 1), (33, 1), (0, 9), (40, 6)]
    ours, ref = run_case(backend, seqs, 16, 2, 2, 32, None, None, dtype, 11, DEVICE, kv_dtype)
    tol = tolerance(dtype)
    torch.testing.assert_close(ours.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_long_contexts_split_and_merge(dtype, monkeypatch):
    """Contexts over many splits (MIN_SPLIT_KEYS lowered so the interpreter stays quick; each
    decode divides its own keys: 1500 into many, 300 into fewer, 1 into one), a long chunk
    over many query tiles, head_dim 64 with GQA 4."""
    monkeypatch.setattr(triton_backend, "MIN_SPLIT_KEYS", 64)
    backend = select_backend("triton", DEVICE, dtype)
    seqs = [(1500, 1), (300, 1), (1, 1), (700, 70)]
    ours, ref = run_case(backend, seqs, 16, 2, 4, 64, None, None, dtype, 3, DEVICE)
    tol = tolerance(dtype)
    torch.testing.assert_close(ours.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window,with_sinks", [(None, True), (300, False), (None, False)])
def test_triton_short_chunks_over_long_contexts_split(window, with_sinks, monkeypatch):
    """A warm turn's short tail over a long cached prefix: few query tiles, so the context is
    split over programs (the plan says how many) and the partials merged, the sink once."""
    monkeypatch.setattr(triton_backend, "MIN_SPLIT_KEYS", 64)
    backend = select_backend("triton", DEVICE, torch.float32)
    backend.programs = 64
    seqs = [(1200, 3), (500, 2), (900, 1)]
    meta, _ = build_metadata([], [(1200, 3, np.arange(76, dtype=np.int32))], 16, DEVICE,
                             torch.float32, backend, window)
    assert backend._prefill_plan(meta, 16, 2)[2] > 1
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)) if with_sinks else None
    ours, ref = run_case(backend, seqs, 16, 2, 4, 32, window, sinks, torch.float32, 9, DEVICE)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=2e-5)


def test_triton_decode_plan_splits_to_fill_the_device():
    """One decode at a long context splits its keys over many programs; 64 decodes x 8 kv
    heads fill the device without splitting; a short context is not split below
    MIN_SPLIT_KEYS; the table is padded once per step and shared by the layers
    (meta.derived)."""
    backend = triton_backend.TritonBackend(DEVICE)
    backend.programs = 264  # an H200's 132 multiprocessors x 2
    one, _ = build_metadata([(131_071, np.arange(8192, dtype=np.int32))], [], 16, DEVICE,
                            torch.bfloat16, backend)
    table, lens, splits = backend._decode_plan(one, kv_heads=1)
    assert splits == triton_backend.MAX_SPLITS
    assert backend._decode_plan(one, kv_heads=1)[0] is table
    many, _ = build_metadata([(32_000, np.arange(2001, dtype=np.int32))] * 64, [], 16, DEVICE,
                             torch.bfloat16, backend)
    table, lens, splits = backend._decode_plan(many, kv_heads=8)
    assert splits == 1 and tuple(table.shape) == (64, 2001) and lens.tolist() == [32_001] * 64
    short, _ = build_metadata([(300, np.arange(19, dtype=np.int32))], [], 16, DEVICE,
                              torch.bfloat16, backend)
    assert backend._decode_plan(short, kv_heads=1)[2] == 2


def _session(name: str, backend: str) -> tuple[list[list[int]], list[int]]:
    """Two agents' turns over a shared prefix through the whole engine: chunked prefills
    (16-token cap, 4-token blocks) crossing the fixtures' windows, decodes, then turn 2 hitting
    the prefix cache. Returns every output and turn 2's cached tokens."""
    from loomserve import LLM, SamplingParams
    from tests.execution.models.conftest import FIXTURES

    llm = LLM(str(FIXTURES / name), dtype="float32", device=str(DEVICE), block_size=4,
              kv_cache_memory="2MB", attention_backend=backend, max_num_batched_tokens=24,
              long_prefill_threshold=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 400, (44,), generator=g).tolist()
    first = [system + torch.randint(3, 400, (n,), generator=g).tolist() for n in (9, 14)]
    outs = [o.token_ids for o in llm.generate(first, greedy)]
    second = [p + o + [7, 8, 9] for p, o in zip(first, outs)]
    res = llm.generate(second, greedy)
    assert llm.core.runner.attention.name == backend
    llm.close()
    return outs + [o.token_ids for o in res], [o.num_cached_tokens for o in res]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral-swa", "tiny-gpt-oss",
                                  "tiny-gemma3", "tiny-qwen3-next"])
def test_engine_greedy_equals_the_torch_backend(name):
    """Dense, sliding-window (Mistral, Gemma 3), sinks + alternating windows (gpt-oss) and the
    hybrid (Qwen3-Next): the same greedy tokens as the gather + SDPA reference, warm turns
    served from the prefix cache."""
    ours, cached = _session(name, "triton")
    ref, _ = _session(name, "torch")
    assert ours == ref
    assert min(cached) >= 40


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-gpt-oss"])
def test_decode_graph_path_equals_the_plain_path(name):
    """--cuda-graphs' static-buffer path (on a CPU its eager stand-in: the same buffers, the
    padded batch sizes, the scratch page, the kernel's own splits): four streams that finish
    at different lengths, so steps run 4, 3, 2, 1 decodes padded to captured sizes, and a turn
    that comes back warm; the same greedy tokens as without it."""
    from loomserve import LLM, SamplingParams
    from tests.execution.models.conftest import FIXTURES

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (30, 9, 17, 44)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
              for n in (3, 5, 7, 9)]
    outs = {}
    for graphs in (False, True):
        llm = LLM(str(FIXTURES / name), dtype="float32", device=str(DEVICE), block_size=4,
                  kv_cache_memory="2MB", attention_backend="triton", cuda_graphs=graphs,
                  max_num_seqs=6)
        runner = llm.core.runner
        assert (runner.graphs is not None) == graphs
        if graphs:
            assert runner.graphs.sizes == [1, 2, 4, 6]
            assert runner.pool.pages.shape[0] == runner.kv_cache_config.num_blocks + 1
        res = llm.generate(prompts, params)
        first = [o.token_ids for o in res]
        again = llm.generate([prompts[3] + first[3] + [5, 6]], params[1])[0]
        # logprobs: a stray write moves them even where a tiny model's argmax does not flip
        outs[graphs] = (first, again.token_ids, again.num_cached_tokens,
                        [lp for o in res + [again] for lp in o.logprobs])
        if graphs:  # 4 then 3 decodes replay size 4, 2 size 2, 1 (and the warm turn) size 1
            used = runner.graphs.replayed
            assert used[4] >= 2 and used[2] >= 1 and used[1] >= 2 and used[6] == 0
        llm.close()
    assert outs[True][:3] == outs[False][:3]
    assert outs[True][2] >= 40
    for (got, top), (want, want_top) in zip(outs[True][3], outs[False][3]):
        assert got == pytest.approx(want, abs=1e-5)
        assert [t for t, _ in top] == [t for t, _ in want_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-5)


def test_decode_graphs_decline_what_they_cannot_capture(caplog):
    """A hybrid model (linear-state layers) and a non-triton backend: --cuda-graphs says why in
    a warning and the engine runs eagerly."""
    from loomserve import LLM, SamplingParams
    from tests.execution.models.conftest import FIXTURES

    for name, backend in (("tiny-qwen3-next", "triton"), ("tiny-llama", "torch")):
        llm = LLM(str(FIXTURES / name), dtype="float32", device=str(DEVICE), block_size=4,
                  kv_cache_memory="2MB", attention_backend=backend, cuda_graphs=True)
        assert llm.core.runner.graphs is None
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3))[0]
        assert len(out.token_ids) == 3
        llm.close()
    assert caplog.text.count("--cuda-graphs: not used") == 2
