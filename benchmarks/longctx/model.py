"""The benchmark's tiny long-context Llama, built once and cached under benchmarks/.cache/.

2 layers, hidden 128, 4 query heads and 1 KV head of 32, intermediate 512, rope theta 1e6,
262144 positions, seeded random weights, SmolLM2's vocabulary and tokenizer (copied from the HF
folder loomserve converts its built-in GGUF into). Saved as an HF folder (LlamaForCausalLM via
transformers) and converted to an f32 GGUF with llama.cpp's own convert_hf_to_gguf.py, so both
servers run the same weights.

Invariants: a finished build leaves a `DONE` marker; a folder without it is rebuilt from
scratch, so an interrupted build is never used. KV bytes per token (fp32) = 2 layers x 2 (K, V)
x 1 head x 32 x 4 = 512.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

from common import BENCH_DIR, PEERS_DIR

__all__ = ["CONFIG", "KV_BYTES_PER_TOKEN", "build", "model_paths"]

CACHE_DIR = os.path.join(BENCH_DIR, ".cache", "long_context")
SEED = 1234
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 512,
    "rope_theta": 1e6, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "float32",
}
KV_BYTES_PER_TOKEN = (CONFIG["num_hidden_layers"] * 2 * CONFIG["num_key_value_heads"]
                      * CONFIG["head_dim"] * 4)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def model_paths() -> tuple[str, str]:
    """(HF folder, GGUF file) of the cached model."""
    return os.path.join(CACHE_DIR, "hf"), os.path.join(CACHE_DIR, "tiny-longctx-f32.gguf")


def _smollm2_folder() -> str:
    from loomserve.config.model import ModelConfig
    from loomserve.execution.models.loading.loader import resolve_model

    folder, _ = resolve_model(None, ModelConfig().resolved_cache_dir)
    return folder


def _build_hf(folder: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = _smollm2_folder()
    with open(os.path.join(src, "config.json")) as f:
        base = json.load(f)
    cfg = dict(CONFIG, vocab_size=base["vocab_size"], bos_token_id=base.get("bos_token_id"),
               eos_token_id=base.get("eos_token_id"))
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32).eval()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), folder)


def llama_cpp_dir() -> str:
    found = sorted(glob.glob(os.path.join(PEERS_DIR, "src", "*", "vendor", "llama.cpp")))
    if not found or not os.path.exists(os.path.join(found[-1], "convert_hf_to_gguf.py")):
        raise FileNotFoundError("llama.cpp sources missing: run benchmarks/peers/build_llama_server.sh")
    return found[-1]


def _convert(folder: str, gguf: str) -> None:
    """llama.cpp's own converter (its vendored gguf-py first on the path), f32 out. It imports
    sentencepiece before it looks for tokenizer.model (absent here: SmolLM2 is BPE), so that
    package is pip-installed into benchmarks/.peers/convert-deps rather than loomserve's venv."""
    src = llama_cpp_dir()
    deps = os.path.join(PEERS_DIR, "convert-deps")
    if not os.path.isdir(os.path.join(deps, "sentencepiece")):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", deps,
                        "sentencepiece"], check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(src, "gguf-py"), deps]))
    subprocess.run([sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), folder,
                    "--outfile", gguf + ".part", "--outtype", "f32"], check=True, env=env)
    os.replace(gguf + ".part", gguf)


def build(force: bool = False) -> tuple[str, str]:
    """Build (or reuse) the HF folder and its GGUF; returns (HF folder, GGUF path)."""
    folder, gguf = model_paths()
    done = os.path.join(CACHE_DIR, "DONE")
    if os.path.exists(done) and not force:
        return folder, gguf
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
    os.makedirs(CACHE_DIR)
    _build_hf(folder)
    _convert(folder, gguf)
    with open(done, "w") as f:
        f.write(json.dumps({"seed": SEED, **CONFIG}) + "\n")
    return folder, gguf
