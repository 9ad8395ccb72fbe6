"""Context extension: --hf-overrides and RoPE scaling past the trained length.

A copy of tiny-llama whose config says 32 positions and plain RoPE stands for a model asked to
run past its trained context. With each scaling (yarn, linear, llama3, dynamic) given as an
override, the paged model's logits past position 32 equal transformers' for the same config
(transformers given the override as its own rope_parameters); the context checks accept what
the scaling covers and refuse the rest with the --hf-overrides that would allow it; the engine
serves a prompt longer than the original context only when extended."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from loomserve import LLM
from loomserve.config import EngineConfig, ModelConfig
from loomserve.config.hf_overrides import merge_hf_overrides, parse_hf_overrides
from loomserve.execution.models.arch_config import ArchConfig, context_length, context_limit
from loomserve.sampling_params import SamplingParams
from tests.execution.models.conftest import FIXTURES, Blocks, logits_of, ref_logits, seq

ORIGINAL = 32  # the copy's max_position_embeddings: the "trained" context
THETA = 10000.0
# (override as a user passes it, the same scaling as transformers' rope_parameters, length run)
CASES = {
    "yarn": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": ORIGINAL}},
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
             100),
    "linear": ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
               {"rope_type": "linear", "factor": 4.0}, 100),
    "llama3": ({"rope_scaling": {"type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0}},
               {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}, 100),
    # Static dynamic NTK (rotary.dynamic_ntk_base) is transformers' per-length form at the
    # longest length, max_position_embeddings * factor = 64: compared over exactly 64 tokens.
    "dynamic": ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
                {"rope_type": "dynamic", "factor": 2.0}, 64),
}


@pytest.fixture(scope="module")
def short_llama(tmp_path_factory) -> str:
    """tiny-llama's weights under a config with 32 positions and plain RoPE."""
    out = tmp_path_factory.mktemp("short-llama")
    src = FIXTURES / "tiny-llama"
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = ORIGINAL
    cfg["rope_parameters"] = {"rope_theta": THETA, "rope_type": "default"}
    (out / "config.json").write_text(json.dumps(cfg))
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        os.symlink(src / name, out / name)
    return str(out)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


# --- the override merge ---------------------------------------------------------------------------

def test_merge_is_recursive_and_leaves_the_config_alone():
    own = {"max_position_embeddings": 8192, "rope_parameters": {"rope_theta": 1e5, "rope_type":
                                                                "default"}, "eos_token_id": [1, 2]}
    merged = merge_hf_overrides(own, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0},
                                      "max_position_embeddings": 32768, "eos_token_id": [7]})
    assert merged["rope_parameters"] == {"rope_theta": 1e5, "rope_type": "yarn", "factor": 4.0}
    assert merged["max_position_embeddings"] == 32768 and merged["eos_token_id"] == [7]
    assert own["rope_parameters"] == {"rope_theta": 1e5, "rope_type": "default"}  # untouched
    assert merge_hf_overrides(own, {"rope_parameters": None})["rope_parameters"] is None


