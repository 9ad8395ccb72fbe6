"""Quantized kernels vs the dequantized model: per-token greedy agreement and logit differences.

For the default model (SmolLM2-135M-Instruct Q4_1 GGUF) or --model, the reference is the GGUF
dequantized to fp32 (``--quantization none``); each mode (gguf: the file's own blocks; int8 /
int4 / fp8: the dequantized weights re-quantized at load; fp8 runs torch's reference fp8
products on a CPU, the CUDA path's numerics, slowly) runs the same chat prompts:

  teacher-forced agreement  the reference's greedy continuation (--new-tokens) is fed to both
                            models; the share of positions whose argmax agrees
  max / mean |dlogit|       over those positions and the whole vocabulary
  rel. L2                   mean over positions of |l_q - l_ref| / |l_ref|
  free-run match            the mean length of the common prefix of both models' own greedy
                            continuations (a near-tie flipped once parts them for good)

A mode `kv=DTYPE` (e.g. kv=bfloat16, kv=fp8_e4m3, kv=fp8_e5m2) keeps the reference's fp32
weights and stores K/V in DTYPE (--kv-cache-dtype): the KV cache's rounding alone.

Run:  python benchmarks/quant_agreement.py [--modes gguf int8 int4 fp8 kv=fp8_e4m3] [--new-tokens 32] [--prompts 8]
Output: a table, and benchmarks/results/quant_agreement.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import host_info, write_json  # noqa: E402

from loomserve.config import EngineConfig  # noqa: E402
from loomserve.execution.batch import ModelInput, ScheduledSeq  # noqa: E402
from loomserve.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "def fibonacci(n):", "Explain photosynthesis in two sentences.", "Translate 'good morning' to Spanish.",
    "Give me a recipe for pancakes.", "Why is the sky blue?", "Summarize the plot of Hamlet.",
    "What are the benefits of exercise?", "Write a short poem about autumn.", "How do airplanes fly?",
]
GREEDY = SamplingParams(temperature=0.0)


def build_runner(model: str | None, mode: str):
    """mode: a --quantization value, or kv=DTYPE (fp32 weights, K/V stored in DTYPE)."""
    from loomserve.execution.model_runner import ModelRunner

    kv = mode.removeprefix("kv=") if mode.startswith("kv=") else "auto"
    return ModelRunner(EngineConfig.from_kwargs(
        model=model, dtype="float32", device="cpu", kv_cache_memory="64MB", kv_cache_dtype=kv,
        quantization="none" if mode.startswith("kv=") else mode))


def run_logits(r, prompt: list[int], cont: list[int] | int) -> tuple[list[int], torch.Tensor]:
    """(continuation, logits before each of its tokens): teacher-forced on `cont`, or greedy
    for `cont` tokens when it is an int. Fresh KV blocks from 0 each call."""
    n = cont if isinstance(cont, int) else len(cont)
    table = list(range(-(-(len(prompt) + n) // r.block_size)))

    def step(tokens: list[int], start: int) -> torch.Tensor:
        s = ScheduledSeq("r", list(tokens), start, [table], True, GREEDY, 0)
        return r.compute_logits(ModelInput([s]))[1][0]

    rows, toks = [step(prompt, 0)], []
    for i in range(n):
        toks.append(int(rows[-1].argmax()) if isinstance(cont, int) else cont[i])
        if i < n - 1:
            rows.append(step([toks[-1]], len(prompt) + i))
    return toks, torch.stack(rows)


def compare(q, prompts: list[list[int]], refs: list[tuple[list[int], torch.Tensor]],
            new_tokens: int) -> dict:
    """refs: the reference's (greedy continuation, logits) per prompt."""
    agree = total = 0
    max_d, mean_d, rel, common = 0.0, [], [], []
    for p, (cont, a) in zip(prompts, refs):
        b = run_logits(q, p, cont)[1]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(cont)
        d = (a - b).abs()
        max_d = max(max_d, d.max().item())
        mean_d.append(d.mean().item())
        rel.append(((a - b).norm(dim=-1) / a.norm(dim=-1)).mean().item())
        own = run_logits(q, p, new_tokens)[0]
        common.append(next((i for i, (x, y) in enumerate(zip(cont, own)) if x != y), len(cont)))
    return {"teacher_forced_agreement": agree / total, "positions": total, "max_abs_dlogit": max_d,
            "mean_abs_dlogit": statistics.mean(mean_d), "rel_l2": statistics.mean(rel),
            "free_run_common_prefix": statistics.mean(common)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the built-in model)")
    ap.add_argument("--modes", nargs="+", default=["gguf", "int8", "int4", "fp8"])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (numerics only here; 1 avoids OpenMP waits on a busy host)")
    ap.add_argument("--out", default="quant_agreement.json", help="result file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from loomserve.engine.tokenizer import Tokenizer

    ref = build_runner(args.model, "none")
    tok = Tokenizer.from_folder(ref.model_folder, ref.model_config.eos_token_ids)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))
               for t in PROMPTS[:args.prompts]]
    out = {"host": host_info(), "model": ref.model_name, "reference": "the GGUF dequantized to fp32",
           "command": " ".join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "results": {}}
    refs = [run_logits(ref, p, args.new_tokens) for p in prompts]
    print(f"{'mode':12} {'agree':>7} {'max|dl|':>8} {'mean|dl|':>9} {'rel L2':>7} {'free-run':>8} {'MB':>7}")
    for mode in args.modes:
        q = build_runner(args.model, mode)
        rec = compare(q, prompts, refs, args.new_tokens)
        rec["weight_bytes"] = q.weight_bytes
        out["results"][mode] = rec
        print(f"{mode:12} {rec['teacher_forced_agreement']:7.3f} {rec['max_abs_dlogit']:8.3f} "
              f"{rec['mean_abs_dlogit']:9.4f} {rec['rel_l2']:7.4f} {rec['free_run_common_prefix']:8.1f} "
              f"{q.weight_bytes / 1e6:7.1f}")
        del q
    out["reference_weight_bytes"] = ref.weight_bytes
    print("wrote", write_json(args.out, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
