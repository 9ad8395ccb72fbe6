"""The quantized matmul kernel (kernels/quant.c) and its torch fallback against float references.

Tolerance: the kernel rounds each 32-block of x to int8 (dx = max|x|/127), so each output may
differ from (dequantized W) @ x by at most sum_k |w[n,k]| * dx[m, block(k)] / 2 (plus fp32
summation error); the kernel must also match a torch emulation of exactly that arithmetic."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers import quant
from loomserve.execution.layers.quant import (
    QuantEmbedding,
    QuantLinear,
    dequantize,
    pack_int4,
    quantize_weight,
    unpack_int4,
)

needs_kernel = pytest.mark.skipif(quant._lib() is None, reason="quant kernel did not build")


def _emulated(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ w.T with x rounded per 32-block to int8 as the kernel does, the error bound)."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros(()))
    xq = torch.round(xb * inv.unsqueeze(-1)) * d.unsqueeze(-1)
    bound = (w.abs().view(w.shape[0], k // 32, 32).sum(-1) @ (d / 2).T).T
    return xq.view(m, k).double() @ w.double().T, bound


def _linear(n: int, k: int, bits: int, mins: bool, bias: bool, seed: int = 0) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.1
    q, s, m = quantize_weight(w, bits)
    if bits == 8 and mins:  # int8 with mins (GGUF Q5_1 shape): add an offset per group
        m = (torch.randn(n, k // 32, generator=gen) * 0.01).to(torch.float16)
    if bits == 4 and not mins:  # symmetric int4 (GGUF Q4_0 has m = -8 s; here plain s*q)
        m = None
    b = torch.randn(n, generator=gen) if bias else None
    return QuantLinear(q, s, m, bits, b)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 32, 70])
@pytest.mark.parametrize("k", [128, 160])
def test_kernel_matches_float_reference(bits, mins, rows, k):
    n = 37  # a short last tile (37 = 4 x 8 + 5 rows); k=160: an odd group count
    lin = _linear(n, k, bits, mins, bias=rows == 3)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    w = lin.dequantized()
    ref = F.linear(x, w, lin.bias).double()
    emu, bound = _emulated(x, w)
    if lin.bias is not None:
        emu = emu + lin.bias.double()
    y = lin(x).double()
    assert torch.allclose(y, emu, rtol=1e-5, atol=1e-4), (y - emu).abs().max()
    assert ((y - ref).abs() <= bound.double() + 1e-4).all()
    assert (y - ref).abs().max() > 0  # x really went through int8 (else the test is vacuous)


def test_torch_fallback_is_the_dequantized_product(monkeypatch):
    lin = _linear(24, 64, 4, mins=True, bias=True)
    x = torch.randn(5, 64)
    monkeypatch.setattr(quant, "_lib", lambda: None)
    assert torch.allclose(lin(x), F.linear(x, lin.dequantized(), lin.bias), atol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mins", [False, True])
def test_tiled_layout_roundtrips(bits, mins):
    """tile_weight / untile_weight are inverse for any row count (padding included), and the
    tiled block holds the 8 rows' chunks interleaved as the kernel reads them."""
    gen = torch.Generator().manual_seed(bits)
    for n, k in ((1, 32), (8, 64), (13, 96), (37, 160)):
        q, s, m = quantize_weight(torch.randn(n, k, generator=gen), bits)
        m = (torch.randn(n, k // 32, generator=gen) * 0.1).half() if mins else None
        t = quant.tile_weight(q, s, m, bits)
        assert t.shape[:2] == (-(-n // 8), k // 32)
        q2, s2, m2 = quant.untile_weight(t, n, bits, mins)
        assert torch.equal(q2, q) and torch.equal(s2, s) and (m2 is None) == (m is None)
        assert m is None or torch.equal(m2, m)
    # row 1's bytes 4..7 of group 0 sit in chunk 1, second slot of the tile
    assert torch.equal(t[0, 0, 36:40], q.view(torch.uint8)[1, 4:8])


@needs_kernel
def test_module_keeps_only_the_tiled_copy():
    lin = _linear(37, 160, 4, mins=True, bias=False)
    assert lin.tiled is not None and lin.dense is None
    assert lin.weight_bytes() == lin.tiled.numel()
    w = lin.dequantized()
    lin.to("meta")  # off the CPU (as .to("cuda")): unpacked once into a float weight
    assert lin.tiled is None and lin.dense.device.type == "meta" and lin.dense.shape == w.shape


def test_pack_roundtrip_and_nibble_order():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    p = pack_int4(q)
    assert p.shape == (3, 32)
    assert torch.equal(unpack_int4(p), q)
    assert p[1, 5].item() == q[1, 5].item() | (q[1, 21].item() << 4)  # GGUF Q4_0 order


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_weight_error_is_half_a_step(bits):
    w = torch.randn(16, 128)
    q, s, m = quantize_weight(w, bits)
    err = (dequantize(q, s, m, bits) - w).abs().view(16, 4, 32)
    step = s.float().unsqueeze(-1)
    assert (err <= step * 0.5 + 1e-3 * step + 1e-7).all()


def test_embedding_gather_and_tied_projection():
    emb = nn.Embedding(50, 64)
    qe = QuantEmbedding.from_float(emb, 4)
    ids = torch.tensor([[3, 7], [49, 0]])
    table = qe.dequantized()
    assert torch.allclose(qe(ids), table[ids], atol=1e-6)
    h = torch.randn(2, 64)
    assert torch.allclose(qe.project(h), h @ table.T, atol=0.05 * (h @ table.T).abs().max().item())


@needs_kernel
def test_int8_extremes_do_not_saturate():
    # q = -128 and x at +-127: the signed path's maddubs pairs stay below 2^15.
    q = torch.full((4, 64), -128, dtype=torch.int8)
    q[:, 1::2] = 127
    s = torch.ones(4, 2, dtype=torch.float16)
    lin = QuantLinear(q, s, None, 8)
    x = torch.where(torch.arange(64) % 2 == 0, -1.0, 1.0).repeat(2, 1)
    assert torch.equal(lin(x), F.linear(x, lin.dequantized()))
    assert np.isclose(lin(x)[0, 0].item(), 32 * 128 + 32 * 127)


def test_portable_scalar_path(tmp_path, monkeypatch):
    """The C file's non-AVX2 path (built without -march=native) gives the same products."""
    import ctypes
    import os
    import subprocess

    from loomserve.execution import kernels

    cc = kernels._compiler()
    if cc is None:
        pytest.skip("no C compiler")
    src = os.path.join(os.path.dirname(kernels.__file__), "quant.c")
    out = str(tmp_path / "quant_scalar.so")
    flags = [f for f in kernels.CFLAGS if not f.startswith("-march")]
    subprocess.run([cc, *flags, "-o", out, src, "-lm"], check=True, capture_output=True)
    scalar = ctypes.CDLL(out)
    monkeypatch.setattr(quant, "_lib_cache", [])
    monkeypatch.setattr(kernels, "load", lambda name: scalar)
    for bits, mins in ((4, True), (8, False)):
        lin = _linear(13, 96, bits, mins, bias=True)
        for rows in (1, 5):
            x = torch.randn(rows, 96)
            emu, _ = _emulated(x, lin.dequantized())
            assert torch.allclose(lin(x).double(), emu + lin.bias.double(), rtol=1e-5, atol=1e-4)
    ids = torch.tensor([0, 12, 5])
    assert torch.allclose(QuantEmbedding(*lin.parts(), 8)(ids), lin.dequantized()[ids])


@needs_kernel
def test_vnni_build_equals_the_avx2_sequence(tmp_path, monkeypatch):
    """Where the host has AVX-512 VNNI, vpdpbusd replaces maddubs + madd: the int32 sums, so every
    output, must be bit for bit the AVX2 build's (-DQUANT_NO_VNNI); elsewhere both builds match."""
    import ctypes
    import os
    import subprocess

    from loomserve.execution import kernels

    src = os.path.join(os.path.dirname(kernels.__file__), "quant.c")
    out = str(tmp_path / "quant_avx2.so")
    subprocess.run([kernels._compiler(), *kernels.CFLAGS, "-DQUANT_NO_VNNI", "-o", out, src, "-lm"],
                   check=True, capture_output=True)
    avx2 = ctypes.CDLL(out)
    cases = [(_linear(37, 160, bits, mins, bias=True, seed=bits), torch.randn(rows, 160))
             for bits, mins in ((4, True), (4, False), (8, False)) for rows in (1, 2, 33)]
    native = [lin(x) for lin, x in cases]
    monkeypatch.setattr(quant, "_lib_cache", [])
    monkeypatch.setattr(kernels, "load", lambda name: avx2)
    for (lin, x), want in zip(cases, native):
        assert torch.equal(lin(x), want)


@needs_kernel
def test_bf16_activations_come_back_bf16():
    lin = _linear(8, 64, 4, mins=True, bias=False)
    x = torch.randn(2, 3, 64)
    y = lin(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 8)
    assert torch.allclose(y.float(), lin(x), rtol=0.02, atol=0.05)


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_threaded_product_matches(bits):
    """Products above the kernel's SMALL_WORK run on several OpenMP threads: same results."""
    lin = _linear(301, 256, bits, mins=True, bias=True)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows in (1, 40, 70):  # 1 row: 77k MACs stays serial; 40, 70: threaded, 70 in 2 chunks
            x = torch.randn(rows, 256)
            emu, _ = _emulated(x, lin.dequantized())
            assert torch.allclose(lin(x).double(), emu + lin.bias.double(), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(old)
