"""MXFP4 experts run in place (layers/mxfp4.py, kernels/mxfp4.c) against transformers' own
dequantization of the same blocks.

- The kernel: products equal an fp64 product of the dequantized weights and x rounded per
  32-block to int8 exactly as the kernel rounds it (the only rounding left is fp32's: the int32
  block sums are exact), on the AVX2, portable and (where the host has it) VNNI builds.
- Loading tiny-gpt-oss-mxfp4 (tests/fixtures/build_mxfp4_fixture.py: the real HF layout and
  quantization_config): every expert weight the in-place model holds equals
  transformers.integrations.mxfp4.convert_moe_packed_tensors of the checkpoint's blocks, bit for
  bit, and so does the `--quantization none` load's widened copy.
- Logits against transformers' GptOssForCausalLM loaded with Mxfp4Config(dequantize=True).
  Tolerance: the in-place experts differ from the dequantized ones only by rounding their
  inputs to int8 per 32-block (half a step, max|x_block| / 254, per value). Proof of that: the
  in-place logits equal, to 1e-5, the dequantized model whose experts round their inputs the same
  way (Rounded below; measured 7e-7). Measured in-place vs transformers over 8 prompts of 48
  tokens: max |dlogit| 0.0085 (mean 0.0018, logits' std 0.82), so ATOL = 0.03 (3.5x).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from dataclasses import replace

import gguf
import pytest
import torch

from loomserve.config import EngineConfig
from loomserve.execution import kernels
from loomserve.execution.batch import ScheduledSeq
from loomserve.execution.layers import mxfp4
from loomserve.execution.layers.mxfp4 import (
    Mxfp4Experts,
    dequantize,
    gguf_blocks_to_hf,
    interleave_rows,
    tile_weight,
    untile_weight,
)
from loomserve.execution.models.gpt_oss import (
    Experts,
    GptOssTP,
    Mxfp4GptOssExperts,
    clamped_swiglu,
)
from loomserve.execution.models.loading.checkpoint import (
    check_quantization_config,
    iter_safetensors,
    mxfp4_in_place,
)
from loomserve.execution.models.loading.loader import count_weights, load_model
from loomserve.execution.models.registry import resolve
from loomserve.execution.parallel.state import TPGroup
from loomserve.execution.parallel.tensor_parallel import bias_once
from tests.execution.models.conftest import FIXTURES, GREEDY, logits_of

FIXTURE = FIXTURES / "tiny-gpt-oss-mxfp4"
ATOL = 0.03


def _random_mxfp4(e: int, n: int, k: int, seed: int, lo: int = 118, hi: int = 134):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(lo, hi, (e, n, k // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def _x_int8(x: torch.Tensor) -> torch.Tensor:
    """x rounded per 32-block to int8 as the kernel rounds it (fp32 d, 1/d, round half even)."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros(()))
    return (torch.round(xb * inv) * d).view(m, k)


