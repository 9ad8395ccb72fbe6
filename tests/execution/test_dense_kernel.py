"""The dense few-row kernel (kernels/dense.c through layers/dense.py) against F.linear."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from loomserve.execution.layers import dense

pytestmark = pytest.mark.skipif(not dense.available(), reason="no C compiler for the kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("n,k", [(8, 64), (37, 19), (1000, 136), (4096, 576)])
def test_matches_f_linear(dtype, rows, n, k):
    g = torch.Generator().manual_seed(n * k + rows)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    out = dense.DenseLinear(w, b, max_rows=16)(x)
    assert out.dtype == dtype and out.shape == (rows, n)
    # fp32 accumulation either way; bf16 outputs differ by their own rounding at most
    tol = 1e-4 * k ** 0.5 if dtype == torch.float32 else 1e-2 * ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= tol


def test_more_rows_than_max_run_torch_and_leading_dims_keep():
    w = torch.randn(64, 32)
    x = torch.randn(2, 3, 32)
    assert torch.equal(dense.DenseLinear(w, None, max_rows=4)(x), F.linear(x, w))  # 6 rows: torch
    y = dense.DenseLinear(w, None, max_rows=8)(x)
    assert y.shape == (2, 3, 64) and torch.allclose(y, F.linear(x, w), atol=1e-5)


def test_replace_linears_keeps_weights_and_skips_subclasses():
    class Sub(nn.Linear):
        pass

    m = nn.Sequential(nn.Linear(16, 8), Sub(8, 4), nn.Sequential(nn.Linear(4, 2, bias=False)))
    w0 = m[0].weight
    assert dense.replace_linears(m, 4) == 2
    assert isinstance(m[0], dense.DenseLinear) and m[0].weight is w0
    assert type(m[1]) is Sub and isinstance(m[2][0], dense.DenseLinear)
    x = torch.randn(3, 16)
    ref = F.linear(F.linear(F.linear(x, w0, m[0].bias), m[1].weight, m[1].bias), m[2][0].weight)
    assert torch.allclose(m(x), ref, atol=1e-5)


def test_non_contiguous_weight_falls_back():
    w = torch.randn(32, 64).t()  # [64, 32] view, not contiguous
    x = torch.randn(1, 32)
    assert torch.equal(dense.DenseLinear(w, None, max_rows=16)(x), F.linear(x, w))


def test_bf16_many_rows_run_in_fp32():
    lin = nn.Linear(48, 24).to(torch.bfloat16)
    layer = dense.DenseLinear(lin.weight, lin.bias, max_rows=4)
    x = torch.randn(10, 48).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    ref = F.linear(x.float(), lin.weight.float(), lin.bias.float()).to(torch.bfloat16)
    assert torch.equal(out, ref)


def test_kernel_build_key_covers_local_headers(tmp_path, monkeypatch):
    """Editing a header a kernel includes rebuilds the library (the header is in its key)."""
    from loomserve.execution import kernels

    src = tmp_path / "src"
    src.mkdir()
    (src / "probe.c").write_text('#include "probe.h"\nint probe(void) { return VALUE; }\n')
    monkeypatch.setattr(kernels, "_HERE", str(src))
    monkeypatch.setenv("LOOMSERVE_CACHE", str(tmp_path / "cache"))
    values = []
    for value in (3, 7):
        (src / "probe.h").write_text(f"#define VALUE {value}\n")
        values.append(kernels._build("probe").probe())
    assert values == [3, 7]