def test_both_spellings_parse_to_the_same_scaling():
    """rope_scaling over a transformers 5 config (rope_parameters) keeps its theta, as the
    rope_parameters spelling does."""
    base = json.loads((FIXTURES / "tiny-qwen3" / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    old = ArchConfig.from_hf(merge_hf_overrides(base, {"rope_scaling": yarn}))
    new = ArchConfig.from_hf(merge_hf_overrides(base, {"rope_parameters": yarn}))
    assert old.rope_theta == new.rope_theta == 1e6
    assert old.rope_scaling == new.rope_scaling == yarn
    assert context_limit(old) == context_limit(new) == 1024


def test_bad_overrides_are_clear_errors(capsys):
    from loomserve.cli import build_parser

    with pytest.raises(ValueError, match="not valid JSON"):
        parse_hf_overrides('{"rope_scaling": ')
    with pytest.raises(ValueError, match="must be a JSON object"):
        ModelConfig(hf_overrides="[1, 2]")
    assert ModelConfig(hf_overrides='{"a": {"b": 1}}').hf_overrides == {"a": {"b": 1}}
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--hf-overrides", "4.0"])
    assert e.value.code == 2
    assert "--hf-overrides: must be a JSON object" in capsys.readouterr().err


def test_kv_identity_names_the_overrides():
    """Scaled RoPE rotates every K differently: KV tiers and P/D transfers must not mix it with
    a plain run's KV of the same weights."""
    from types import SimpleNamespace

    from loomserve.engine.core import kv_model_name

    runner = SimpleNamespace(model_name="m")
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert kv_model_name(EngineConfig.from_kwargs(), runner) == "m"
    extended = kv_model_name(EngineConfig.from_kwargs(hf_overrides=yarn), runner)
    assert extended.startswith("m+") and "yarn" in extended


# --- the context limit ----------------------------------------------------------------------------

def _cfg(max_pos: int, scaling: dict | None = None, model_type: str = "llama") -> ArchConfig:
    return ArchConfig(model_type, 64, 2, 4, 2, 16, 128, 512, rope_scaling=scaling,
                      max_position_embeddings=max_pos)


def test_context_limit_per_scaling():
    assert context_limit(_cfg(8192)) == 8192
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    assert context_limit(_cfg(8192, yarn)) == 32768
    # DeepSeek-V3 / gpt-oss ship max_position_embeddings = original * factor; Qwen3 ships 40960
    # and documents yarn x4 over 32768 for 131072.
    assert context_limit(_cfg(163840, {**yarn, "factor": 40.0,
                                       "original_max_position_embeddings": 4096})) == 163840
    assert context_limit(_cfg(40960, {**yarn, "original_max_position_embeddings": 32768})) == 131072
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert context_limit(_cfg(131072, llama31)) == 131072  # already scaled
    assert context_limit(_cfg(4096, {"rope_type": "linear", "factor": 2.0})) == 8192
    assert context_limit(_cfg(4096, {"rope_type": "dynamic", "factor": 2.0})) == 8192
    gemma = _cfg(131072, {"rope_type": "linear", "factor": 8.0}, "gemma3_text")
    assert context_limit(gemma) == 131072  # Gemma 3's shipped linear is counted already (vLLM)
    gemma = _cfg(256, {"rope_type": "dynamic", "factor": 2.0}, "gemma3_text")
    assert context_limit(gemma) == 512  # an override's scaling counts as anywhere else


def test_context_length_accepts_scaled_logs_and_refuses(caplog):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    plain, scaled = _cfg(8192), _cfg(8192, yarn)
    assert context_length(None, plain) == 8192 and context_length(4096, plain) == 4096
    with caplog.at_level(logging.INFO, logger="loomserve.execution"):
        assert context_length(12400, scaled, trained=8192) == 12400
        assert context_length(None, scaled, trained=8192) == 32768
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "12400" in lines[0] and "trained 8192" in lines[0]
    assert "yarn" in lines[0] and "32768" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loomserve.execution"):
        context_length(8000, scaled, trained=8192)
    assert not caplog.records  # inside the trained length: nothing to say
    with pytest.raises(ValueError, match="--hf-overrides") as refused:
        context_length(12400, plain)
    # the override the error names is one that allows the length asked for
    text = str(refused.value)
    assert "no RoPE scaling" in text and "8192" in text
    suggested = json.loads(text.split("--hf-overrides '", 1)[1].split("'", 1)[0])
    cfg = ArchConfig.from_hf(merge_hf_overrides(_llama_dict(8192), suggested))
    assert context_length(12400, cfg, trained=8192) == 12400
    with pytest.raises(ValueError, match="yarn RoPE scaling, factor 4"):
        context_length(40000, scaled, trained=8192)


def _llama_dict(max_pos: int) -> dict:
    d = json.loads((FIXTURES / "tiny-llama" / "config.json").read_text())
    d["max_position_embeddings"] = max_pos
    d["rope_parameters"] = {"rope_theta": THETA, "rope_type": "default"}
    return d


def test_default_gguf_extends_at_read_time():
    """The built-in model (a GGUF, trained 8192): the override applies to the converted
    config as it is read; the conversion cache keeps the file's own."""
    from loomserve.execution.models.loading.loader import resolve_config, resolve_model

    cache = ModelConfig().resolved_cache_dir
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    _, own = resolve_config(None, cache)
    _, extended = resolve_config(None, cache, hf_overrides=yarn)
    assert context_limit(own) == 8192 and own.rope_scaling is None
    assert extended.rope_scaling["original_max_position_embeddings"] == 8192
    assert context_length(12400, extended, trained=8192) == 12400  # Claude Code's first prompt
    folder, _ = resolve_model(None, cache)
    with open(os.path.join(folder, "config.json")) as f:
        assert "rope_scaling" not in json.load(f)


# --- logits against transformers ------------------------------------------------------------------

def test_dynamic_is_transformers_at_the_longest_length():
    """The static base equals transformers' dynamic NTK at max_position_embeddings * factor,
    and (the choice documented in rotary.dynamic_ntk_base) not at shorter lengths."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from loomserve.execution.layers.rotary import rope_inv_freq

    d = _llama_dict(ORIGINAL)
    d["rope_parameters"] = {"rope_theta": THETA, "rope_type": "dynamic", "factor": 2.0}
    ours = rope_inv_freq(ArchConfig.from_hf(d))

    def hf_at(n: int) -> torch.Tensor:  # transformers' inv_freq for a sequence of n tokens
        return ROPE_INIT_FUNCTIONS["dynamic"](LlamaConfig(**d), "cpu", seq_len=n)[0]

    torch.testing.assert_close(ours, hf_at(2 * ORIGINAL), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, hf_at(ORIGINAL + 8))


@pytest.mark.parametrize("kind", list(CASES))
def test_logits_past_the_original_length_match_hf(short_llama, kind):
    from transformers import AutoModelForCausalLM

    from loomserve.execution.model_runner import ModelRunner

    override, hf_rope, n = CASES[kind]
    runner = ModelRunner(EngineConfig.from_kwargs(
        model=short_llama, dtype="float32", device="cpu", block_size=16, kv_cache_memory="2MB",
        hf_overrides=override))
    assert runner.max_model_len == 4 * ORIGINAL if kind != "dynamic" else 2 * ORIGINAL
    assert runner.model.rotary.cos.shape[0] == runner.max_model_len
    ref = AutoModelForCausalLM.from_pretrained(
        short_llama, dtype=torch.float32, rope_parameters={**hf_rope, "rope_theta": THETA}).eval()
    full = _tokens(n, 0)
    want = ref_logits(ref, full)
    blocks, table = Blocks(runner.block_size), []
    prompt = n - 4
    got = logits_of(runner, [seq("a", full[:prompt], 0, blocks.cover(table, prompt))])
    torch.testing.assert_close(got["a"], want[prompt - 1], atol=1e-4, rtol=1e-4)
    for pos in range(prompt, n):  # decode steps, all past the original 32
        got = logits_of(runner, [seq("a", [full[pos]], pos, blocks.cover(table, pos + 1))])
        torch.testing.assert_close(got["a"], want[pos], atol=1e-4, rtol=1e-4)
    plain = AutoModelForCausalLM.from_pretrained(short_llama, dtype=torch.float32).eval()
    assert not torch.allclose(ref_logits(plain, full)[-1], want[-1], atol=1e-2)  # scaling bites


# --- the engine -----------------------------------------------------------------------------------

def test_engine_runs_a_prompt_past_the_original_only_when_extended(short_llama):
    from transformers import AutoModelForCausalLM

    opts = dict(dtype="float32", device="cpu", block_size=16, kv_cache_memory="2MB")
    prompt, greedy = _tokens(60, 1), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    yarn, hf_rope, _ = CASES["yarn"]
    with pytest.raises(ValueError, match="--hf-overrides"):
        LLM(short_llama, max_model_len=80, **opts)
    plain = LLM(short_llama, **opts)
    with pytest.raises(ValueError, match="60 tokens"):
        plain.generate(prompt, greedy)
    llm = LLM(short_llama, hf_overrides=json.dumps(yarn), max_model_len=80, **opts)
    out = llm.generate(prompt, greedy)[0].token_ids
    ref = AutoModelForCausalLM.from_pretrained(
        short_llama, dtype=torch.float32, rope_parameters={**hf_rope, "rope_theta": THETA}).eval()
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 60:].tolist()
    assert out == hf
