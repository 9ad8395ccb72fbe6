"""Tensor parallelism on a GPU node: greedy outputs at 1 rank vs N ranks (NCCL), one model.

For a node lent with >= 2 GPUs (NCCL refuses two ranks on one device): runs the same prompts
greedily (ignore_eos) through `LLM` at tensor_parallel_size 1 and N, reports the share of
prompts whose token ids are all equal and where each differing pair first parts (the
all-reduce sums in another order than one matmul: a late near-tie may flip, an early one is a
bug), prefix-cache hits of a second round (must be equal), the KV blocks per rank, and the
decode step time at both sizes. Exit 0 when all agree, 1 when not, 3 when fewer than N GPUs.
`--cpu` runs the same on CPU with gloo (tiny-llama, fp32) to prove the script here.

    python benchmarks/gpu_tp_check.py [--model PATH] [--tp 2] [--out gpu_tp_check.json]
    python benchmarks/gpu_tp_check.py --cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
FIXTURE = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "tiny-llama")

from common.host import host_info  # noqa: E402
from common.results import write_json  # noqa: E402


def run(model: str, tp: int, device: str, dtype: str, prompts: list[list[int]], max_tokens: int
        ) -> dict:
    from loomserve.engine.llm import LLM
    from loomserve.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, device=device, dtype=dtype)
    start_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        first = llm.generate(prompts, sp)
        gen_s = time.perf_counter() - t0
        second = llm.generate([p + [5] for p in prompts], sp)
        return {"tokens": [o.token_ids for o in first],
                "cached": [o.num_cached_tokens for o in second],
                "kv_blocks": llm.core.kv.num_blocks, "start_s": start_s,
                "generate_s": gen_s}
    finally:
        llm.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out", default=None,
                   help="result file (default: gpu_tp_check.json, gpu_tp_check-cpu.json with --cpu)")
    args = p.parse_args()
    if args.cpu:
        device, dtype, model = "cpu", "float32", args.model or FIXTURE
        os.environ.setdefault("LOOMSERVE_NUM_THREADS", "1")
    else:
        import torch
        if torch.cuda.device_count() < args.tp:
            print(f"gpu_tp_check: needs {args.tp} CUDA devices, found "
                  f"{torch.cuda.device_count()}", file=sys.stderr)
            return 3
        device, dtype, model = "cuda", "float32", args.model or FIXTURE
    prompts = [[(17 * i + 31 * j) % 400 + 3 for j in range(args.prompt_len)]
               for i in range(args.prompts)]
    one = run(model, 1, device, dtype, prompts, args.max_tokens)
    many = run(model, args.tp, device, dtype, prompts, args.max_tokens)
    parts = []
    for a, b in zip(one["tokens"], many["tokens"]):
        parts.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
    agree = sum(x is None for x in parts) / len(parts)
    result = {"host": host_info(), "model": model, "device": device, "tp": args.tp,
              "agreement": agree, "first_difference": parts,
              "cached_equal": one["cached"] == many["cached"],
              "kv_blocks": {"tp1": one["kv_blocks"], f"tp{args.tp}": many["kv_blocks"]},
              "generate_s": {"tp1": one["generate_s"], f"tp{args.tp}": many["generate_s"]},
              "start_s": {"tp1": one["start_s"], f"tp{args.tp}": many["start_s"]}}
    print(json.dumps(result, indent=2))
    write_json(args.out or ("gpu_tp_check-cpu.json" if args.cpu else "gpu_tp_check.json"), result)
    return 0 if agree == 1.0 and result["cached_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
