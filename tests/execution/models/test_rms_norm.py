"""The one RMSNorm against the six classes it replaced: the same bits in fp32 and bf16 for every
variant. The old formulas are kept here, verbatim, as the reference."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from loomserve.execution.layers.norm import RMSNorm

EPS = 1e-6


# --- the old formulas (loomserve before the merge) ---------------------------------------------

def old_llama(x, w, eps):  # layers/common.py RMSNorm
    if x.dtype == torch.float32:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def old_gemma(x, w, eps):  # layers/common.py GemmaRMSNorm
    h = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return (h * (1.0 + w.float())).to(x.dtype)


def old_nemotron(x, w, eps):  # models/nemotron_h.py RMSNorm
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    h = x.float()
    return (w.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def old_zero_centered(x, w, eps):  # models/qwen3_next.py ZeroCenteredRMSNorm
    scale = 1.0 + w.float()
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), scale, eps)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def old_gated(x, z, dtype, w, eps):  # layers/gated_deltanet.py GatedRMSNorm
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = w * h.to(dtype)
    return (h * F.silu(z.float())).to(dtype)


def old_grouped_gated(y, z, dtype, w, eps, groups):  # layers/mamba2.py GroupedGatedRMSNorm
    h = y.float() * F.silu(z.float())
    g = h.view(*h.shape[:-1], groups, -1)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return w * g.view(h.shape).to(dtype)


UNGATED = {  # name: (old formula, options, zero-centred weight)
    "llama": (old_llama, {}, False),
    "gemma": (old_gemma, {"zero_centered": True, "scale_in_fp32": True}, True),
    "nemotron_h": (old_nemotron, {"scale_in_fp32": True}, False),
    "qwen3_next": (old_zero_centered, {"zero_centered": True, "scale_in_fp32": True}, True),
}
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(shape, dtype, seed):
    """Rows over several magnitudes, so rounding has room to differ; some rows non-contiguous."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[0])[(...,) + (None,) * (len(shape) - 1)]
    return x.to(dtype)


def _norm(dim, dtype, seed, centred, **opts):
    norm = RMSNorm(dim, EPS, **opts).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen) * 0.5 + (0.0 if centred else 1.0))
    return norm


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(UNGATED))
def test_ungated_variants_are_bit_identical(name, dtype):
    old, opts, centred = UNGATED[name]
    for seed, (rows, dim) in enumerate([(1, 576), (7, 64), (33, 2048)]):
        norm = _norm(dim, dtype, seed, centred, **opts)
        x = _inputs((rows, dim), dtype, seed)
        assert torch.equal(norm(x), old(x, norm.weight, EPS))
    # Per-head q/k norms read a non-contiguous view of the fused projection.
    heads, hd = 4, 32
    norm = _norm(hd, dtype, 9, centred, **opts)
    qkv = _inputs((5, 3 * heads * hd), dtype, 9)
    q = qkv[:, heads * hd:2 * heads * hd].view(5, heads, hd)
    assert not q.is_contiguous()
    assert torch.equal(norm(q), old(q, norm.weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_gated_after_is_bit_identical(dtype):
    # Gated DeltaNet: x is the fp32 recurrent output per value head, z the gate in the model dtype.
    for seed, (rows, heads, dim) in enumerate([(1, 4, 32), (19, 8, 128)]):
        norm = _norm(dim, dtype, seed, False, gate="after")
        x = _inputs((rows, heads, dim), torch.float32, seed)
        z = _inputs((rows, heads, dim), dtype, seed + 100)
        assert torch.equal(norm(x, z, dtype), old_gated(x, z, dtype, norm.weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [1, 2, 8])
def test_grouped_gate_before_is_bit_identical(dtype, groups):
    # Mamba2: y [tokens, heads * head_dim] fp32, gated by silu(z), normalized per group.
    for seed, rows in enumerate([1, 17]):
        norm = _norm(256, dtype, seed, False, gate="before", groups=groups)
        y = _inputs((rows, 256), torch.float32, seed)
        z = _inputs((rows, 256), dtype, seed + 100)
        assert torch.equal(norm(y, z, dtype), old_grouped_gated(y, z, dtype, norm.weight, EPS, groups))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama", "nemotron_h", "qwen3_next"])
def test_fast_paths_equal_the_composed_path(name, dtype):
    """The straight-line forwards of the common variants are the general composition (normalize,
    then scale and cast) with its steps inlined: forcing the general one changes no bit."""
    _, opts, centred = UNGATED[name]
    norm = _norm(96, dtype, 3, centred, **opts)
    x = _inputs((9, 96), dtype, 3)
    assert torch.equal(norm(x), norm._ungated(x))


def test_options_are_resolved_once_and_weights_keep_their_name():
    plain, centred = RMSNorm(8, EPS), RMSNorm(8, EPS, zero_centered=True, scale_in_fp32=True)
    assert plain.forward == plain._reference and centred.forward == centred._fp32_scaled
    assert RMSNorm(8, EPS, gate="after").forward.__name__ == "_gate_after"
    assert RMSNorm(8, EPS, gate="before", groups=2).forward.__name__ == "_gate_before"
    assert [n for n, _ in plain.named_parameters()] == ["weight"] and list(plain.state_dict()) == ["weight"]
    assert torch.equal(plain.weight, torch.ones(8)) and torch.equal(centred.weight, torch.zeros(8))
    with pytest.raises(ValueError, match="groups"):
        RMSNorm(10, EPS, groups=3)
    with pytest.raises(ValueError, match="gate"):
        RMSNorm(8, EPS, gate="around")
    with pytest.raises(ValueError, match="fp32"):
        RMSNorm(8, EPS, zero_centered=True)
