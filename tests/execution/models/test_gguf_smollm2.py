"""The built-in SmolLM2 GGUF: our dequantized, un-permuted weights driven through ModelRunner must
generate exactly what transformers' greedy generate() does on the same converted checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loomserve.execution.batch import ModelInput
from loomserve.execution.models.loading.gguf import unpermute_rope_rows
from tests.execution.models.conftest import Blocks, seq

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.", "def fibonacci(n):"]
NEW_TOKENS = 20


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter: per head, rows [half0 | half1] -> interleaved pairs.
    n_heads, head_dim, cols = 3, 8, 5
    w = np.arange(n_heads * head_dim * cols, dtype=np.float32).reshape(n_heads * head_dim, cols)
    permuted = w.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_heads), w)


@pytest.fixture(scope="module")
def smol_runner(smol_dense):
    """The default model on the dequantized path (quantization "none"; auto runs the blocks in
    place), from the default cache dir: the conversion is shared with every other test and the
    server."""
    pytest.importorskip("gguf")
    return smol_dense


@pytest.fixture(scope="module")
def smol_tok(smol_runner):
    from loomserve.engine.tokenizer import Tokenizer

    return Tokenizer.from_folder(smol_runner.model_folder, smol_runner.model_config.eos_token_ids)


def test_default_model_identity(smol_runner, smol_tok):
    r = smol_runner
    assert r.model_name == "SmolLM2-135M-Instruct"
    assert r.max_model_len == 8192 and r.vocab_size == 49152
    im_end = smol_tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and im_end[0] in smol_tok.eos_token_ids


def test_greedy_matches_hf_generate(smol_runner, smol_tok):
    from transformers import LlamaForCausalLM

    r, tok = smol_runner, smol_tok
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    blocks = Blocks(r.block_size)
    tables = [blocks.cover([], len(p)) for p in prompts]
    # One batch: all prompts prefill together, then decode together.
    seqs = [seq(f"r{i}", p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))]
    ours = [[] for _ in prompts]
    for _ in range(NEW_TOKENS):
        out = r.execute(ModelInput(seqs))
        nxt = []
        for i, s in enumerate(seqs):
            tokn = out.sampled[s.request_id]
            ours[i].append(tokn)
            pos = s.start_pos + len(s.token_ids)
            nxt.append(seq(s.request_id, [tokn], pos, blocks.cover(tables[i], pos + 1)))
        seqs = nxt

    ref = LlamaForCausalLM.from_pretrained(r.model_folder, dtype=torch.float32).eval()
    for p, mine in zip(prompts, ours):
        with torch.no_grad():
            hf = ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert mine == hf, (tok.decode(mine), tok.decode(hf))


def test_restart_reuses_converted_folder(smol_runner, monkeypatch):
    from loomserve.execution.models.loading import gguf as gguf_loader
    from loomserve.execution.models.loading.default import default_model_path

    def no_conversion(*_):
        raise AssertionError("a restart must not dequantize again")

    monkeypatch.setattr(gguf_loader, "convert_gguf", no_conversion)
    folder = gguf_loader.cached_conversion(default_model_path(), smol_runner.config.model.resolved_cache_dir)
    assert folder == smol_runner.model_folder
