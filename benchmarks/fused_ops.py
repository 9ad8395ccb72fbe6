"""Decode step time with the fused C ops (layers/fused.py) vs the torch path, and where the time goes.

Model: the default SmolLM2-135M-Instruct (30 layers, hidden 576, 9/3 heads of 64, MLP 1536),
fp32 (or --dtype bfloat16), through ModelRunner.compute_logits (metadata, 30 layers, final norm, LM head), i.e. one
decode step of C streams, each at context --ctx. Systems, in the same process:
  fused   layers.fused.USE = True: add+RMSNorm, RoPE on q/k in place, SiLU*up as C calls
  torch   layers.fused.USE = False: the torch reference ops (what ran before)
  matmul  the step's matmuls alone (the 120 layer linears and the LM head on inputs of the
          step's shape): the floor the small ops sit on; step - matmul = attention + small ops
          + Python. Its own limit: weight bytes / read bandwidth (benchmarks/membw.py).
  ops_fused / ops_torch   the replaced small ops alone (per layer 2 add+RMSNorm, RoPE, SiLU*up;
          the final norm) on tensors of the step's shapes: the small-op time itself.
Interleaved step by step: each of --repeats x --steps rounds runs one step of each system (the
order rotating), so the shared host's drift hits all alike. Reported: the median and the min
step (on a noisy host the min is the closest to the uncontended cost), and the saving as the
median of paired differences (each torch step minus the fused step next to it). Beside wall time,
the process CPU time of a step (time.process_time): on a host shared with other work it
leaves out the time spent waiting for a core (with 1 torch thread it is the step's own work;
with more it also counts OpenMP spin-waits).
--profile adds a torch.profiler split per step (matmul / attention / other aten ops; the
profiler's own per-op cost inflates the small ops, so read it as a share, not a time).
--micro adds one op at a time at 1 and 8 rows: torch eager vs C vs torch.compile(dynamic=True),
with the compile time at start and the first call at a new row count (recompiles).

Run:   nice -n -15 python benchmarks/fused_ops.py [--streams 1 8] [--threads 1] [--repeats 7] [--profile]
       nice -n -15 python benchmarks/fused_ops.py --micro-only --threads 1
Output: a table, benchmarks/results/fused_ops-t<threads>.json (fused_ops-micro.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, format_table, host_info, write_json  # noqa: E402

from loomserve.config import EngineConfig  # noqa: E402
from loomserve.execution.batch import ModelInput, ScheduledSeq  # noqa: E402
from loomserve.execution.layers import fused  # noqa: E402
from loomserve.execution.layers.fused import rope_qk_, silu_and_mul  # noqa: E402
from loomserve.execution.layers.rotary import apply_rope  # noqa: E402
from loomserve.execution.model_runner import ModelRunner  # noqa: E402
from loomserve.sampling_params import SamplingParams  # noqa: E402


def decode_input(streams: int, ctx: int, block_size: int) -> ModelInput:
    per = -(-(ctx + 1) // block_size)
    greedy = SamplingParams(temperature=0.0)
    return ModelInput([ScheduledSeq(f"s{i}", [100 + i], ctx, [list(range(i * per, (i + 1) * per))], True, greedy)
                       for i in range(streams)])


def matmul_pass(runner: ModelRunner, streams: int):
    """The step's matmuls alone, on zero inputs of the step's shapes."""
    m = runner.model
    hidden, inter = m.config.hidden_size, m.config.intermediate_size
    q = m.config.num_heads * m.config.head_dim
    xs = {n: torch.zeros(streams, n, dtype=runner.dtype) for n in {hidden, inter, q}}

    def run():
        with torch.inference_mode():
            for layer in m.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                a.qkv_proj(xs[hidden])
                a.o_proj(xs[q])
                mlp.gate_up_proj(xs[hidden])
                mlp.down_proj(xs[inter])
            m.compute_logits(xs[hidden])
    return run


def small_ops_pass(runner: ModelRunner, streams: int):
    """The step's replaced small ops alone, as the layers call them (fused or torch by USE): per
    layer add+RMSNorm twice, RoPE on q/k, SiLU*up; the final add+RMSNorm."""
    m = runner.model
    cfg = m.config
    heads = cfg.num_heads + 2 * cfg.num_kv_heads
    x = torch.randn(streams, cfg.hidden_size, dtype=runner.dtype)
    res = torch.randn(streams, cfg.hidden_size, dtype=runner.dtype)
    qkv = torch.randn(streams, heads, cfg.head_dim, dtype=runner.dtype)
    gate_up = torch.randn(streams, 2 * cfg.intermediate_size, dtype=runner.dtype)
    cos, sin = m.rotary.lookup(torch.arange(streams) + 100)
    half, qk = m.rotary.half, cfg.num_heads + cfg.num_kv_heads

    def run():
        with torch.inference_mode():
            for layer in m.model.layers:
                layer.input_layernorm.fused(x, res)
                if not rope_qk_(qkv, qk, cos, sin, half):
                    apply_rope(qkv[:, :qk], cos, sin, half)
                layer.post_attention_layernorm.fused(x, res)
                silu_and_mul(gate_up, cfg.intermediate_size)
            m.model.norm.fused(x, res)
    return run


def time_step(fn) -> tuple[float, float]:
    """Wall ms and process-CPU ms of one call."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3