def _check_product(lib, m: int, n: int, k: int, bias: bool, seed: int) -> None:
    blocks, scales = _random_mxfp4(1, n, k, seed)
    w = dequantize(blocks[0], scales[0]).double()  # [N, K]
    tiled = tile_weight(blocks[0], scales[0])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)) if bias else None
    y = torch.empty(m, n)
    lib.mxfp4_matmul(x.data_ptr(), m, k, tiled.data_ptr(), n, None if b is None else b.data_ptr(),
                     y.data_ptr(), 2)
    xq = _x_int8(x).double()
    ref = xq @ w.T + (0 if b is None else b.double())
    size = xq.abs() @ w.abs().T + (0 if b is None else b.abs().double())
    # fp32 rounding only: one product of scales per block, one fma per block, the bias
    assert ((y.double() - ref).abs() <= 2 ** -23 * (k // 32 + 3) * size).all()


@pytest.mark.parametrize("m", [1, 3, 5, 33])
@pytest.mark.parametrize("n, k", [(37, 96), (64, 160)])
def test_kernel_equals_fp64_reference(m, n, k):
    _check_product(mxfp4._lib(), m, n, k, bias=m == 3, seed=m * 7 + n)


def _build(tmp_path, name: str, *flags: str, march: bool = True):
    src = os.path.join(os.path.dirname(kernels.__file__), "mxfp4.c")
    out = str(tmp_path / f"{name}.so")
    cflags = [f for f in kernels.CFLAGS if march or not f.startswith("-march")]
    subprocess.run([kernels._compiler(), *cflags, *flags, "-o", out, src, "-lm"], check=True,
                   capture_output=True)
    lib = ctypes.CDLL(out)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.mxfp4_matmul.argtypes = [p, i64, i64, p, i64, p, p, i32]
    lib.mxfp4_dequantize.argtypes = [p, i64, i64, p]
    return lib


def test_portable_build_equals_reference(tmp_path):
    lib = _build(tmp_path, "portable", "-DMXFP4_PORTABLE", march=False)
    for m in (1, 6):
        _check_product(lib, m, 13, 96, bias=True, seed=m)


def test_vnni_build_equals_the_avx2_sequence(tmp_path):
    """vpdpbusd (where the host has AVX-512 VNNI) sums the same exact int32s as maddubs + madd:
    every output bit for bit the -DMXFP4_NO_VNNI build's (on other hosts both builds agree)."""
    avx2 = _build(tmp_path, "avx2", "-DMXFP4_NO_VNNI")
    native = mxfp4._lib()
    blocks, scales = _random_mxfp4(1, 37, 160, 3)
    tiled = tile_weight(blocks[0], scales[0])
    for m in (1, 2, 33):
        x = torch.randn(m, 160)
        ya, yn = torch.empty(m, 37), torch.empty(m, 37)
        for lib, y in ((avx2, ya), (native, yn)):
            lib.mxfp4_matmul(x.data_ptr(), m, 160, tiled.data_ptr(), 37, None, y.data_ptr(), 1)
        assert torch.equal(ya, yn)


def test_dequantize_equals_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4(3, 24, 96, 0, lo=0, hi=255)  # every scale but NaN's 255
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]
    assert torch.equal(dequantize(blocks, scales).transpose(1, 2), want)
    # the C dequantizer reads the tiled layout back to the same floats
    out, tiled = torch.empty(24, 96), tile_weight(blocks[1], scales[1])
    mxfp4._lib().mxfp4_dequantize(tiled.data_ptr(), 24, 96, out.data_ptr())
    assert torch.equal(out, want[1].T)


def test_tiled_layout_roundtrips():
    blocks, scales = _random_mxfp4(1, 13, 64, 1)
    tiled = tile_weight(blocks[0], scales[0])
    assert tiled.shape == (2, 2, 136)
    b, s = untile_weight(tiled, 13)
    assert torch.equal(b, blocks[0]) and torch.equal(s, scales[0])


def test_gguf_blocks_convert_exactly():
    """GGUF MXFP4 (type 39: e8m0 byte + 16 bytes, value j low / j+16 high) -> HF blocks whose
    dequantization is gguf-py's, bit for bit; gate and up re-interleave into gate_up rows."""
    w = torch.randn(2 * 6, 64, generator=torch.Generator().manual_seed(0)).numpy()
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
    assert raw.shape == (12, 2 * 17)
    blocks, scales = gguf_blocks_to_hf(torch.from_numpy(raw))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(dequantize(blocks, scales), torch.from_numpy(want))
    gate_up = blocks.view(2, 6, 2, 16)
    assert torch.equal(interleave_rows(gate_up[:, 0::2], gate_up[:, 1::2]), gate_up)


def _packed(e=3, n=40, k=64, seed=0) -> Mxfp4Experts:
    mod = Mxfp4Experts(e, {"proj": (n, k)})
    blocks, scales = _random_mxfp4(e, n, k, seed)
    mod.proj_blocks.data.copy_(blocks)
    mod.proj_scales.data.copy_(scales)
    mod.proj_bias.data.copy_(torch.randn(e, n))
    return mod


def test_torch_fallback_and_unpack_without_the_kernel(monkeypatch):
    want_mod = _packed()
    want = dequantize(want_mod.proj_blocks.data, want_mod.proj_scales.data)
    x = torch.randn(4, 64)
    monkeypatch.setattr(mxfp4, "_lib_cache", [None])  # as LOOMSERVE_KERNELS=0
    mod = _packed()
    mod.pack()
    assert mod.form == "blocks" and not list(mod.parameters())[:-1]  # only the bias is a param
    torch.testing.assert_close(mod.project("proj", 1, x), x @ want[1].T + mod.proj_bias[1])
    mod.unpack()
    assert mod.form == "dense" and torch.equal(mod.proj, want.transpose(1, 2))


def test_off_the_cpu_the_experts_unpack_once():
    """A packed module moved to another device becomes dense there (in the bias's dtype); one
    packed on another device unpacks at pack(). (The meta device stands in for CUDA.)"""
    mod = _packed()
    mod.pack()
    assert mod.form == "tiled" and mod.proj_tiled.shape == (3, 5, 2, 136)
    mod.to(device="meta", dtype=torch.bfloat16)
    assert mod.form == "dense" and mod.proj.shape == (3, 64, 40)
    assert mod.proj.dtype == torch.bfloat16 and mod.proj.device.type == "meta"
    assert not [b for b in mod.buffers()]
    fresh = Mxfp4Experts(3, {"proj": (40, 64)}).to_empty(device="meta")
    fresh.pack()
    assert fresh.form == "dense" and fresh.proj.shape == (3, 64, 40)


# --- the model -----------------------------------------------------------------------------------

def test_checkpoint_config_is_accepted():
    with open(FIXTURE / "config.json") as f:
        import json
        hf = json.load(f)
    assert check_quantization_config(hf) is None
    _, cfg = resolve(hf)
    assert [mxfp4_in_place(hf, cfg, q) for q in ("auto", "none", "int8")] == [True, False, True]
    # auto widens where tensor parallelism would split a 32-value block (32 / 2 columns a rank)
    assert not mxfp4_in_place(hf, cfg, "auto", tp_size=2)
    _, llama = resolve({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert not mxfp4_in_place(hf, llama, "auto")  # no in-place MXFP4 model: widened
    names = dict(iter_safetensors(str(FIXTURE)))  # widened: transformers' names and layout
    assert names["model.layers.1.mlp.experts.down_proj"].shape == (4, 32, 64)
    assert not any(n.endswith(("_blocks", "_scales")) for n in names)
    kept = dict(iter_safetensors(str(FIXTURE), keep_mxfp4=True))
    assert kept["model.layers.1.mlp.experts.down_proj_blocks"].shape == (4, 64, 1, 16)


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    return (load_model(str(FIXTURE), torch.float32, "cpu", cache, "auto"),
            load_model(str(FIXTURE), torch.float32, "cpu", cache, "none"))


def test_loaded_experts_equal_transformers_dequantization(loads):
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    in_place, widened = loads
    assert (in_place.quantization, widened.quantization) == ("mxfp4", "none")
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    for i, layer in enumerate(in_place.model.model.layers):
        experts = layer.mlp.experts
        assert isinstance(experts, Mxfp4GptOssExperts) and experts.form == "tiled"
        dense = widened.model.model.layers[i].mlp.experts
        assert isinstance(dense, Experts)
        for proj in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{proj}"
            want = convert_moe_packed_tensors(tensors[key + "_blocks"], tensors[key + "_scales"],
                                              dtype=torch.float32)
            assert torch.equal(getattr(dense, proj), want)
            for e in range(4):
                assert torch.equal(experts.weight(proj, e), want[e].T)
    # the same model size either way; the in-place experts in 4.25 bits a weight
    (p_in, b_in), (p_w, b_w) = count_weights(in_place.model), count_weights(widened.model)
    expert_weights = 2 * 4 * (64 * 64 + 32 * 64)
    assert p_in == p_w and b_w - b_in == expert_weights * 4 - expert_weights * 17 // 32


def test_gguf_mxfp4_experts_equal_the_hf_ones(loads):
    """GGUF's stacks (gate and up apart, its nibble order), quantized by gguf-py from the
    widened experts, pack to the same weights as the HF checkpoint's blocks."""
    in_place, widened = loads
    dense = widened.model.model.layers[1].mlp.experts
    mx = gguf.GGMLQuantizationType.MXFP4

    def raw(w):  # [E, K, N] float -> GGUF bytes [E, N, K/32 * 17]
        rows = w.detach().transpose(1, 2).contiguous()
        return gguf.quants.quantize(rows.reshape(-1, rows.shape[2]).numpy(), mx) \
            .reshape(rows.shape[0], rows.shape[1], -1)

    gate_up = dense.gate_up_proj
    mod = Mxfp4GptOssExperts.from_gguf(in_place.config, dense, raw(gate_up[..., 0::2]),
                                       raw(gate_up[..., 1::2]), raw(dense.down_proj))
    want = in_place.model.model.layers[1].mlp.experts
    assert mod.form == "tiled"
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(mod.get_buffer(f"{name}_tiled"), want.get_buffer(f"{name}_tiled"))
        assert torch.equal(getattr(mod, f"{name}_bias"), getattr(want, f"{name}_bias"))


def test_expert_parallel_slices_the_packed_experts():
    moe = load_model(str(FIXTURE), torch.float32, "cpu", "/nonexistent", "auto").model \
        .model.layers[0].mlp
    x = torch.randn(5, 64)
    before = [moe.expert(e, x) for e in range(4)]
    moe.enable_ep(None, 1, 2)
    assert moe.local_experts == 2 and moe.experts.gate_up_proj_tiled.shape[0] == 2
    for e in range(2):
        assert torch.equal(moe.expert(e, x), before[2 + e])


def test_tensor_parallel_split_sums_to_the_whole():
    """Two ranks' MXFP4 experts (gate_up by rows, down by whole blocks) sum to the unsplit
    expert; a split inside a 32-value block is refused."""
    import json

    with open(FIXTURE / "config.json") as f:
        hf = json.load(f)
    _, cfg = resolve({**hf, "intermediate_size": 64})
    cfg = replace(cfg, mxfp4_experts=True)
    plan = GptOssTP()
    g = torch.Generator().manual_seed(0)
    full_t = {}
    for proj, (n, k) in (("gate_up_proj", (128, 64)), ("down_proj", (64, 64))):
        full_t[f"mlp.experts.{proj}_blocks"], full_t[f"mlp.experts.{proj}_scales"] = \
            _random_mxfp4(4, n, k, seed=n)
        full_t[f"mlp.experts.{proj}_bias"] = torch.randn(4, n, generator=g)

    def experts(c, t):
        mod = Mxfp4GptOssExperts(c)
        for name, v in t.items():
            getattr(mod, name.split(".")[-1]).data.copy_(v)
        mod.pack()
        return mod

    full = experts(cfg, full_t)
    x = torch.randn(6, 64, generator=g)
    total = 0
    for rank in range(2):
        tp = TPGroup(rank, 2, None, None)
        shard = {k: plan.shard_layer(k, v, cfg, tp) for k, v in full_t.items()}
        assert torch.equal(shard["mlp.experts.down_proj_bias"],
                           bias_once(full_t["mlp.experts.down_proj_bias"], tp))
        total = total + experts(plan.shard_config(cfg, tp), shard).run(2, x)
    torch.testing.assert_close(total, full.run(2, x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="MXFP4 experts split"):
        plan.check(cfg, 4)  # 64 / 4 = 16 columns a rank


def _runner(quantization: str):
    from loomserve.execution.model_runner import ModelRunner

    return ModelRunner(EngineConfig.from_kwargs(
        model=str(FIXTURE), dtype="float32", device="cpu", block_size=4, kv_cache_memory="2MB",
        quantization=quantization))


def _logits(runner, tokens: list[int], start: int = 0, tables=None) -> torch.Tensor:
    groups = len(runner.kv_cache_config.groups)
    if tables is None:
        per = 32
        tables = [list(range(g * per, (g + 1) * per)) for g in range(groups)]
    return logits_of(runner, [ScheduledSeq("r", tokens, start, tables, True, GREEDY)])["r"], tables


class Rounded(Experts):
    """The dequantized experts with their inputs rounded per 32-block to int8 as the kernel
    rounds them: the arithmetic the in-place experts do, in torch."""

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.addmm(self.gate_up_proj_bias[e], _x_int8(x), self.gate_up_proj[e])
        h = clamped_swiglu(gate_up, self.alpha, self.limit)
        return torch.addmm(self.down_proj_bias[e], _x_int8(h), self.down_proj[e])


@pytest.fixture(scope="module")
def runners():
    return _runner("auto"), _runner("none")


def test_logits_against_transformers(runners):
    from transformers import GptOssForCausalLM, Mxfp4Config

    in_place, widened = runners
    assert isinstance(in_place.model.model.layers[0].mlp.experts, Mxfp4GptOssExperts)
    ref = GptOssForCausalLM.from_pretrained(
        str(FIXTURE), dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)).eval()
    for seed in range(3):
        tokens = torch.randint(3, 400, (48,), generator=torch.Generator().manual_seed(seed)).tolist()
        with torch.no_grad():
            want = ref(torch.tensor([tokens])).logits[0, -1]
        ours, _ = _logits(in_place, tokens)
        torch.testing.assert_close(ours, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(_logits(widened, tokens)[0], want, atol=1e-4, rtol=1e-4)
        assert ours.argmax() == want.argmax()


def test_in_place_is_the_int8_rounded_dequantized_model(runners):
    in_place, _ = runners
    emulated = _runner("none")
    for layer in emulated.model.model.layers:
        layer.mlp.experts.__class__ = Rounded
    tokens = torch.randint(3, 400, (48,), generator=torch.Generator().manual_seed(9)).tolist()
    torch.testing.assert_close(_logits(in_place, tokens)[0], _logits(emulated, tokens)[0],
                               atol=1e-5, rtol=0)


def test_greedy_tokens_equal_in_place_and_dequantized(runners):
    outs = []
    for runner in runners:
        prompt = [5, 17, 42, 99, 7, 230, 11]
        row, tables = _logits(runner, prompt)
        toks = []
        for i in range(24):
            toks.append(int(row.argmax()))
            row, _ = _logits(runner, [toks[-1]], len(prompt) + i, tables)
        outs.append(toks)
    assert outs[0] == outs[1]
