"""GGUF blocks kept as the file stores them (layers/quant.py's formats, kernels/quant.c): the
K-quants (Q4_K, Q5_K, Q6_K) and Q5_0 / Q5_1 in 5 bits.

- dequantize equals gguf.quants.dequantize bit for bit, and the tiled layout round-trips;
- the kernel's product equals an fp64 product of that weight with the x the kernel multiplies
  (x rounded per 32-block to int8): what is left is fp32 rounding, measured below 1e-7 of
  sum |x||w| per output, checked at 1e-6;
- the portable C path and the AVX2 / VNNI builds agree; the embedding gather is exact;
- a fused module whose parts differ in type runs its row segments in one call;
- off the CPU the weight is unpacked once, never per call; without the kernel torch runs it;
- a real llama-quantize Q4_K_M file (tests/fixtures/gguf-mixes) loads every tensor in place.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from loomserve.execution import kernels
from loomserve.execution.layers import quant
from loomserve.execution.layers.quant import MULTI, QuantEmbedding, QuantLinear, QuantWeight

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]
ALL_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, *K_TYPES]
needs_kernel = pytest.mark.skipif(quant._lib() is None, reason="quant kernel did not build")
MIXES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "gguf-mixes")


def gguf_blocks(qtype, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid GGUF blocks of n rows of k values: gguf.quants.quantize where gguf-py has the type;
    else random bytes (every byte pattern is a valid K-quant block once d and dmin are finite),
    d and dmin of both signs, and Q6_K's int8 scale extremes -128 and 127."""
    rng = np.random.default_rng(seed)
    try:
        return gguf.quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
    except NotImplementedError:
        pass
    b = rng.integers(0, 256, (n * k // 256, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    d = (rng.uniform(-2, 2, (len(b), 2)) * 1e-3).astype(np.float16).view(np.uint8)
    if qtype == T.Q6_K:
        b[:, 208:210] = d[:, :2]
        b[0, 192:194] = [0x80, 0x7F]
    else:
        b[:, 0:4] = d
    return b


def part(qtype, n: int, k: int, seed: int = 0) -> tuple[QuantWeight, np.ndarray]:
    """(the QuantWeight of GGUF blocks, gguf-py's dequantized [n, k])."""
    from loomserve.execution.models.loading.gguf_quant import from_gguf_blocks

    b = gguf_blocks(qtype, n, k, seed)
    return from_gguf_blocks(b, qtype, n, k), gguf.quants.dequantize(b, qtype).reshape(n, k)


def check_product(fn, ref: np.ndarray, rows: int, seed: int = 0, bias=None) -> torch.Tensor:
    """fn(x) against the fp64 product of ref with x rounded as the kernel rounds it."""
    k = ref.shape[1]
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    xb = x.view(rows, k // 32, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127
    xq = (torch.round(xb / dx) * dx).view(rows, k).double()
    w = torch.from_numpy(ref).double()
    want = xq @ w.T + (0 if bias is None else bias.double())
    y = fn(x)
    scale = xq.abs() @ w.abs().T
    assert ((y.double() - want).abs() <= 1e-6 * scale + 1e-6).all(), ((y.double() - want).abs() / scale).max()
    return y


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_blocks_dequantize_exactly_and_tile_roundtrips(qtype):
    for n, k in ((1, 256), (13, 512), (37, 768)):
        w, ref = part(qtype, n, k, seed=n)
        np.testing.assert_array_equal(w.dequantize().numpy(), ref)
        back = QuantWeight.untile(w.tile(), w.fmt, n, w.has_mins)
        for name, t in w._tensors().items():
            assert torch.equal(getattr(back, name), t), (qtype.name, name)


def test_bytes_per_weight():
    """The tiled copy's size beside the file's (Q4_K 4.5, Q5_K 5.5, Q6_K 6.5625 bits): the
    kernel's per-row fp16 d, dmin and byte-wide 6-bit scales add 1/8 bit to Q4_K and Q5_K."""
    bits = {}
    for qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1):
        w, _ = part(qtype, 64, 1024)
        bits[qtype.name] = w.tile().numel() * 8 / (64 * 1024)
    assert bits == {"Q4_K": 4.625, "Q5_K": 5.625, "Q6_K": 6.5625, "Q5_0": 5.5, "Q5_1": 6.0}


@needs_kernel
@pytest.mark.parametrize("qtype", K_TYPES + [T.Q5_0, T.Q5_1], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 32, 70])
def test_kernel_matches_fp64_reference(qtype, rows):
    w, ref = part(qtype, 37, 512)  # a short last tile (37 = 4 x 8 + 5 rows)
    lin = QuantLinear.of(w, torch.randn(37) if rows == 3 else None)
    assert lin.tiled is not None and lin.weight_bytes() == lin.tiled.numel() + (0 if lin.bias is None else 37 * 4)
    check_product(lin, ref, rows, seed=rows, bias=lin.bias)


@needs_kernel
def test_q5_in_five_bits_gives_the_int8_path_outputs():
    """Q5_0 / Q5_1 moved from int8 (8.5 / 9 bits a weight) to 5 bits: same integers, same
    float operations, so every output is bit for bit what the 8-bit layout gave."""
    for qtype in (T.Q5_0, T.Q5_1):
        w, _ = part(qtype, 37, 160)
        five, eight = QuantLinear(w.q, w.scales, w.mins, 5), QuantLinear(w.q, w.scales, w.mins, 8)
        assert five.weight_bytes() < 0.7 * eight.weight_bytes()
        for rows in (1, 5, 40):
            x = torch.randn(rows, 160)
            assert torch.equal(five(x), eight(x))


@needs_kernel
@pytest.mark.parametrize("qtype", K_TYPES + [T.Q5_0], ids=lambda t: t.name)
def test_embedding_gather_is_exact(qtype):
    w, ref = part(qtype, 37, 512)
    emb = QuantEmbedding.of(w)
    ids = torch.tensor([[0, 36], [8, 17]])
    assert torch.equal(emb(ids), torch.from_numpy(ref)[ids])
    check_product(emb.project, ref, 2)


@needs_kernel
def test_mixed_type_fused_module():
    """q|k|v in Q4_K, Q4_K, Q6_K (Q4_K_M's attn_v on some layers) and a legacy mix: one module,
    consecutive parts of one type stacked, the others row segments of one kernel call."""
    for types in ([T.Q4_K, T.Q4_K, T.Q6_K], [T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K, T.Q5_1]):
        parts = [part(t, n, 512, seed=i) for i, (t, n) in enumerate(zip(types, (24, 13, 19, 8, 5)))]
        ref = np.concatenate([r for _, r in parts])
        lin = QuantLinear.of([w for w, _ in parts], torch.randn(len(ref)))
        assert lin.fmt == MULTI and len(lin.segments) == len(types) - (types[0] == types[1])
        np.testing.assert_array_equal(lin.dequantized().numpy(), ref)
        for rows in (1, 33):
            check_product(lin, ref, rows, seed=rows, bias=lin.bias)
        old = torch.get_num_threads()
        torch.set_num_threads(2)
        try:  # threaded: the tiles of every segment split across threads
            check_product(lin, ref, 40, bias=lin.bias)
        finally:
            torch.set_num_threads(old)


def _build(tmp_path, name: str, *flags: str, march: bool = True) -> ctypes.CDLL:
    cc = kernels._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    src = os.path.join(os.path.dirname(kernels.__file__), "quant.c")
    out = str(tmp_path / f"{name}.so")
    cflags = [f for f in kernels.CFLAGS if march or not f.startswith("-march")]
    subprocess.run([cc, *cflags, *flags, "-o", out, src, "-lm"], check=True, capture_output=True)
    return ctypes.CDLL(out)


@needs_kernel
def test_portable_and_vector_builds_agree(tmp_path, monkeypatch):
    """The scalar path (no -march) gives the same products within fp32 rounding; the AVX2 build
    (-DQUANT_NO_VNNI) gives the native one's bit for bit (where the host has AVX-512 VNNI,
    vpdpbusd / vpdpwssd replace maddubs + madd on the same exact integers)."""
    types = [T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1]
    mods = [(QuantLinear.of(w, torch.randn(37)), r) for w, r in (part(t, 37, 512) for t in types)]
    mixed = [part(t, 16, 512, seed=3) for t in (T.Q4_K, T.Q6_K, T.Q8_0)]
    mods.append((QuantLinear.of([w for w, _ in mixed]), np.concatenate([r for _, r in mixed])))
    xs = [torch.randn(rows, 512) for rows in (1, 2, 33)]
    native = [[lin(x) for x in xs] for lin, _ in mods]
    gathered = [QuantEmbedding.of(w)(torch.arange(37)) for w, _ in (part(t, 37, 512) for t in types)]
    for name, lib_flags, march in (("portable", (), False), ("avx2", ("-DQUANT_NO_VNNI",), True)):
        lib = _build(tmp_path, name, *lib_flags, march=march)
        monkeypatch.setattr(quant, "_lib_cache", [])
        monkeypatch.setattr(kernels, "load", lambda _, lib=lib: lib)
        for (lin, ref), want in zip(mods, native):
            for x, y in zip(xs, want):
                got = lin(x)
                if name == "avx2":
                    assert torch.equal(got, y)
                else:
                    assert torch.allclose(got, y, rtol=1e-5, atol=1e-4)
        for (w, ref), want in zip((part(t, 37, 512) for t in types), gathered):
            assert torch.equal(QuantEmbedding.of(w)(torch.arange(37)), want)


def test_kernels_off_torch_path(monkeypatch):
    """With no kernel (LOOMSERVE_KERNELS=0, no compiler) a CPU module keeps its quantized bytes
    and torch dequantizes them per call: the product is the float one on x itself."""
    monkeypatch.setattr(quant, "_lib", lambda: None)
    parts = [part(t, 16, 512, seed=i) for i, t in enumerate((T.Q4_K, T.Q6_K, T.Q5_0))]
    ref = torch.from_numpy(np.concatenate([r for _, r in parts]))
    lin = QuantLinear.of([w for w, _ in parts])
    assert lin.dense is None and lin.weight_bytes() < ref.numel()
    x = torch.randn(3, 512)
    assert torch.allclose(lin(x), F.linear(x, ref), atol=1e-5)
    emb = QuantEmbedding.of(parts[1][0])
    assert torch.equal(emb(torch.tensor([5, 0, 15])), torch.from_numpy(parts[1][1])[[5, 0, 15]])


@needs_kernel
@pytest.mark.parametrize("device", ["meta", "cuda"])
def test_off_the_cpu_the_weight_is_unpacked_once(device, monkeypatch):
    """Moved where the kernel does not run (CUDA; meta stands in without a GPU), every format
    unpacks once into a float weight in the model dtype; forward reads it, nothing per call."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    parts = [part(t, 16, 512, seed=i) for i, t in enumerate((T.Q4_K, T.Q6_K, T.Q5_0))]
    lin = QuantLinear.of([w for w, _ in parts], torch.randn(48), dtype=torch.bfloat16)
    emb = QuantEmbedding.of(parts[1][0], dtype=torch.bfloat16)
    lin.to(device)
    emb.to(device)
    assert lin.tiled is None and lin.dense.dtype == torch.bfloat16 and lin.dense.device.type == device
    monkeypatch.setattr(QuantWeight, "dequantize", lambda *a, **k: pytest.fail("dequantized per call"))
    x = torch.randn(2, 512, dtype=torch.bfloat16)
    y, rows = lin(x.to(device)), emb(torch.tensor([3, 15], device=device))
    assert y.shape == (2, 48) and rows.shape == (2, 512) and y.device.type == device
    if device == "cuda":
        ref = torch.from_numpy(np.concatenate([r for _, r in parts])).to(torch.bfloat16)
        want = F.linear(x.float(), ref.float(), lin.bias.float().cpu())
        assert torch.allclose(y.float().cpu(), want, rtol=0.02, atol=0.02 * want.abs().max().item())
        assert torch.equal(rows.cpu(), torch.from_numpy(parts[1][1])[[3, 15]].to(torch.bfloat16))


@needs_kernel
def test_llama_quantize_q4_k_m_file_runs_in_place(caplog):
    """tiny-llama-Q4_K_M.gguf (llama.cpp's llama-quantize: Q4_K, with Q6_K for the LM head and
    layer 1's attn_v and ffn_down): every tensor runs in place, each module holding the
    dequantized float model's weight exactly, and the logits agree with it."""
    from loomserve.config import EngineConfig
    from loomserve.execution.model_runner import ModelRunner
    from tests.execution.models.conftest import Blocks, logits_of, seq

    path = os.path.join(MIXES, "tiny-llama-Q4_K_M.gguf")
    if not os.path.exists(path):
        pytest.skip("no tests/fixtures/gguf-mixes")

    def runner(mode):
        return ModelRunner(EngineConfig.from_kwargs(model=path, dtype="float32", device="cpu",
                                                    quantization=mode, kv_cache_memory="8MB"))

    with caplog.at_level(logging.INFO, logger="loomserve.execution.models.loading.gguf_quant"):
        q = runner("gguf")
    assert "13 Q4_K, 3 Q6_K (10 modules); 0 linears stay float" in caplog.text
    dense = runner("none")
    layers = dict(dense.model.named_modules())
    qkv = q.model.model.layers[1].self_attn.qkv_proj
    assert qkv.fmt == MULTI and [s[0] for s in qkv.segments] == [quant.Q4_K, quant.Q6_K]
    for name, mod in q.model.named_modules():
        if isinstance(mod, QuantLinear):
            assert torch.equal(mod.dequantized(), layers[name].weight), name
    prompt = list(range(1, 30))
    table = Blocks(q.block_size).cover([], len(prompt))
    a, b = (logits_of(r, [seq("r", prompt, 0, table)])["r"] for r in (dense, q))
    assert (a - b).norm() < 0.05 * a.norm() and a.argmax() == b.argmax()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_product_does_not_depend_on_its_batch(threads):
    """Batch invariance of the product: row i of an M-row call gives the bits it gives alone,
    for every format and M = 1..19 (register blocks of up to 8 rows that share each unpacked
    weight chunk, and their tails; at 2 threads, from 6 rows on, the tiles split over threads
    and x is quantized in parallel past 8 rows), so a verified draft's rows and
    other requests' rows beside it change no row's logits (greedy speculative decoding equals
    plain decoding)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, qtype in enumerate(ALL_TYPES):
            w, _ = part(qtype, 43, 512, seed=i)
            lin = QuantLinear.of(w)
            x = torch.randn(19, 512, generator=torch.Generator().manual_seed(i))
            alone = torch.cat([lin(x[j:j + 1]) for j in range(19)])
            for m in range(2, 20):
                assert torch.equal(lin(x[:m]), alone[:m]), (qtype.name, m)
    finally:
        torch.set_num_threads(old)