def profile_split(step, n: int = 5) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(n):
            step()
    split = {"matmul": 0.0, "attention": 0.0, "other_aten": 0.0, "count_other": 0}
    for e in p.key_averages():
        if not e.key.startswith(("aten::", "mkldnn::", "torch_ipex::")):
            continue
        ms = e.self_cpu_time_total / 1e3 / n
        if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::matmul",
                     "aten::linear"):
            split["matmul"] += ms
        elif "attention" in e.key or e.key.startswith(("aten::index", "aten::_index")):
            split["attention"] += ms
        else:
            split["other_aten"] += ms
            split["count_other"] += e.count / n
    return {k: round(v, 2) for k, v in split.items()}


def run_model(args) -> list[dict]:
    runner = ModelRunner(EngineConfig.from_kwargs(device="cpu", dtype=args.dtype, kv_cache_memory="256MiB",
                                                  block_size=16))
    rows = []
    for streams in args.streams:
        inp = decode_input(streams, args.ctx, runner.block_size)
        ops = small_ops_pass(runner, streams)
        systems = {"fused": lambda: runner.compute_logits(inp), "torch": lambda: runner.compute_logits(inp),
                   "matmul": matmul_pass(runner, streams), "ops_fused": ops, "ops_torch": ops}
        wall = {k: [] for k in systems}
        cpu = {k: [] for k in systems}
        order = list(systems)
        for name in order:  # warm-up
            fused.USE = not name.endswith("torch")
            systems[name]()
        for i in range(args.repeats * args.steps):  # step by step, the order rotating
            for name in order[i % len(order):] + order[:i % len(order)]:
                fused.USE = not name.endswith("torch")
                fused.calls.clear()
                w, c = time_step(systems[name])
                wall[name].append(w)
                cpu[name].append(c)
                if name == "fused":
                    assert fused.calls["rms_norm"] > 0, "the fused kernels did not run"
        fused.USE = True
        row = {"streams": streams, "ctx": args.ctx, "samples": len(wall["fused"])}
        for k in systems:
            row[f"{k}_ms"] = round(statistics.median(wall[k]), 2)
            row[f"{k}_min_ms"] = round(min(wall[k]), 2)
            row[f"{k}_cpu_ms"] = round(statistics.median(cpu[k]), 2)
        for k in ("fused", "torch"):
            row[f"{k}_non_matmul_ms"] = round(row[f"{k}_ms"] - row["matmul_ms"], 2)
            row[f"{k}_non_matmul_min_ms"] = round(row[f"{k}_min_ms"] - row["matmul_min_ms"], 2)
            row[f"{k}_non_matmul_cpu_ms"] = round(row[f"{k}_cpu_ms"] - row["matmul_cpu_ms"], 2)
        # Paired: each torch step against the fused step run next to it, so drift cancels.
        row["saved_ms"] = round(statistics.median(t - f for t, f in zip(wall["torch"], wall["fused"])), 2)
        row["saved_cpu_ms"] = round(statistics.median(t - f for t, f in zip(cpu["torch"], cpu["fused"])), 2)
        row["saved_min_ms"] = round(row["torch_min_ms"] - row["fused_min_ms"], 2)
        row["ops_saved_ms"] = round(statistics.median(t - f for t, f in zip(wall["ops_torch"], wall["ops_fused"])), 2)
        if args.profile:
            for k in ("fused", "torch"):
                fused.USE = k == "fused"
                row[f"{k}_profile"] = profile_split(systems[k])
            fused.USE = True
        rows.append(row)
        print(json.dumps(row), flush=True)
    row0 = {"weight_bytes": runner.weight_bytes}
    return rows, row0


