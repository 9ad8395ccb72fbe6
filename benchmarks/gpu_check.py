"""One-shot check of loomserve on an NVIDIA GPU (under 10 minutes): correctness, then speed.

Parts (--parts, all by default), in this order:
  tests       the CUDA-relevant test files (CUDA_TESTS) by pytest on the device: the Triton
              attention backend against the dense reference, the host tier's pinned round trip
  attention   attention alone, triton vs torch backends (benchmarks/gpu_attention.py)
  spec        speculative decoding on --spec-model (the default model), in the device dtype,
              ngram and suffix (k = 4, the draft budget on) against the same engine without
              drafts: greedy outputs of copy-shaped prompts (a text, "repeat it", its first
              tokens) and AGREE_PROMPTS, every prompt prefilled in one step (required equal:
              verification rows are decode rows; where not, [prompt index, first differing
              position] pairs, the copy prompts first);
              decode tok/s at 1 and 8 streams on the copy prompts (as in speed, below), the
              acceptance length (1 + accepted / drafts, from the core's spec_decode counters)
              and the budget's fitted prices (the step's time T(B, 0), a draft row's td, a
              verified step's overhead tv): on a GPU a draft row should cost little until the
              batch is compute-bound
  async       --async-scheduling against the synchronous loop on --spec-model at --streams
              streams (prompts of 32 tokens, all prefilled in one step), rounds alternating
              (benchmarks/async_scheduling.py's one_round): greedy outputs equal (required),
              decode tok/s (streams / median decode step), the host share of a step (the core
              thread outside the model, over the step); then one round of prompts that repeat
              themselves with ngram drafts under async scheduling: greedy outputs equal the
              synchronous loop's (required), the drafts verified, the steps that overlapped
  models      per model, below
  fp8         the fp8 check, below

For each model, the built-in default model first (SmolLM2-135M-Instruct), then each fixture
(every folder of tests/fixtures with a config.json):
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

Each part reports its own failures (an `errors` list) and the others run; spec and async run
before the models, whose loop stops at --budget-s.

Exit status: 0 when every part ran and every pair of greedy outputs agreed (CUDA/CPU, and the
spec, async and graphs engines with their references), 1 when something failed or disagreed,
3 (with one line on stderr, no traceback, no JSON written) when no CUDA device is present.
`--cpu-only` runs the same logic with the CPU standing in for the GPU (fp32, small sizes,
tiny-llama by default) to prove the script on a machine without one.

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
PARTS = ("tests", "attention", "spec", "async", "models", "graphs", "fp8")
SPEC_METHODS = {m: {"method": m, "num_speculative_tokens": 4} for m in ("ngram", "suffix")}
SPEC_STREAMS = (1, 8)
COPY_ASK = "\n\nRepeat the text above exactly, from its start:\n\n"
COPY_SEED = 8  # the copy's first tokens, given in the prompt
ASYNC_ROUNDS = 3
# the async part's round with drafts (every step that may draft does: exactness, not speed)
ASYNC_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
              "prompt_lookup_max": 4, "always_draft": True}
ASYNC_SPEC_TOKENS = 32  # at least: a request whose drafter had nothing is asked every 4 steps
ASYNC_PROMPT_LEN = 32  # at most: every prompt prefills in the first step, as in
# benchmarks/async_scheduling.py, so the steps after it are decode steps of every stream


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


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token id lists part (None: equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def agreement(name: str, device: str, ref_device: str, n: int, kv: str) -> dict[str, Any]:
    """Greedy token ids on ``device`` vs ``ref_device``, fp32 on both."""
    outs = {}
    for dev in (device, ref_device):
        llm = make_llm(name, dev, "float32", kv)
        outs[dev] = greedy(llm, AGREE_PROMPTS, n)
        release(llm, dev)
    parted = [first_difference(a, b) for a, b in zip(outs[device], outs[ref_device])]
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


def copy_texts(count: int, min_chars: int = 4000) -> list[str]:
    """Distinct texts to copy, the same on every machine: the engine's own modules."""
    folder = os.path.join(REPO_ROOT, "loomserve", "engine")
    texts = []
    for f in sorted(os.listdir(folder)):
        if f.endswith(".py"):
            with open(os.path.join(folder, f)) as fh:
                text = fh.read()
            if len(text) >= min_chars:
                texts.append(text)
    if len(texts) < count:
        raise RuntimeError(f"{len(texts)} texts to copy in {folder}, {count} needed")
    return texts[:count]


