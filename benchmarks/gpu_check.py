"""One-shot check of loomserve on an NVIDIA GPU (under 10 minutes): correctness, then speed.

Parts (--parts, all by default), in this order:
  tests       the CUDA-relevant test files (CUDA_TESTS) by pytest on the device: the Triton
              attention backend against the dense reference, the host tier's pinned round trip
  attention   attention alone, triton vs torch backends (benchmarks/gpu_attention.py)
  models      per model, below
  fp8         the fp8 check, below

For each model, the built-in default model first (SmolLM2-135M-Instruct), then each fixture in tests/fixtures/ (every folder with a config.json) (every folder of tests/fixtures with a config.json):
  agreement   greedy outputs (same prompts, ignore_eos, fp32 on both sides) on CUDA vs CPU:
              the share of prompts whose token ids are all equal, and the first position
              where each differing pair parts (fp32 kernels differ in summation order, so a
              late near-tie can flip; an early one is a bug)
  speed       on CUDA in bf16 (dtype auto): prefill tok/s (--prefill-streams prompts of
              --prompt-len tokens, max_tokens 1) and decode tok/s at 1 and --streams streams:
              decode tok/s = streams * (n - 1) / (t(n tokens) - t(1 token)), every call on
              fresh random prompts with prefix caching off, so both times hold the same prefill
  limits      beside them: decode tok/s <= streams * HBM bandwidth / weight bytes (bandwidth of
              a measured device-to-device copy), prefill tok/s <= matmul rate / (2 * params)
              (a measured bf16 torch.mm rate); KV reads are left out, so these are ceilings
  graphs      --graph-models (the default model) with --cuda-graphs: greedy outputs (bf16)
              equal to the eager engine's, whether the graphs were captured, decode speed
  fp8         --fp8-models (the default model) with --quantization fp8: whether fp8 tensor-core
              products run (sm_89+), greedy agreement with the unquantized model, speed

Exit status: 0 when every model ran and every CUDA/CPU pair agreed, 1 when something failed or
disagreed, 3 (with one line on stderr, no traceback, no JSON written) when no CUDA device is
present. `--cpu-only` runs the same logic with the CPU standing in for the GPU (fp32, small
sizes, tiny-llama by default) to prove the script on a machine without one.

Run:    python benchmarks/gpu_check.py [--models tiny-llama default] [--out gpu_check.json]
        python benchmarks/gpu_check.py --cpu-only       # dry run here: results/gpu_check-cpu.json
Needs:  the loomserve venv with a CUDA build of torch (for the real run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO_ROOT, host_info, write_json  # noqa: E402

NO_CUDA_EXIT = 3
FIXTURES_DIR = os.path.join(REPO_ROOT, "tests", "fixtures")
AGREE_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
                 "1, 2, 3, 4,", "The quick brown fox", "In the beginning"]


CUDA_TESTS = ["tests/execution/test_triton_attention.py",
              "tests/kv/tiers/test_store.py::test_cuda_pool_round_trip"]
PARTS = ("tests", "attention", "models", "graphs", "fp8")


def model_names() -> list[str]:
    found = sorted(d for d in os.listdir(FIXTURES_DIR)
                   if os.path.exists(os.path.join(FIXTURES_DIR, d, "config.json")))
    return ["default"] + found


def cuda_tests(timeout_s: float) -> dict[str, Any]:
    """pytest over CUDA_TESTS in a child process; its summary line and exit status."""
    import subprocess

    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *CUDA_TESTS], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=timeout_s)
        lines = (p.stdout or p.stderr).strip().splitlines()
        out = {"returncode": p.returncode, "summary": lines[-1] if lines else "",
               "failures": [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:10]}
    except subprocess.TimeoutExpired:
        out = {"returncode": None, "summary": f"timed out after {timeout_s:.0f} s"}
    out.update(files=CUDA_TESTS, wall_s=round(time.perf_counter() - t0, 1))
    print(f"[gpu_check] tests: {json.dumps(out)}", file=sys.stderr, flush=True)
    return out


def attention_part() -> dict[str, Any]:
    import gpu_attention

    try:
        return gpu_attention.measure_all()
    except Exception as e:  # noqa: BLE001 - reported; the other parts stand
        return {"error": f"{type(e).__name__}: {e}"}


def model_path(name: str) -> str | None:
    return None if name == "default" else os.path.join(FIXTURES_DIR, name)


def make_llm(name: str, device: str, dtype: str, kv: str, **extra):
    from loomserve import LLM

    return LLM(model_path(name), device=device, dtype=dtype, kv_cache_memory=kv, **extra)


def release(llm, device: str) -> None:
    """Drop an engine and give its device memory back before the next one loads."""
    import torch

    llm.close()
    del llm
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def greedy(llm, prompts: Sequence[Any], n: int) -> list[list[int]]:
    from loomserve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(list(prompts), sp)]


def agreement(name: str, device: str, ref_device: str, n: int, kv: str) -> dict[str, Any]:
    """Greedy token ids on ``device`` vs ``ref_device``, fp32 on both."""
    outs = {}
    for dev in (device, ref_device):
        llm = make_llm(name, dev, "float32", kv)
        outs[dev] = greedy(llm, AGREE_PROMPTS, n)
        release(llm, dev)
    parted = []
    for a, b in zip(outs[device], outs[ref_device]):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                     None if len(a) == len(b) else min(len(a), len(b)))
        parted.append(first)
    equal = sum(p is None for p in parted)
    return {"prompts": len(AGREE_PROMPTS), "tokens": n, "equal": equal,
            "agree_rate": round(equal / len(AGREE_PROMPTS), 3),
            "first_difference_at": [p for p in parted if p is not None]}


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    low = min(100, vocab // 2)  # past the special tokens most tokenizers put first
    return torch.randint(low, vocab, (count, length), generator=g).tolist()


def timed(llm, prompts: list[list[int]], n: int, sync) -> float:
    from loomserve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    sync()
    dt = time.perf_counter() - t0
    short = [len(o.token_ids) for o in outs if len(o.token_ids) != n]
    if short:
        raise RuntimeError(f"{len(short)} outputs stopped short of {n} tokens: {short[:4]}")
    return dt


def speed(name: str, device: str, dtype: str, args, hw: dict[str, float],
          **extra) -> dict[str, Any]:
    """Prefill and decode rates on ``device`` in ``dtype``, beside their limits."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    llm = make_llm(name, device, dtype, args.kv_memory, enable_prefix_caching=False,
                   max_num_seqs=max(args.streams, args.prefill_streams), **extra)
    ready = llm.core.ready()
    plen = min(args.prompt_len, ready.max_model_len // 2)
    gen = min(args.decode_tokens, ready.max_model_len - plen - 1)
    seed = iter(range(10_000, 1_000_000, 97))
    out: dict[str, Any] = {"dtype": ready.dtype, "num_params": ready.num_params,
                           "weight_bytes": ready.weight_bytes, "prompt_len": plen,
                           "decode_tokens": gen, "decode": {}}
    try:
        timed(llm, random_prompts(2, plen, ready.vocab_size, next(seed)), 4, sync)  # warm-up
        ps = random_prompts(args.prefill_streams, plen, ready.vocab_size, next(seed))
        t = timed(llm, ps, 1, sync)
        out["prefill"] = {"streams": len(ps), "tok_per_s": round(len(ps) * plen / t, 1),
                          "flop_limit_tok_per_s": round(hw["matmul_tflops"] * 1e12
                                                        / (2 * ready.num_params), 1)}
        for c in sorted({1, args.streams}):
            t1 = timed(llm, random_prompts(c, plen, ready.vocab_size, next(seed)), 1, sync)
            tn = timed(llm, random_prompts(c, plen, ready.vocab_size, next(seed)), gen, sync)
            # None: the difference drowned in noise (a run too short to measure)
            rate = c * (gen - 1) / (tn - t1) if tn > t1 else None
            limit = c * hw["bandwidth_gbs"] * 1e9 / ready.weight_bytes
            out["decode"][str(c)] = {"tok_per_s": rate and round(rate, 1),
                                     "bandwidth_limit_tok_per_s": round(limit, 1),
                                     "pct_of_limit": rate and round(100 * rate / limit, 1)}
    finally:
        release(llm, device)
    return out


def fp8_check(name: str, args, hw) -> dict[str, Any]:
    """--quantization fp8 on the device: which product runs (w8a8: fp8 tensor cores via
    torch._scaled_mm; else weight-only), greedy agreement with the same model unquantized in
    the same dtype (reported, not required: fp8 rounding may flip a near-tie), and its speed."""
    import torch

    from loomserve.execution.layers.fp8 import scaled_mm_ok

    dtype = args.dtype if args.dtype != "auto" else (
        "bfloat16" if args.device.startswith("cuda") else "float32")
    entry: dict[str, Any] = {"model": name, "quantization": "fp8", "dtype": dtype}
    try:
        entry["w8a8"] = scaled_mm_ok(torch.device(args.device), getattr(torch, dtype))
        outs = {}
        for q in ("none", "fp8"):
            llm = make_llm(name, args.device, dtype, args.kv_memory, quantization=q)
            outs[q] = greedy(llm, AGREE_PROMPTS, args.agree_tokens)
            release(llm, args.device)
        same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                for a, b in zip(outs["none"], outs["fp8"])]
        entry["agreement"] = {"prompts": len(same), "tokens": args.agree_tokens,
                              "equal": sum(n == args.agree_tokens for n in same),
                              "mean_common_prefix": round(sum(same) / len(same), 1)}
        entry["speed"] = speed(name, args.device, dtype, args, hw, quantization="fp8")
    except Exception as e:  # noqa: BLE001 - reported; the other checks stand
        entry["errors"] = [f"{type(e).__name__}: {e}"]
    print(f"[gpu_check] fp8 {name}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    return entry


def graphs_check(name: str, args, hw) -> dict[str, Any]:
    """--cuda-graphs against the eager engine on the device, same dtype: greedy agreement
    (required: the same kernels run, replayed), whether capture succeeded, and speed."""
    dtype = args.dtype if args.dtype != "auto" else "bfloat16"
    entry: dict[str, Any] = {"model": name, "dtype": dtype}
    try:
        outs = {}
        for graphs in (False, True):
            llm = make_llm(name, args.device, dtype, args.kv_memory, cuda_graphs=graphs,
                           max_num_seqs=len(AGREE_PROMPTS))
            if graphs:
                g = llm.core.runner.graphs
                entry["captured_sizes"] = None if g is None else g.sizes
            outs[graphs] = greedy(llm, AGREE_PROMPTS, args.agree_tokens)
            release(llm, args.device)
        entry["equal"] = sum(a == b for a, b in zip(outs[False], outs[True]))
        entry["prompts"] = len(AGREE_PROMPTS)
        entry["speed"] = speed(name, args.device, dtype, args, hw, cuda_graphs=True)
    except Exception as e:  # noqa: BLE001 - reported; the other checks stand
        entry["errors"] = [f"{type(e).__name__}: {e}"]
    print(f"[gpu_check] graphs {name}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    return entry


def measure_hardware(device: str, dtype: str) -> dict[str, Any]:
    """Copy bandwidth (read + write bytes / time) and a large matmul's rate on ``device``."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    dt = getattr(torch, dtype if dtype != "auto" else "bfloat16")
    size, n = (1 << 30, 8192) if device.startswith("cuda") else (1 << 28, 1024)
    bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
    mats = [torch.randn(n, n, device=device, dtype=dt) for _ in range(2)]

    def best(fn, reps: int = 5) -> float:
        fn()
        sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return min(times)

    bw = 2 * size / best(lambda: bufs[1].copy_(bufs[0])) / 1e9
    tflops = 2 * n ** 3 / best(lambda: torch.mm(mats[0], mats[1])) / 1e12
    return {"bandwidth_gbs": round(bw, 1), "matmul_tflops": round(tflops, 2),
            "matmul_dtype": str(dt).replace("torch.", ""), "device_name": device_name(device)}


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return host_info()["cpu"]


def check_model(name: str, args, device: str, ref: str, hw) -> dict[str, Any]:
    entry: dict[str, Any] = {"model": name}
    t0 = time.perf_counter()
    for part, fn in (("agreement", lambda: agreement(name, device, ref, args.agree_tokens,
                                                      args.kv_memory)),
                     ("speed", lambda: speed(name, device, args.dtype, args, hw))):
        try:
            entry[part] = fn()
        except Exception as e:  # noqa: BLE001 - one model's failure is reported, the rest run
            entry.setdefault("errors", []).append(f"{part}: {type(e).__name__}: {e}")
    entry["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"[gpu_check] {name}: {json.dumps({k: v for k, v in entry.items() if k != 'model'})}",
          file=sys.stderr, flush=True)
    return entry


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-only", action="store_true",
                    help="dry run: the CPU stands in for the GPU (fp32, small sizes)")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                    help="which parts run (default: all; --cpu-only runs models and fp8)")
    ap.add_argument("--models", nargs="+", default=None,
                    help="fixture names and/or 'default' (all; tiny-llama with --cpu-only)")
    ap.add_argument("--graph-models", nargs="*", default=["default"],
                    help="models also run with --cuda-graphs (default: the default model)")
    ap.add_argument("--fp8-models", nargs="*", default=None,
                    help="models also run with --quantization fp8 (default: the default model; "
                         "tiny-llama with --cpu-only)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="speed dtype (auto: bf16 on CUDA)")
    ap.add_argument("--streams", type=int, default=None, help="decode streams (64; 4 on CPU)")
    ap.add_argument("--prefill-streams", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=None)
    ap.add_argument("--agree-tokens", type=int, default=None)
    ap.add_argument("--kv-memory", default=None)
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="skip the remaining models past this many seconds")
    ap.add_argument("--out", default=None, help="result file name under benchmarks/results/")
    args = ap.parse_args(argv)
    cpu = args.cpu_only
    for key, gpu_v, cpu_v in (("streams", 64, 4), ("prefill_streams", 64, 4),
                              ("prompt_len", 512, 32), ("decode_tokens", 64, 8),
                              ("agree_tokens", 32, 8), ("kv_memory", "4GiB", "64MiB"),
                              ("dtype", "auto", "float32"),
                              ("out", "gpu_check.json", "gpu_check-cpu.json")):
        if getattr(args, key) is None:
            setattr(args, key, cpu_v if cpu else gpu_v)
    args.models = args.models or (["tiny-llama"] if cpu else model_names())
    if args.fp8_models is None:
        args.fp8_models = ["tiny-llama"] if cpu else ["default"]
    if cpu:
        args.device = "cpu"
        args.parts = [p for p in args.parts if p in ("models", "fp8")]  # no graphs on a CPU
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.cpu_only and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, "
              f"torch.cuda.is_available() is False); nothing checked, no result written. "
              f"Use --cpu-only for a dry run on the CPU.", file=sys.stderr)
        return NO_CUDA_EXIT
    hw = measure_hardware(args.device, args.dtype)
    print(f"[gpu_check] {args.device} ({hw['device_name']}): {hw}", file=sys.stderr, flush=True)
    t0, results, fp8 = time.perf_counter(), [], []
    tests = cuda_tests(150) if "tests" in args.parts else None
    attention = attention_part() if "attention" in args.parts else None
    for name in args.models if "models" in args.parts else []:
        if time.perf_counter() - t0 > args.budget_s:
            results.append({"model": name, "errors": ["skipped: past --budget-s"]})
            continue
        results.append(check_model(name, args, args.device, "cpu", hw))
    graphs = [graphs_check(name, args, hw) for name in args.graph_models] \
        if "graphs" in args.parts else []
    if "fp8" in args.parts:
        fp8 = [fp8_check(name, args, hw) for name in args.fp8_models]
    ok = all(not r.get("errors") and r["agreement"]["agree_rate"] == 1.0 for r in results) \
        and not any(r.get("errors") for r in fp8) \
        and all(not r.get("errors") and r["captured_sizes"] and r["equal"] == r["prompts"]
                for r in graphs) \
        and (tests is None or tests["returncode"] == 0) \
        and (attention is None or not ("error" in attention
                                       or any("error" in c for c in attention["cases"])))
    payload = {"description": "loomserve on a GPU: CUDA vs CPU greedy agreement, bf16 speed "
                              "(benchmarks/gpu_check.py)",
               "cpu_only_dry_run": args.cpu_only, "device": args.device, "hardware": hw,
               "host": host_info(), "torch": torch.__version__,
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "wall_s": round(time.perf_counter() - t0, 1), "all_ok": ok,
               "settings": {k: getattr(args, k) for k in ("streams", "prefill_streams",
                                                           "prompt_len", "decode_tokens",
                                                           "agree_tokens", "dtype")},
               "tests": tests, "attention": attention, "models": results, "graphs": graphs,
               "fp8": fp8}
    print("wrote", write_json(args.out, payload), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