def run_micro(args) -> dict:
    """One op at a time: torch eager vs C vs torch.compile (hidden 576, MLP 1536)."""
    from torch.nn import functional as F

    d, inter, eps = 576, 1536, 1e-5
    w = torch.randn(d)

    def eager_add_norm(x, r):
        s = r + x
        return w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)), s

    def eager_silu(gu):
        g, u = gu.split(inter, dim=-1)
        return F.silu(g) * u

    def c_add_norm(x, r):
        return fused.rms_norm(x, w, eps, residual=r)

    def us(f, *a, n=2000):
        for _ in range(50):
            f(*a)
        best = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            for _ in range(n):
                f(*a)
            best.append((time.perf_counter() - t) / n * 1e6)
        return round(statistics.median(best), 2)

    t = time.perf_counter()
    comp_norm, comp_silu = torch.compile(eager_add_norm, dynamic=True), torch.compile(eager_silu, dynamic=True)
    comp_norm(torch.randn(2, d), torch.randn(2, d))
    comp_silu(torch.randn(2, 2 * inter))
    out = {"compile_s_two_ops": round(time.perf_counter() - t, 1)}
    for n in (1, 8, 13):
        x, r, gu = torch.randn(n, d), torch.randn(n, d), torch.randn(n, 2 * inter)
        t = time.perf_counter()
        comp_norm(x, r)
        comp_silu(gu)
        out[f"rows{n}"] = {"first_compiled_call_s": round(time.perf_counter() - t, 3),
                           "add_norm_us": {"eager": us(eager_add_norm, x, r), "c": us(c_add_norm, x, r),
                                           "compiled": us(comp_norm, x, r)},
                           "silu_mul_us": {"eager": us(eager_silu, gu), "c": us(fused.silu_and_mul, gu, inter),
                                           "compiled": us(comp_silu, gu)}}
        print(n, json.dumps(out[f"rows{n}"]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="steps per repeat (samples = repeats x steps)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--micro-only", action="store_true", help="only --micro; saved as fused_ops-micro.json")
    ap.add_argument("--out", default=None,
                    help="result file (default: fused_ops-t<threads>[-bf16].json, fused_ops-micro.json)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert fused.library() is not None, "kernels/fused.c did not build (or LOOMSERVE_KERNELS=0)"
    result = {"command": " ".join(["python", *sys.argv]), "date": datetime.datetime.now(datetime.timezone.utc)
              .isoformat(timespec="seconds"), "host": host_info(), "threads": torch.get_num_threads(), "dtype": args.dtype}
    if args.micro_only:
        result["micro"] = run_micro(args)
        print(write_json(args.out or "fused_ops-micro.json", result))
        return
    rows, facts = run_model(args)
    result["rows"] = rows
    try:
        with open(os.path.join(RESULTS_DIR, "membw.json")) as f:
            gbs = json.load(f)["read_gbs"]
        result["limit"] = {"weight_bytes": facts["weight_bytes"], "membw_read_gbs": gbs,
                           "weights_read_ms": round(facts["weight_bytes"] / gbs / 1e6, 2)}
    except (OSError, KeyError, ValueError):
        pass
    if args.micro:
        result["micro"] = run_micro(args)
    result["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(format_table(["C", "clock", "torch ms", "fused ms", "saved ms", "matmul ms", "torch-mm", "fused-mm",
                        "ops torch", "ops fused"],
                       [[r["streams"], clock, r[f"torch{c}_ms"], r[f"fused{c}_ms"], r[f"saved{c}_ms"],
                         r[f"matmul{c}_ms"], r[f"torch_non_matmul{c}_ms"], r[f"fused_non_matmul{c}_ms"],
                         r[f"ops_torch{c}_ms"], r[f"ops_fused{c}_ms"]]
                        for r in rows for clock, c in (("wall median", ""), ("wall min", "_min"),
                                                       ("cpu median", "_cpu"))]))
    if "limit" in result:
        print(f"weights read once per step: {result['limit']['weights_read_ms']} ms at "
              f"{result['limit']['membw_read_gbs']} GB/s")
    bf16 = "-bf16" if args.dtype == "bfloat16" else ""
    print(write_json(args.out or f"fused_ops-t{result['threads']}{bf16}.json", result))


if __name__ == "__main__":
    main()