def copy_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """Copy-shaped prompts of ``length`` token ids: a text, a request to repeat it, then the
    text's first COPY_SEED tokens, so that greedy decoding goes on copying (as an agent's edit
    repeats the file it changes)."""
    ask = tokenizer.encode(COPY_ASK, add_special_tokens=False)
    body = length - len(ask) - COPY_SEED
    if body < COPY_SEED:
        raise ValueError(f"copy prompts of {length} tokens leave no room for a text")
    return [head_ids(tokenizer, t, body) + ask
            + head_ids(tokenizer, t, COPY_SEED, add_special_tokens=False)
            for t in copy_texts(count)]


def head_ids(tokenizer, text: str, n: int, **kw) -> list[int]:
    """The first ``n`` token ids of ``text``, encoding only as much of it as that takes."""
    chars = 2 * n  # a token is rarely shorter than two characters
    while True:
        ids = tokenizer.encode(text[:chars], **kw)
        if len(ids) >= n or chars >= len(text):
            return ids[:n]
        chars *= 2


def spec_counters(before, after) -> dict[str, Any]:
    """Drafts verified between two EngineStats, and the mean acceptance length (tokens a
    verified step emits per request: 1 + accepted / drafts; None without drafts)."""
    d = {k: getattr(after, f"spec_decode_num_{k}") - getattr(before, f"spec_decode_num_{k}")
         for k in ("drafts", "draft_tokens", "accepted_tokens")}
    d["acceptance_length"] = round(1 + d["accepted_tokens"] / d["drafts"], 2) \
        if d["drafts"] else None
    return d


def budget_prices(llm, num_decodes: int) -> dict[str, Any] | None:
    """The draft budget's fitted prices at ``num_decodes`` requests: the step's time without
    drafts T(B, 0), a draft row's td and a verified step's overhead tv (seconds), and the
    acceptance a request's first draft needs to pay (budget.py: a (T + tv) >= ROW_MARGIN td B)."""
    from loomserve.engine.spec.budget import ROW_MARGIN

    p = llm.core.spec.budget.fit.prices(num_decodes)
    if p is None:
        return None
    return {"step_s": float(f"{p.base:.4g}"), "draft_row_s": float(f"{p.td:.4g}"),
            "verify_s": float(f"{p.tv:.4g}"),
            "request_row_s": None if p.tb is None else float(f"{p.tb:.4g}"),
            "break_even_acceptance": round(ROW_MARGIN * p.td * num_decodes / (p.base + p.tv),
                                           3)}


