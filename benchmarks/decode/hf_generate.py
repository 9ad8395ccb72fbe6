"""transformers' generate() as a system of the decode benchmark (the reference implementation).

The weights are loomserve's converted-weights cache when it holds an HF folder for this model
(matched on the architecture numbers), else transformers' own GGUF dequantisation. One round is
one batch of C prompts through generate(), timed from the first logits (a logits processor
stamps the end of the prefill forward) to generate() returning.

Invariant: tokens = C * (max_tokens - 1), and a round that generated another count is reported
with an error.
"""

from __future__ import annotations

import json
import os
import sys
import time

from common import DecodeMeasurement, ModelFacts, torch_threads

__all__ = ["find_converted_hf_dir", "load_hf_model", "HFGenerate"]


def find_converted_hf_dir(facts: ModelFacts, cache_dir: str | None = None) -> str | None:
    """An HF-format folder (config.json + safetensors/bin) for this model inside loomserve's
    converted-weights cache, or None. Matched on the architecture numbers, not on names."""
    root = cache_dir or os.environ.get("LOOMSERVE_CACHE",
                                       os.path.join(os.path.expanduser("~"), ".cache", "loomserve"))
    if not os.path.isdir(root):
        return None
    best = None
    for dirpath, _dirs, files in os.walk(root):
        if "config.json" not in files:
            continue
        if not any(f.endswith((".safetensors", ".bin")) for f in files):
            continue
        try:
            with open(os.path.join(dirpath, "config.json")) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            continue
        if (cfg.get("num_hidden_layers") == facts.n_layers
                and cfg.get("hidden_size") == facts.hidden
                and cfg.get("num_key_value_heads", cfg.get("num_attention_heads")) == facts.n_kv_heads
                and cfg.get("vocab_size") == facts.vocab):
            mtime = os.path.getmtime(os.path.join(dirpath, "config.json"))
            if best is None or mtime > best[0]:
                best = (mtime, dirpath)
    return best[1] if best else None


def load_hf_model(gguf_path: str, facts: ModelFacts, dtype_name: str):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    src = find_converted_hf_dir(facts)
    t0 = time.perf_counter()
    if src:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
        origin = f"loomserve cache: {src}"
    else:
        model = _dequantise_gguf(gguf_path, dtype)
        origin = f"transformers GGUF dequantisation: {gguf_path}"
    model.eval()
    print(f"[hf-generate] loaded in {time.perf_counter() - t0:.1f}s from {origin}",
          file=sys.stderr, flush=True)
    return model, origin


def _dequantise_gguf(gguf_path: str, dtype):
    """An HF model from a GGUF via transformers' own GGUF converter (dequantise, rename,
    un-permute Q/K). Equivalent to ``from_pretrained(dir, gguf_file=...)``, which insists
    on ``accelerate`` being installed; this does the same steps without it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    res = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    allowed = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(res.missing_keys) - allowed or res.unexpected_keys:
        raise RuntimeError(f"GGUF -> HF mismatch: missing {res.missing_keys}, "
                           f"unexpected {res.unexpected_keys}")
    model.tie_weights()
    return model.to(dtype)


class HFGenerate:
    """transformers' generate() as a system of the interleaved loop: one round = one batch of
    C prompts through generate(), timed from the first logits (a logits processor stamps the
    end of the prefill forward) to generate() returning; tokens = C * (max_tokens - 1)."""

    def __init__(self, model, tokenizer, threads: int) -> None:
        self.model, self.threads = model, threads
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def _generate(self, prompts: list[list[int]], n: int):
        import torch
        from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

        class FirstTokenClock(LogitsProcessor):
            def __init__(self) -> None:
                self.t_first: float | None = None

            def __call__(self, input_ids, scores):
                if self.t_first is None:
                    self.t_first = time.perf_counter()
                return scores

        with torch_threads(self.threads), torch.inference_mode():
            ids = torch.tensor(prompts, dtype=torch.long)
            clock = FirstTokenClock()
            cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                   eos_token_id=None, pad_token_id=self.pad, use_cache=True)
            t_sent = time.perf_counter()
            seqs = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg,
                                       logits_processor=LogitsProcessorList([clock]))
            return t_sent, clock.t_first, time.perf_counter(), seqs.shape[1] - ids.shape[1]

    def warm_up(self, prompts: list[list[int]]) -> None:
        self._generate(prompts, 8)

    def measure(self, prompts: list[list[int]], max_tokens: int, label: str) -> DecodeMeasurement:
        c = len(prompts)
        t_sent, t_first, t_end, new = self._generate(prompts, max_tokens)
        tokens, window = c * (new - 1), t_end - t_first
        m = DecodeMeasurement(concurrency=c, decode_tokens=tokens, window_s=window,
                              tok_per_s=tokens / window, total_tokens=c * new,
                              ttft_s=[round(t_first - t_sent, 4)])
        if new != max_tokens:
            m.errors.append(f"generated {new} tokens, not {max_tokens}")
        print(f"[hf-generate] {label}: {m.tok_per_s:8.1f} tok/s ({tokens} tokens in {window:.2f}s)",
              file=sys.stderr, flush=True)
        return m
