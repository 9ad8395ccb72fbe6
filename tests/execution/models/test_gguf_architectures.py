"""GGUF files of the agent architectures -- gemma3, gpt-oss, deepseek2 (DeepSeek-V3 MLA),
qwen3moe -- made from the tiny HF fixtures by llama.cpp's own converter (tests/fixtures/gguf,
built by tests/fixtures/build_gguf_fixtures.py, outtype f32), loaded through loomserve's GGUF
path (loading/gguf.py) and checked against loomserve on the HF folder each was converted from
(which the per-model tests check against transformers):

- the converted config parses to the same model config (every field the model reads);
- the converted weights are the source's, bit for bit (Gemma's norms: 1 + w, which is all the
  model reads; the converter stored 1 + w, and 1 + w - 1 need not be w in fp32);
- prefill and greedy decode give the same logits, bit for bit, and so the same tokens;
- the file's tokenizer and chat template give the same text and ids as the source's tokenizer;
- llama.cpp itself (recorded: llama_logprobs.json) gives the same prompt ids, greedy tokens and,
  within its own rounding, log-probs on each file (gpt-oss: one documented difference);
- a Q8_0 file runs its blocks in place with --quantization gguf; MXFP4 experts (gpt-oss)
  dequantize with none and stay packed in place; quantized deepseek2 / gpt-oss files in place
  equal their dequantized runs; a "deepseek-v3" pre-tokenizer splits as llama.cpp's does.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from loomserve.config import EngineConfig
from loomserve.execution.batch import ScheduledSeq
from tests.execution.models.conftest import FIXTURES, GREEDY, logits_of

ARCHS = {"tiny-gemma3": "gemma3", "tiny-gpt-oss": "gpt-oss", "tiny-deepseek-v3": "deepseek2",
         "tiny-qwen3-moe": "qwen3moe"}
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What's 12345 + 678?  Don't\nguess; show it."}]
NEW_TOKENS = 5


def _builder():
    spec = importlib.util.spec_from_file_location("build_gguf_fixtures",
                                                  FIXTURES / "build_gguf_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _runner(model: str, cache: str, quantization: str = "none"):
    from loomserve.engine.tokenizer import Tokenizer
    from loomserve.execution.model_runner import ModelRunner

    r = ModelRunner(EngineConfig.from_kwargs(model=model, dtype="float32", device="cpu",
                                             block_size=4, kv_cache_memory="2MB",
                                             cache_dir=cache, quantization=quantization))
    r.tokenizer = Tokenizer.from_folder(r.model_folder, r.model_config.eos_token_ids)
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{fixture name: (GGUF runner, source runner, source folder)}, built on first use."""
    root = tmp_path_factory.mktemp("gguf-arch")
    builder, cache = _builder(), str(root / "cache")
    made = {}

    def get(name: str):
        if name not in made:
            source = builder.gguf_source(name, str(root / name))
            made[name] = (_runner(str(FIXTURES / "gguf" / f"{name}.gguf"), cache),
                          _runner(source, cache), source)
        return made[name]
    return get