def spec_run(name: str, args, config: dict | None) -> dict[str, Any]:
    """One engine, speculating with ``config`` or not: greedy outputs of the copy prompts and
    AGREE_PROMPTS, then decode tok/s at SPEC_STREAMS on the copy prompts (as in speed), with
    the drafts verified and the budget's prices after each."""
    import torch

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    # one step prefills every prompt whole (token budget, per-request cap 512), so the
    # prefill schedule, on which greedy output depends, is the same with and without drafts
    llm = make_llm(name, args.device, args.dtype, args.kv_memory, enable_prefix_caching=False,
                   max_num_seqs=16, max_num_batched_tokens=8192, speculative_config=config)
    try:
        ready = llm.core.ready()
        plen = min(max(args.prompt_len, 128), 512, ready.max_model_len // 2)
        gen = min(args.decode_tokens, ready.max_model_len - plen - 1)
        copies = copy_prompts(llm.tokenizer, max(SPEC_STREAMS), plen)
        out: dict[str, Any] = {"dtype": ready.dtype, "prompt_len": plen, "decode_tokens": gen,
                               "outputs": greedy(llm, copies + AGREE_PROMPTS, gen),
                               "decode": {}}
        for c in SPEC_STREAMS:
            t1 = timed(llm, copies[:c], 1, sync)
            before = llm.core.stats()
            tn = timed(llm, copies[:c], gen, sync)
            row = {"tok_per_s": round(c * (gen - 1) / (tn - t1), 1) if tn > t1 else None}
            if config is not None:
                row.update(spec_counters(before, llm.core.stats()),
                           prices=budget_prices(llm, c))
            out["decode"][str(c)] = row
    finally:
        release(llm, args.device)
    return out


def spec_check(name: str, args) -> dict[str, Any]:
    """Speculative decoding (SPEC_METHODS, the budget on) against the same engine without it,
    in the device dtype: greedy agreement (required: verification rows are decode rows, the
    prefill schedule is the same), decode tok/s at SPEC_STREAMS, acceptance, the budget's
    prices. Each engine's failure is reported and the others run."""
    entry: dict[str, Any] = {"model": name, "methods": {}}
    t0 = time.perf_counter()
    base = None
    for method, config in (("none", None), *SPEC_METHODS.items()):
        try:
            run = spec_run(name, args, config)
        except Exception as e:  # noqa: BLE001 - reported; the other engines run
            entry.setdefault("errors", []).append(f"{method}: {type(e).__name__}: {e}")
            continue
        outs = run.pop("outputs")
        if config is None:
            base = outs
            entry.update(dtype=run["dtype"], prompt_len=run["prompt_len"],
                         decode_tokens=run["decode_tokens"], copy_prompts=max(SPEC_STREAMS),
                         none={"decode": run["decode"]})
            continue
        m = entry["methods"][method] = {"config": config, "decode": run["decode"]}
        if base is not None:
            parted = [first_difference(a, b) for a, b in zip(base, outs)]
            m["agreement"] = {"prompts": len(parted), "equal": parted.count(None),
                              "first_difference_at": [[i, p] for i, p in enumerate(parted)
                                                      if p is not None]}
            for c, row in run["decode"].items():
                plain = entry["none"]["decode"][c]["tok_per_s"]
                row["speedup"] = round(row["tok_per_s"] / plain, 2) \
                    if row["tok_per_s"] and plain else None
    entry["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"[gpu_check] spec {name}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    return entry


def async_check(name: str, args) -> dict[str, Any]:
    """--async-scheduling against the synchronous loop at --streams streams, rounds
    alternating between the two engines (benchmarks/async_scheduling.py's one_round): greedy
    outputs equal in every round (required), decode tok/s (streams / median decode step), the
    whole round's tok/s and the host share of a step."""
    import statistics

    import async_scheduling as asy

    entry: dict[str, Any] = {"model": name, "streams": args.streams}
    t0 = time.perf_counter()
    engines: dict[str, Any] = {}
    try:
        for mode in ("sync", "async"):
            engines[mode] = make_llm(name, args.device, args.dtype, args.kv_memory,
                                     async_scheduling=mode == "async",
                                     enable_prefix_caching=False, max_num_seqs=args.streams,
                                     max_num_batched_tokens=max(2048, args.streams
                                                                * ASYNC_PROMPT_LEN))
        sync_exec = engines["sync"].core.executor
        sync_exec.execute_model = asy.TimedExecute(sync_exec.execute_model)
        ready = engines["sync"].core.ready()
        plen = min(args.prompt_len, ASYNC_PROMPT_LEN, ready.max_model_len // 2)
        gen = min(args.decode_tokens, ready.max_model_len - plen - 1)
        skip = min(3, gen // 2)  # the prefill and the ramp are not decode steps
        ps = asy.prompts(args.streams, plen, ready.vocab_size)
        entry.update(prompt_len=plen, decode_tokens=gen)
        rounds: dict[str, list[dict]] = {"sync": [], "async": []}
        equal = [True] * len(ps)
        for r in range(ASYNC_ROUNDS + 1):  # round 0 warms both up and is not kept
            got = {}
            for mode in ("sync", "async") if r % 2 else ("async", "sync"):
                res = asy.one_round(engines[mode], f"r{r}{mode}", ps, gen, skip)
                got[mode] = res.pop("outputs")
                if r:
                    rounds[mode].append(res)
            equal = [e and a == b for e, a, b in zip(equal, got["sync"], got["async"])]
        entry.update(prompts=len(ps), equal=sum(equal))
        for mode, rs in rounds.items():
            step_ms = statistics.median(x["step_ms"] for x in rs)
            entry[mode] = {"decode_tok_per_s": round(1e3 * args.streams / step_ms, 1),
                           "step_ms": round(step_ms, 3),
                           "round_tok_per_s": round(statistics.median(
                               x["tok_per_s"] for x in rs), 1),
                           "host_share": round(statistics.median(
                               x["host_share"] for x in rs), 3),
                           "runs_step_ms": [round(x["step_ms"], 3) for x in rs]}
        copying = [p[:max(1, plen // 4)] * 4 for p in ps]  # repeats: prompt lookup drafts
        spec_gen = min(max(gen, ASYNC_SPEC_TOKENS), ready.max_model_len - plen - 1)
        want = asy.one_round(engines["sync"], "copy", copying, spec_gen, skip)["outputs"]
        for mode in list(engines):  # the device memory back before the next engine
            release(engines.pop(mode), args.device)
        engines["async_spec"] = make_llm(
            name, args.device, args.dtype, args.kv_memory, async_scheduling=True,
            speculative_config=ASYNC_SPEC, enable_prefix_caching=False,
            max_num_seqs=args.streams,
            max_num_batched_tokens=max(2048, args.streams * ASYNC_PROMPT_LEN))
        entry["async_spec"] = async_spec_round(engines["async_spec"], copying, spec_gen, skip,
                                               want)
    except Exception as e:  # noqa: BLE001 - reported; the other parts stand
        entry.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
    finally:
        for mode in list(engines):
            release(engines.pop(mode), args.device)
    entry["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"[gpu_check] async {name}: {json.dumps(entry)}", file=sys.stderr, flush=True)
    return entry


def async_spec_round(llm, ps, gen: int, skip: int, want: list[list[int]]) -> dict[str, Any]:
    """One round of prompts `ps` with ngram drafts under async scheduling (a step with drafts
    runs alone): greedy outputs against the synchronous loop's (`want`, required equal), the
    drafts verified, the share of steps that overlapped, decode tok/s."""
    import async_scheduling as asy

    res = asy.one_round(llm, "spec", ps, gen, skip)
    out = res.pop("outputs")
    s, ov = llm.core.stats(), llm.core.overlap
    return {"equal": sum(a == b for a, b in zip(out, want)), "drafts": s.spec_decode_num_drafts,
            "accepted_tokens": s.spec_decode_num_accepted_tokens,
            "overlapped_steps": ov.num_overlapped, "steps": ov.num_steps,
            "decode_tok_per_s": round(1e3 * len(ps) / res["step_ms"], 1)}


def spec_async_ok(spec: dict | None, asyn: dict | None) -> bool:
    """The spec and async parts (None: not run) ran whole and every greedy output agreed."""
    return (spec is None or (not spec.get("errors") and all(
        m["agreement"]["equal"] == m["agreement"]["prompts"] for m in spec["methods"].values()))
    ) and (asyn is None or (not asyn.get("errors") and asyn["equal"] == asyn["prompts"]
                            and asyn["async_spec"]["equal"] == asyn["prompts"]))


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
                    help="which parts run (default: all; --cpu-only runs spec, async, models "
                         "and fp8)")
    ap.add_argument("--models", nargs="+", default=None,
                    help="fixture names and/or 'default' (all; tiny-llama with --cpu-only)")
    ap.add_argument("--graph-models", nargs="*", default=["default"],
                    help="models also run with --cuda-graphs (default: the default model)")
    ap.add_argument("--fp8-models", nargs="*", default=None,
                    help="models also run with --quantization fp8 (default: the default model; "
                         "tiny-llama with --cpu-only)")
    ap.add_argument("--spec-model", default=None,
                    help="model of the spec and async parts (default; tiny-llama with --cpu-only)")
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
    args.spec_model = args.spec_model or ("tiny-llama" if cpu else "default")
    if cpu:
        args.device = "cpu"
        args.parts = [p for p in args.parts if p in ("spec", "async", "models", "fp8")]
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
    # fixed-cost parts before the models, whose loop stops at --budget-s
    spec = spec_check(args.spec_model, args) if "spec" in args.parts else None
    asyn = async_check(args.spec_model, args) if "async" in args.parts else None
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
        and spec_async_ok(spec, asyn) \
        and (attention is None or not ("error" in attention
                                       or any("error" in c for c in attention["cases"])))
    payload = {"description": "loomserve on a GPU: CUDA vs CPU greedy agreement, bf16 speed, "
                              "speculative decoding, async scheduling "
                              "(benchmarks/gpu_check.py)",
               "cpu_only_dry_run": args.cpu_only, "device": args.device, "hardware": hw,
               "host": host_info(), "torch": torch.__version__,
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "wall_s": round(time.perf_counter() - t0, 1), "all_ok": ok,
               "settings": {k: getattr(args, k) for k in ("streams", "prefill_streams",
                                                           "prompt_len", "decode_tokens",
                                                           "agree_tokens", "dtype")},
               "tests": tests, "attention": attention, "spec": spec, "async": asyn,
               "models": results, "graphs": graphs, "fp8": fp8}
    print("wrote", write_json(args.out, payload), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
