"""The fused C ops (layers/fused.py, kernels/fused.c) against their torch references: every
RMSNorm variant with and without the residual add, RoPE in place on q/k, SiLU(gate) * up; odd
sizes, several token counts, fp32 and bf16; the C path really runs; the torch path (switched
off, unsupported dtype) is the reference itself; a model forward runs every fused op."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from loomserve.execution import kernels
from loomserve.execution.layers import fused
from loomserve.execution.layers.norm import RMSNorm
from loomserve.execution.layers.rotary import RotaryEmbedding, apply_rope
from loomserve.execution.models.arch_config import ArchConfig

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="LOOMSERVE_KERNELS=0")
TOKENS = [1, 3, 8, 37]
EPS = 1e-5


@pytest.fixture(autouse=True)
def _kernel_on():
    assert fused.library() is not None, "the fused kernel library did not build"
    fused.calls.clear()
    yield
    fused.USE = True


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: summation order and FMA only; bf16: at most one bf16 rounding step apart, rarely."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        g, w = got.float(), want.float()
        torch.testing.assert_close(g, w, rtol=2 ** -7, atol=1e-6)
        assert (g == w).float().mean() > 0.97  # mostly the same bits


def _rand(shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


VARIANTS = {"llama": {}, "scale_in_fp32": {"scale_in_fp32": True},
            "zero_centered": {"zero_centered": True, "scale_in_fp32": True}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_rms_norm_with_and_without_residual(variant, dtype):
    for seed, (n, d) in enumerate(zip(TOKENS, [576, 65, 1000, 7])):
        norm = RMSNorm(d, EPS, **VARIANTS[variant]).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(_rand(d, dtype, seed) * 0.5 + 1.0)
        x, res = _rand((n, d), dtype, seed + 1, 3.0), _rand((n, d), dtype, seed + 2, 10.0)
        out, none = norm.fused(x.clone())
        assert none is None
        _close(out, norm(x))
        res_before, xx = res.clone(), x.clone()
        out, total = norm.fused(xx, res)
        want_total = res + x  # the reference rounds the sum to the dtype, as the kernel does
        assert torch.equal(total, want_total) and torch.equal(res, res_before)  # residual not written
        _close(out, norm(want_total))
    assert fused.calls["rms_norm"] == 2 * len(TOKENS)


def test_rms_norm_strided_rows():
    """A row-strided input (a slice of a wider buffer) normalizes in place of a copy."""
    norm = RMSNorm(64, EPS)
    wide = _rand((5, 100), torch.float32, 3)
    x = wide[:, 10:74]
    out, _ = norm.fused(x)
    _close(out, norm(x))
    assert fused.calls["rms_norm"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 10])
def test_rope_in_place_on_q_and_k(dtype, head_dim):
    cfg = ArchConfig("llama", hidden_size=9 * head_dim, num_layers=1, num_heads=9, num_kv_heads=3,
                     head_dim=head_dim, intermediate_size=8, vocab_size=8)
    rot = RotaryEmbedding(cfg, 4096, torch.device("cpu"), dtype)
    h, kvh = 9, 3
    for seed, n in enumerate(TOKENS):
        positions = torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(seed))
        cos, sin = rot.lookup(positions)
        qkv = _rand((n, h + 2 * kvh, head_dim), dtype, seed, 2.0)
        want = apply_rope(qkv[:, :h + kvh], cos, sin, rot.half)
        got = qkv.clone()
        assert fused.rope_qk_(got, h + kvh, cos, sin, rot.half)
        _close(got[:, :h + kvh], want)
        assert torch.equal(got[:, h + kvh:], qkv[:, h + kvh:])  # v untouched
    assert fused.calls["rope"] == len(TOKENS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama", "zero_centered"])  # Qwen3's q/k norms, Gemma 3's
def test_qk_norm_then_rope_in_place(dtype, variant):
    d, h, kvh = 32, 5, 2
    cfg = ArchConfig("llama", hidden_size=h * d, num_layers=1, num_heads=h, num_kv_heads=kvh,
                     head_dim=d, intermediate_size=8, vocab_size=8)
    rot = RotaryEmbedding(cfg, 512, torch.device("cpu"), dtype)
    q_norm, k_norm = (RMSNorm(d, 1e-6, **VARIANTS[variant]).to(dtype) for _ in range(2))
    with torch.no_grad():
        q_norm.weight.copy_(_rand(d, dtype, 1) * 0.3 + 1.0)
        k_norm.weight.copy_(_rand(d, dtype, 2) * 0.3)
    for seed, n in enumerate(TOKENS):
        cos, sin = rot.lookup(torch.arange(n) * 7 % 512)
        qkv = _rand((n, h + 2 * kvh, d), dtype, seed, 5.0)
        got = qkv.clone()
        assert fused.rope_qk_(got, h + kvh, cos, sin, rot.half, q_norm, k_norm, h)
        _close(got[:, :h], apply_rope(q_norm(qkv[:, :h]), cos, sin, rot.half))
        _close(got[:, h:h + kvh], apply_rope(k_norm(qkv[:, h:h + kvh]), cos, sin, rot.half))
        assert torch.equal(got[:, h + kvh:], qkv[:, h + kvh:])
    # Unlike norms (or a dtype mismatch) are left to the torch path.
    assert not fused.rope_qk_(got, h + kvh, cos, sin, rot.half, q_norm, RMSNorm(d, 1e-5).to(dtype), h)
    assert fused.calls["rope"] == len(TOKENS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_and_mul(dtype):
    for seed, (n, inter) in enumerate(zip(TOKENS, [1536, 13, 1537, 8])):
        gate_up = _rand((n, 2 * inter), dtype, seed, 4.0)
        gate_up[0, :3] = torch.tensor([-120.0, 95.0, 0.0])  # exp's clamps and silu(0)
        gate, up = gate_up.split(inter, dim=-1)
        _close(fused.silu_and_mul(gate_up, inter), F.silu(gate) * up)
    assert fused.calls["silu_and_mul"] == len(TOKENS)


def test_parallel_rows_match_the_serial_rows():
    """Prefill-sized inputs split rows over OpenMP threads (above 32K elements): the same
    numbers as one thread, row for row."""
    norm = RMSNorm(576, EPS)
    x, res = _rand((97, 576), torch.float32, 5), _rand((97, 576), torch.float32, 6)
    gate_up = _rand((97, 2 * 1536), torch.float32, 7)
    cfg = ArchConfig("llama", hidden_size=576, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64,
                     intermediate_size=8, vocab_size=8)
    rot = RotaryEmbedding(cfg, 512, torch.device("cpu"), torch.float32)
    cos, sin = rot.lookup(torch.arange(97))
    qkv = _rand((97, 15, 64), torch.float32, 8)
    outs = {}
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            q = qkv.clone()
            assert fused.rope_qk_(q, 12, cos, sin, rot.half)
            outs[threads] = (*norm.fused(x.clone(), res), fused.silu_and_mul(gate_up, 1536), q)
    finally:
        torch.set_num_threads(old)
    for a, b in zip(outs[1], outs[2]):
        assert torch.equal(a, b)
    _close(outs[2][0], norm(res + x))


def test_torch_path_is_the_reference_exactly():
    """Switched off, or on a dtype the kernel lacks, every op runs the torch reference."""
    norm = RMSNorm(48, EPS)
    x, res = _rand((3, 48), torch.float32, 1), _rand((3, 48), torch.float32, 2)
    gu = _rand((3, 2 * 21), torch.float32, 3)
    fused.USE = False
    out, total = norm.fused(x.clone(), res)
    assert torch.equal(total, res + x) and torch.equal(out, norm(res + x))
    assert torch.equal(fused.silu_and_mul(gu, 21), F.silu(gu[:, :21]) * gu[:, 21:])
    qkv = _rand((3, 5, 8), torch.float32, 4)
    assert not fused.rope_qk_(qkv, 4, qkv[:, :1], qkv[:, :1], 4)
    fused.USE = True
    norm64, x64 = RMSNorm(48, EPS).double(), x.double()
    assert torch.equal(norm64.fused(x64)[0], norm64(x64))
    assert not fused.rope_qk_(qkv.double(), 4, qkv[:, :1].double(), qkv[:, :1].double(), 4)
    assert sum(fused.calls.values()) == 0
    with pytest.raises(ValueError, match="ungated"):
        RMSNorm(8, EPS, gate="after").fused(x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])  # plain, q/k-normed attention
def test_model_forward_runs_the_fused_ops_and_matches_the_torch_path(name, dtype):
    """A Llama-family forward (prefill then decode) calls each fused op per layer, and its
    logits agree with the all-torch forward (in bf16 they measured bit-identical here)."""
    from tests.execution.models.conftest import Blocks, logits_of, seq, tiny_runner

    runner = tiny_runner(name, dtype=dtype)
    layers = len(runner.model.model.layers)
    blocks = Blocks(runner.block_size)
    prompt = [5, 17, 99, 3, 250, 7, 41]
    table = blocks.cover([], len(prompt) + 1)
    runs = {}
    for use in (True, False):
        fused.USE = use
        fused.calls.clear()
        pre = logits_of(runner, [seq("a", prompt, 0, table)])["a"]
        dec = logits_of(runner, [seq("a", [int(pre.argmax())], len(prompt), table)])["a"]
        runs[use] = (pre, dec, dict(fused.calls))
    assert runs[True][2] == {"rms_norm": 2 * (2 * layers + 1), "rope": 2 * layers, "silu_and_mul": 2 * layers}
    assert runs[False][2] == {}
    tol = 1e-4 if dtype == "float32" else 2e-2
    for a, b in zip(runs[True][:2], runs[False][:2]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
