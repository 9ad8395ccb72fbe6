"""Long-context decode and prefill on CPU: loomserve vs llama-server (issue 12), beside limits.

Model: a tiny long-context Llama built here once (benchmarks/longctx/model.py: 2 layers,
hidden 128, 4 heads over 1 KV head of 32, rope theta 1e6, 262144 positions, seeded random
weights, SmolLM2's tokenizer), cached under benchmarks/.cache/long_context/ as an HF folder and
an f32 GGUF made by llama.cpp's convert_hf_to_gguf.py. KV per token (fp32): 512 B.

Systems (each server alone while measured, one after another; fp32 weights and KV, 2 threads):
  loomserve         `loomserve serve HF --dtype float32 --max-model-len 262144 ...`
  loomserve-torch   the same with `--attention-backend torch` (gather pages + SDPA)
  loomserve-si8     the same with `--stream-interval 8` (tokens reach the client 8 at a time)
  loomserve-kvbf16  the same with `--kv-cache-dtype bfloat16` (256 B of KV a token)
  llama-server      `llama-server -m GGUF -ctk f32 -ctv f32 -t 2 -np 1 -c 135424` (132K + 256;
                    `--no-repack` on AMX hosts only)
  llama-server-kvf16  the same with `-ctk f16 -ctv f16` (its default KV type): the peer of
                    loomserve-kvbf16 (speedups of a 16-bit-KV system are against it)
  loomserve-kvfp8   `--kv-cache-dtype fp8_e4m3` (128 B of KV a token)
  llama-server-kvq8  `-ctk q8_0 -ctv q8_0` (its 8-bit KV: 34 B per 32 values, 136 B a token;
                    flash attention on, as llama.cpp needs for a quantized V): loomserve-kvfp8's peer

Figures (benchmarks/longctx/systems.py has the method of each phase):
  decode@100K, decode@128K   ms per generated token at that context, one stream, prompt cached
                             (client-side, from the SSE stamps), median of --repeats
  prefill24k                 seconds to prefill 24K new tokens over a cached 104K prefix (TTFT)
  c64@32K (--skip-64 off)    aggregate decode tok/s of 64 streams at 32K context each
Limits (benchmarks/longctx/limits.py): decode's KV-read time at the measured read bandwidth
(benchmarks/membw.py), and the 24K prefill's attention FLOPs at a measured fp32 torch.mm rate.

Run:
    nice -n -15 .venv/bin/python benchmarks/long_context.py                    # all, no c64
    .venv/bin/python benchmarks/long_context.py --systems llama-server --contexts 102400
    .venv/bin/python benchmarks/long_context.py --phases c64 --no-skip-64
Resumable: each (system, phase) lands in benchmarks/results/long_context.json as soon as it is
measured; a rerun skips what is there unless --force (or --systems/--phases narrow it).
Needs: the loomserve venv; llama-server built by benchmarks/peers/build_llama_server.sh (its
sources hold the converter); ~2 GiB RAM for c64.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from statistics import median
from typing import Any, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from longctx import limits, model, report, systems  # noqa: E402

RESULT_NAME = "long_context.json"
SYSTEMS = ("loomserve", "loomserve-torch", "loomserve-si8", "loomserve-kvbf16", "loomserve-kvfp8",
           "llama-server", "llama-server-kvf16", "llama-server-kvq8")
# Narrower KV than fp32: the fraction of fp32's bytes a token (each system's own limit), and
# which llama-server configuration is the peer.
KV_FRACTION = {"loomserve-kvbf16": 0.5, "llama-server-kvf16": 0.5, "loomserve-kvfp8": 0.25,
               "llama-server-kvq8": 34 / 128}
LLAMA_KV = {"llama-server-kvf16": "f16", "llama-server-kvq8": "q8_0"}
PEER = {"loomserve-kvbf16": "llama-server-kvf16", "loomserve-kvfp8": "llama-server-kvq8"}
K = 1024


def load(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def phases_for(args: argparse.Namespace) -> list[str]:
    wanted = args.phases or ["decode", "prefill24k", "c64"]
    out = [f"decode@{c}" for c in args.contexts] if "decode" in wanted else []
    if "prefill24k" in wanted:
        out.append("prefill24k")
    if "c64" in wanted and not args.skip_64:
        out.append(f"c{args.streams}@{args.c64_context}")
    return out


def server_for(name: str, phase: str, args, folder: str, gguf: str):
    """argv builder for ``name`` sized for ``phase`` (c64 needs 64 slots / more KV)."""
    many = phase.startswith("c")
    slots = args.streams if many else 1
    ctx_slot = (args.c64_context + args.max_tokens + 512) if many else 132 * K + args.max_tokens
    if name.startswith("llama-server"):
        return systems.llama_argv(common.ensure_llama_server(build=False), gguf, slots,
                                  slots * ctx_slot, args.threads, LLAMA_KV.get(name, "f32"))
    kv = args.kv_memory_c64 if many else args.kv_memory
    backend = "torch" if name == "loomserve-torch" else args.backend
    extra = {"loomserve-si8": ["--stream-interval", "8"],
             "loomserve-kvbf16": ["--kv-cache-dtype", "bfloat16"],
             "loomserve-kvfp8": ["--kv-cache-dtype", "fp8_e4m3"]}.get(name, [])
    return systems.loomserve_argv(sys.executable, folder, backend, kv, max(slots, 4), extra)


def run_phase(name: str, phase: str, url: str, vocab: int, args) -> dict[str, Any]:
    if phase.startswith("decode@"):
        return systems.run_decode(name, url, vocab, int(phase[7:]), args.max_tokens,
                                  args.repeats, args.decode_seconds)
    if phase == "prefill24k":
        return systems.run_prefill24k(name, url, vocab, args.repeats)
    return systems.run_c64(name, url, vocab, args.c64_context, args.streams, args.c64_tokens)


def measure_system(name: str, phases: Sequence[str], args, folder, gguf, vocab, payload,
                   path) -> None:
    """One server per phase group (single-stream phases share one), each alone on the host."""
    groups = [[p for p in phases if not p.startswith("c")], [p for p in phases if p.startswith("c")]]
    for group in filter(None, groups):
        argv = server_for(name, group[0], args, folder, gguf)
        port = common.free_port()
        with common.ServerProcess(argv(port), port, name=name, startup_timeout=900) as srv:
            systems.timed_request(srv.base_url, model_prompt(vocab), 4)  # warm-up
            for phase in group:
                t0 = time.time()
                entry = run_phase(name, phase, srv.base_url, vocab, args)
                entry.update(command=argv(0), measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                             loadavg_at_start=payload["host"]["loadavg_at_start"],
                             loadavg_after=[round(x, 2) for x in os.getloadavg()],
                             wall_s=round(time.time() - t0, 1), lead_commit=args.commit)
                payload["systems"].setdefault(name, {})[phase] = entry
                summarise(payload)
                common.write_json(RESULT_NAME, payload)


def model_prompt(vocab: int) -> list[int]:
    from longctx.measure import random_prompt

    return random_prompt(64, seed=99, vocab=vocab)


def summarise(payload: dict[str, Any]) -> None:
    """Headline figures and their limits, recomputed from every stored entry."""
    lim = payload["limits"]
    rows: dict[str, dict[str, Any]] = {}
    for name, phases in payload["systems"].items():
        row = rows.setdefault(name, {})
        for phase, e in phases.items():
            if phase.startswith("decode@") and e.get("decode_ms_per_token_all"):
                ms = median(e["decode_ms_per_token_all"])
                per_token = lim["kv_bytes_per_token"] * KV_FRACTION.get(name, 1.0)
                kv_lim = 1e3 * int(phase[7:]) * per_token / (lim["read_gbs"] * 1e9)
                row[phase] = {"ms_per_token": round(ms, 3), "x_kv_limit": round(ms / kv_lim, 2)}
            elif phase == "prefill24k" and e.get("ttft_s_all"):
                s = median(e["ttft_s_all"])
                row[phase] = {"s": round(s, 2), "tok_per_s": round(systems.NEW / s, 1),
                              "x_flop_limit": round(s / lim["prefill24k"]["flop_limit_s"], 2)}
            elif phase.startswith("c") and e.get("tok_per_s"):
                row[phase] = {"tok_per_s": e["tok_per_s"]}
    for name, row in rows.items():
        peer = rows.get(PEER.get(name, "llama-server"), {})
        for phase, fig in row.items():
            if not name.startswith("llama-server") and phase in peer:
                key = "ms_per_token" if "ms_per_token" in fig else ("s" if "s" in fig else None)
                if key:
                    fig["speedup_vs_llama_server"] = round(peer[phase][key] / fig[key], 2)
                else:
                    fig["speedup_vs_llama_server"] = round(fig["tok_per_s"] / peer[phase]["tok_per_s"], 2)
    payload["summary"] = rows


def compute_limits(args, cfg: dict, contexts: Sequence[int]) -> dict[str, Any]:
    from membw import run_all

    # Measured here, not via membw.json's cache: that file belongs to another benchmark.
    bw = args.read_gbs or run_all(gib=1.0, threads=args.threads, repeats=5)["read_gbs"]
    gflops = limits.matmul_gflops(threads=args.threads)
    weight_bytes = 4 * (limits.layer_params(cfg) + cfg["vocab_size"] * cfg["hidden_size"])
    decode = {str(c): {k: round(v, 4) for k, v in limits.decode_limits_ms(
        c, model.KV_BYTES_PER_TOKEN, weight_bytes, bw).items()} for c in contexts}
    fl = limits.prefill_flops(cfg, systems.PREFIX, systems.NEW)
    return {"read_gbs": bw, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "fp32_matmul_gflops": round(gflops, 1), "weight_bytes": weight_bytes,
            "kv_bytes_per_token": model.KV_BYTES_PER_TOKEN, "decode": decode,
            "prefill24k": {**fl, "flop_limit_s": round(fl["total_flops"] / (gflops * 1e9), 2)}}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--phases", nargs="+", choices=["decode", "prefill24k", "c64"], default=None)
    ap.add_argument("--contexts", nargs="+", type=int, default=[100 * K, 128 * K])
    ap.add_argument("--skip-64", action=argparse.BooleanOptionalAction, default=True,
                    help="skip 64 concurrent decodes at 32K (slow: 2M tokens of prefill)")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--c64-context", type=int, default=32 * K)
    ap.add_argument("--c64-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256, help="most decode tokens per request")
    ap.add_argument("--decode-seconds", type=float, default=15.0,
                    help="decode tokens per timed request: about this many seconds' worth")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default=None, help="loomserve's --attention-backend (default: its own)")
    ap.add_argument("--kv-memory", default="1GiB")
    ap.add_argument("--kv-memory-c64", default="1536MiB")
    ap.add_argument("--force", action="store_true", help="re-measure phases already stored")
    ap.add_argument("--refresh-limits", action="store_true",
                    help="re-measure bandwidth and matmul rate (else the stored ones are kept)")
    ap.add_argument("--read-gbs", type=float, default=None, help="use this read bandwidth")
    ap.add_argument("--result", default=RESULT_NAME)
    ap.add_argument("--report", action="store_true", help="print the stored results as markdown")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    global RESULT_NAME
    args = parse_args(argv)
    RESULT_NAME = args.result
    args.commit = os.popen(f"git -C {common.REPO_ROOT} log -1 --format=%h").read().strip()
    folder, gguf = model.build()
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    path = common.result_path(RESULT_NAME)  # read where write_json writes (a name or a path)
    if args.report:
        print(report.markdown(load(path)))
        return 0
    payload = load(path) or {"description": "long-context decode / prefill (benchmarks/long_context.py)"}
    payload.update(model={"hf": folder, "gguf": gguf, **model.CONFIG, "vocab_size": cfg["vocab_size"]},
                   host=common.host_info())
    payload.setdefault("systems", {})
    if args.refresh_limits or "limits" not in payload or args.read_gbs:
        payload["limits"] = compute_limits(args, cfg, sorted({*args.contexts, 100 * K, 128 * K}))
    for name in args.systems:
        todo = [p for p in phases_for(args)
                if args.force or p not in payload["systems"].get(name, {})]
        if todo:
            measure_system(name, todo, args, folder, gguf, cfg["vocab_size"], payload, path)
    summarise(payload)
    common.write_json(RESULT_NAME, payload)
    print(json.dumps({"limits": payload["limits"], "summary": payload["summary"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
