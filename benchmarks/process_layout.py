"""Two-process vs one-process loomserve, side by side in one run.

`loomserve serve` runs the engine core in its own process (the HTTP front end's tokenization,
detokenization and SSE no longer share the core's GIL); `--engine-in-process` keeps the old
one-process layout. Both servers are up at once and their rounds interleave (A B, then B A,
...), so the machine's drift hits both alike. Per round and system:
- aggregate decode tok/s at C concurrent streams (default 32; 32-token prompts, greedy,
  ignore_eos, `--max-tokens` each);
- single-stream decode tok/s (C=1);
- TTFT of one request with a `--ttft-prompt`-token prompt (median of `--ttft-reps`).
Prompts are numbered on across rounds, so prefix caching never helps either system.

    python benchmarks/process_layout.py [--dtype bfloat16] [--rounds 5] [--json-out F]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import (
    ServerProcess,
    default_gguf_path,
    format_table,
    free_port,
    host_info,
    write_json,
)
from decode.prompts import load_tokenizer, make_prompts
from decode.served import ServedSystem, completion_body, loomserve_argv

SYSTEMS = {"two-process": [], "one-process": ["--engine-in-process"]}


def ttft(system: ServedSystem, prompt: list[int]) -> float:
    """Seconds from sending one streaming request to its first chunk with a choice (text or
    not: a tiny model may start with a special token)."""
    import httpx

    body = completion_body(prompt, 2, system.model)
    t0 = time.perf_counter()
    with httpx.stream("POST", system.base_url + "/v1/completions", json=body,
                      timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{system.name}: TTFT request failed: HTTP {r.status_code}")
        for line in r.iter_lines():
            if line.startswith("data: {") and '"choices":[{' in line.replace(" ", ""):
                return time.perf_counter() - t0
    raise RuntimeError(f"{system.name}: TTFT request returned no token")


def one_round(systems: dict[str, ServedSystem], order: list[str], tok, args, k: int) -> dict:
    out = {}
    for name in order:
        s = systems[name]
        base = 10_000 * k + (5_000 if name == order[1] else 0)
        many = s.measure(make_prompts(tok, args.concurrency, base), args.max_tokens,
                         f"round {k} C={args.concurrency}")
        single = s.measure(make_prompts(tok, 1, base + 100), args.max_tokens, f"round {k} C=1")
        firsts = [ttft(s, make_prompts(tok, 1, base + 200 + i, args.ttft_prompt)[0])
                  for i in range(args.ttft_reps)]
        errors = many.errors + single.errors
        if errors:
            raise RuntimeError(f"{name}: {errors[:3]}")
        out[name] = {"aggregate_tok_s": many.tok_per_s, "single_tok_s": single.tok_per_s,
                     "ttft_s": statistics.median(firsts)}
        print(f"[{name}] round {k}: {out[name]}", file=sys.stderr, flush=True)
    return out


def summarize(rounds: list[dict]) -> dict:
    keys = ("aggregate_tok_s", "single_tok_s", "ttft_s")
    med = {n: {k: statistics.median(r[n][k] for r in rounds) for k in keys} for n in SYSTEMS}
    two, one = med["two-process"], med["one-process"]
    ratios = {"aggregate": two["aggregate_tok_s"] / one["aggregate_tok_s"],
              "single": two["single_tok_s"] / one["single_tok_s"],
              "ttft": two["ttft_s"] / one["ttft_s"]}
    per_round = [r["two-process"]["aggregate_tok_s"] / r["one-process"]["aggregate_tok_s"]
                 for r in rounds]
    return {"median": med, "ratio_two_over_one": ratios, "aggregate_ratio_per_round": per_round}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="a .gguf file or an HF folder (default: the built-in SmolLM2 GGUF)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ttft-prompt", type=int, default=1024)
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    gguf = args.model or default_gguf_path()
    if gguf.endswith(".gguf"):
        tok = load_tokenizer(gguf)
    else:  # an HF folder (e.g. a small model, where the front end's share of the work is large)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(gguf)
    servers, systems = [], {}
    try:
        for name, extra in SYSTEMS.items():
            port = free_port()
            argv = loomserve_argv(gguf, args.dtype, max(args.concurrency, 1),
                                  ["--log-level", "warning", *extra])(port)
            srv = ServerProcess(argv, port, name=name)
            srv.start()
            servers.append(srv)
            systems[name] = ServedSystem(name, f"http://127.0.0.1:{port}")
        for s in systems.values():
            s.warm_up(make_prompts(tok, args.concurrency, 900_000))
        names = list(SYSTEMS)
        rounds = []
        for k in range(args.rounds):
            order = names if k % 2 == 0 else names[::-1]
            rounds.append(one_round(systems, order, tok, args, k))
    finally:
        for srv in servers:
            srv.stop()
    summary = summarize(rounds)
    rows = [[n, f"{m['aggregate_tok_s']:.1f}", f"{m['single_tok_s']:.1f}",
             f"{m['ttft_s'] * 1000:.0f}"] for n, m in summary["median"].items()]
    r = summary["ratio_two_over_one"]
    rows.append(["two / one", f"{r['aggregate']:.3f}", f"{r['single']:.3f}", f"{r['ttft']:.3f}"])
    print(format_table(["layout", f"C={args.concurrency} tok/s", "C=1 tok/s",
                        f"TTFT ms ({args.ttft_prompt}-token prompt)"], rows))
    payload = {"host": host_info(), "args": vars(args), "date": time.strftime("%Y-%m-%d"),
               "rounds": rounds, **summary}
    name = args.json_out or "process_layout"
    path = write_json(name if name.endswith(".json") else name + ".json", payload)
    print(f"results: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