def _generate(r, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of the prefill's last position and each decode step."""
    n = len(prompt) + NEW_TOKENS
    per_group = -(-n // r.block_size)
    tables = [list(range(g * per_group, (g + 1) * per_group))
              for g in range(len(r.kv_cache_config.groups))]

    def step(tokens, start):
        return logits_of(r, [ScheduledSeq("r", list(tokens), start, tables, True, GREEDY)])["r"]
    rows = [step(prompt, 0)]
    out = [int(rows[-1].argmax())]
    for i in range(NEW_TOKENS - 1):
        rows.append(step([out[-1]], len(prompt) + i))
        out.append(int(rows[-1].argmax()))
    return out, torch.stack(rows)


@pytest.mark.parametrize("name", list(ARCHS))
def test_gguf_runs_as_its_source(built, name):
    import gguf
    from safetensors.torch import load_file

    from loomserve.execution.models.registry import resolve

    path = FIXTURES / "gguf" / f"{name}.gguf"
    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == ARCHS[name]
    ours, src, source = built(name)
    assert type(ours.model) is type(src.model)

    # config: every field the model's config class parses (the raw dict it keeps is not compared)
    def parsed(folder):
        with open(os.path.join(folder, "config.json")) as f:
            return resolve(json.load(f))[1]
    assert parsed(ours.model_folder) == parsed(source)

    # weights: the source checkpoint's names and values
    got = load_file(os.path.join(ours.model_folder, "model.safetensors"))
    want = load_file(os.path.join(source, "model.safetensors"))
    if name == "tiny-deepseek-v3":  # the converter drops the MTP layer, as loomserve's load does
        n = src.model_config.num_layers
        want = {k: v for k, v in want.items() if not k.startswith(f"model.layers.{n}.")}
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        if name == "tiny-gemma3" and k.endswith("norm.weight"):
            g, w = 1 + g, 1 + w
        assert g.dtype == torch.float32 and g.shape == w.shape and torch.equal(g, w), k

    # tokenizer and chat template: same text, same ids, same decode
    prompt_text = ours.tokenizer.apply_chat_template(MESSAGES)
    assert prompt_text == src.tokenizer.apply_chat_template(MESSAGES)
    prompt = ours.tokenizer.encode(prompt_text)
    assert prompt == src.tokenizer.encode(prompt_text)
    assert ours.tokenizer.decode(prompt, skip_special_tokens=False) == \
        src.tokenizer.decode(prompt, skip_special_tokens=False)
    assert ours.model_config.eos_token_ids == src.model_config.eos_token_ids

    # greedy decode: same logits bit for bit (same fp32 weights, same code), same tokens
    tokens, logits = _generate(ours, prompt)
    want_tokens, want_logits = _generate(src, prompt)
    assert tokens == want_tokens
    assert torch.equal(logits, want_logits)


def test_q8_0_runs_in_place(built, tmp_path):
    """tiny-gemma3-q8_0.gguf (the converter's --outtype q8_0): with --quantization gguf its
    linears and its embedding (also the tied LM head) keep the file's Q8_0 blocks, which hold the
    values the float path dequantizes (Q8_0 maps onto loomserve's 8-bit format exactly); its
    greedy tokens are the float path's, and its logits track them: not bit for bit, since the
    kernel rounds activations to int8 per 32 values as llama.cpp does (test_gguf_reference.py
    bounds that per module). Measured max |diff| 0.091 on logits soft-capped to +-3; bound 0.2."""
    from loomserve.execution.layers.quant import QuantEmbedding, QuantLinear

    path = str(FIXTURES / "gguf" / "tiny-gemma3-q8_0.gguf")
    cache = str(tmp_path / "cache")
    dense, q = _runner(path, cache), _runner(path, cache, quantization="gguf")
    mods = {n: m for n, m in q.model.named_modules() if isinstance(m, QuantLinear)}
    layers = len(q.model.model.layers)
    assert len(mods) == 4 * layers + 1  # qkv, o, gate_up, down per layer; the embedding
    assert isinstance(q.model.model.embed_tokens, QuantEmbedding) and q.model.lm_head is None
    weights = dict(dense.model.named_parameters())
    for n, m in mods.items():
        assert torch.equal(m.dequantized(), weights[f"{n}.weight"]), n
    prompt = dense.tokenizer.encode(dense.tokenizer.apply_chat_template(MESSAGES))
    tokens, logits = _generate(q, prompt)
    want_tokens, want_logits = _generate(dense, prompt)
    assert tokens == want_tokens
    torch.testing.assert_close(logits, want_logits, atol=0.2, rtol=0)


def test_gpt_oss_mxfp4_experts(built, tmp_path):
    """Released gpt-oss GGUFs store the experts as MXFP4. tiny-gpt-oss.gguf rewritten with its
    expert stacks quantized to MXFP4 by gguf-py (GGUFWriter, every other tensor and key as it
    was) converts to the HF layout of gguf-py's own dequantization of those blocks, exactly, and
    runs: logits near the f32 file's, not equal (4-bit experts of a random model: measured max
    |diff| 0.44 on logits up to 2.7; bound 1.0)."""
    import gguf
    from safetensors.torch import load_file

    mx = gguf.GGMLQuantizationType.MXFP4
    path = str(tmp_path / "tiny-gpt-oss-mxfp4.gguf")
    dequantized = _requantize(str(FIXTURES / "gguf" / "tiny-gpt-oss.gguf"), path,
                              lambda name, w: mx if name.endswith("_exps.weight") else None)
    assert {t.tensor_type for t in gguf.GGUFReader(path).tensors if t.name.endswith("_exps.weight")} == {mx}

    r = _runner(path, str(tmp_path / "cache"))
    got = load_file(os.path.join(r.model_folder, "model.safetensors"))
    for i in range(len(r.model.model.layers)):
        gate, up, down = (dequantized[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
        gate_up = got[f"model.layers.{i}.mlp.experts.gate_up_proj"]  # [experts, hidden, 2 * inter]
        assert torch.equal(gate_up[..., 0::2], gate.transpose(1, 2))
        assert torch.equal(gate_up[..., 1::2], up.transpose(1, 2))
        assert torch.equal(got[f"model.layers.{i}.mlp.experts.down_proj"], down.transpose(1, 2))
    f32 = built("tiny-gpt-oss")[0]
    prompt = r.tokenizer.encode(r.tokenizer.apply_chat_template(MESSAGES))
    _, logits = _generate(r, prompt)
    _, want = _generate(f32, prompt)
    assert torch.isfinite(logits).all() and 0 < (logits - want).abs().max() < 1.0


def _requantize(src: str, dst: str, pick) -> dict[str, torch.Tensor]:
    """dst: src rewritten by gguf-py (GGUFWriter), each tensor quantized to pick(name, values) or
    kept; every key as it was. Returns gguf-py's dequantization of the tensors quantized."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = {"sub_type": f.types[-1]} if f.types[0] == gguf.GGUFValueType.ARRAY else {}
        writer.add_key_value(key, f.contents(), f.types[0], **sub)
    dequantized = {}
    for t in reader.tensors:
        w = np.array(t.data)
        qtype = pick(t.name, w)
        if qtype is None:
            writer.add_tensor(t.name, w)
            continue
        blocks = gguf.quants.quantize(w, qtype)
        dequantized[t.name] = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
        writer.add_tensor(t.name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


def test_in_place_equals_dequantized(tmp_path):
    """--quantization gguf on quantized files of the new families runs the file's blocks and
    gives the dequantized path's greedy tokens, logits within the int8 rounding of activations:
    deepseek2 in Q8_0 (its MLA rope rows, which the model reorders at load, reordered in the
    blocks too: without that the logits were off by 3.6) and gpt-oss with MXFP4 experts (kept
    packed, layers/mxfp4.py). Measured max |diff| 0.078 (deepseek2) / 0.009 (gpt-oss); bound 0.2."""
    import gguf

    from loomserve.execution.layers.quant import QuantLinear
    from loomserve.execution.models.gpt_oss import Mxfp4GptOssExperts

    T = gguf.GGMLQuantizationType
    q8 = lambda name, w: T.Q8_0 if w.ndim == 2 and w.shape[-1] % 32 == 0 and "norm" not in name \
        and "output" not in name and "token_embd" not in name else None  # noqa: E731
    mx = lambda name, w: T.MXFP4 if name.endswith("_exps.weight") else None  # noqa: E731
    for name, pick in (("tiny-deepseek-v3", q8), ("tiny-gpt-oss", mx)):
        path = str(tmp_path / f"{name}-q.gguf")
        _requantize(str(FIXTURES / "gguf" / f"{name}.gguf"), path, pick)
        cache = str(tmp_path / "cache")
        dense, q = _runner(path, cache), _runner(path, cache, quantization="gguf")
        if name == "tiny-deepseek-v3":
            mods = [n for n, m in q.model.named_modules() if isinstance(m, QuantLinear)]
            assert any(n.endswith(("q_b_proj", "q_proj")) for n in mods), mods
            assert any(n.endswith("kv_a_proj_with_mqa") for n in mods), mods
        else:
            assert all(isinstance(layer.mlp.experts, Mxfp4GptOssExperts)
                       for layer in q.model.model.layers)
        prompt = dense.tokenizer.encode(dense.tokenizer.apply_chat_template(MESSAGES))
        tokens, logits = _generate(q, prompt)
        want_tokens, want_logits = _generate(dense, prompt)
        assert tokens == want_tokens, name
        torch.testing.assert_close(logits, want_logits, atol=0.2, rtol=0, msg=name)


# Token ids llama.cpp's own tokenizer gives (llama-server /tokenize, add_special false; build
# 0c1e570 of the vendored sources) for tiny-deepseek-v3.gguf with tokenizer.ggml.pre set to
# "deepseek-v3": its pre-tokenizer splits digits in threes and keeps CJK runs apart, where
# GPT-2's regex (transformers' default for a pre-tokenizer it does not know) gives other ids for
# the first three.
_DEEPSEEK_V3_IDS = {
    "0123456789": [295, 20, 21, 297, 298, 26, 27],
    "call 0123456789 or 4567, 01 23": [69, 308, 223, 295, 20, 21, 297, 298, 26, 27, 284, 84, 223,
                                       297, 24, 25, 14, 223, 295, 223, 296],
    "#include <stdio.h>\nint main(){return 0;}": [5, 262, 69, 78, 87, 311, 359, 331, 70, 75, 81, 16,
                                                  74, 32, 201, 384, 392, 294, 93, 84, 71, 336, 223,
                                                  18, 29, 95],
    "我想在apple工作1314151天～": [165, 233, 242, 165, 228, 114, 164, 253, 104, 67, 82, 82, 78, 71, 164,
                                  118, 101, 163, 124, 253, 19, 21, 19, 22, 19, 23, 19, 164, 100, 105,
                                  174, 124, 255],
}


def test_deepseek_v3_pre_tokenizer(tmp_path):
    """A DeepSeek-V3 GGUF names its pre-tokenizer "deepseek-v3", which transformers' GGUF
    tokenizer conversion does not know; loomserve applies llama.cpp's regexes for it and
    tokenizes as llama.cpp does (the file: tiny-deepseek-v3.gguf with that one key changed)."""
    import gguf
    import numpy as np

    from loomserve.engine.tokenizer import Tokenizer
    from loomserve.execution.models.loading.gguf import cached_conversion

    reader = gguf.GGUFReader(str(FIXTURES / "gguf" / "tiny-deepseek-v3.gguf"))
    path = str(tmp_path / "tiny-deepseek-v3-pre.gguf")
    writer = gguf.GGUFWriter(path, "deepseek2")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = {"sub_type": f.types[-1]} if f.types[0] == gguf.GGUFValueType.ARRAY else {}
        value = "deepseek-v3" if key == "tokenizer.ggml.pre" else f.contents()
        writer.add_key_value(key, value, f.types[0], **sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = Tokenizer.from_folder(cached_conversion(path, str(tmp_path / "cache")))
    for text, ids in _DEEPSEEK_V3_IDS.items():
        assert tok.encode(text, add_special_tokens=False) == ids, text
        assert tok.decode(ids) == text


@pytest.mark.parametrize("name", list(ARCHS))
def test_gguf_as_llama_cpp_reads_it(built, name, tmp_path):
    """loomserve against llama.cpp itself on the same file (tests/fixtures/gguf/
    llama_logprobs.json, recorded with llama-server on an fp32 KV cache): the same prompt ids
    from the file's template and tokenizer, the same greedy tokens, and per position llama.cpp's
    top-3 log-probs within 0.01 (measured at most 0.0023: llama.cpp's own fp32 rounding).

    gpt-oss is the one family where loomserve reads a file otherwise than llama.cpp does, on
    purpose: llama.cpp rounds the YaRN ramp's bounds (truncate=true) where the released configs
    say truncate=false (loomserve and transformers); with truncate=true in the converted folder
    loomserve agrees with llama.cpp as closely as elsewhere, and without it, by up to 0.38."""
    with open(FIXTURES / "gguf" / "llama_logprobs.json") as f:
        rec = json.load(f)["files"][f"{name}.gguf"]
    ours = built(name)[0]
    text = ours.tokenizer.apply_chat_template(MESSAGES)
    assert text == rec["prompt_text"]
    assert ours.tokenizer.encode(text) == rec["prompt"]
    runners = [ours]
    if name == "tiny-gpt-oss":
        folder = tmp_path / "truncated"
        folder.mkdir()
        for f in os.listdir(ours.model_folder):
            os.symlink(os.path.join(ours.model_folder, f), folder / f)
        with open(os.path.join(ours.model_folder, "config.json")) as f:
            cfg = json.load(f)
        assert cfg["rope_parameters"]["truncate"] is False
        cfg["rope_parameters"]["truncate"] = True
        os.unlink(folder / "config.json")
        with open(folder / "config.json", "w") as f:
            json.dump(cfg, f)
        runners.append(_runner(str(folder), str(tmp_path / "cache")))
    worst = []
    for r in runners:
        tokens, logits = _generate(r, rec["prompt"])
        assert tokens == rec["tokens"]
        logprobs = logits.double().log_softmax(-1)
        diffs = [abs(lp - float(logprobs[k, i])) for k, top in enumerate(rec["top"])
                 if top is not None for i, lp in top]
        assert len(diffs) >= 9
        worst.append(max(diffs))
    assert worst[-1] < 0.01
    if name == "tiny-gpt-oss":
        assert worst[0] > 0.1  # truncate=false: not llama.cpp's rope
