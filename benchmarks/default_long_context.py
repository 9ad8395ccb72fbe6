"""The default model at an agentic context: single-stream decode over a long cached prompt,
loomserve (fp32, bf16 and fp8 KV) vs llama-server (f16 and q8_0 KV), beside the read-bandwidth
limit.

At a few thousand tokens of context the KV, not the weights, is most of what a decode step of
SmolLM2-135M reads (30 layers x 2 x 3 kv heads x 64: 46 KB a token in fp32, 23 KB in 16 bits,
against ~97 MB of Q4_1/Q8_0 weights), so the KV dtype sets the speed.

Systems (the built-in SmolLM2-135M-Instruct Q4_1 GGUF, 2 threads each):
  loomserve         `loomserve serve GGUF --quantization gguf --dtype float32` (fp32 KV)
  loomserve-kvbf16  the same with `--kv-cache-dtype bfloat16`
  loomserve-kvfp8   the same with `--kv-cache-dtype fp8_e4m3`
  llama-server      `llama-server -m GGUF -np 1 -c CTX+512 -t 2 -tb 2` (its default f16 KV;
                    `--no-repack` on AMX hosts only, common.llama_repack_args)
  llama-server-kvq8 the same with `-ctk q8_0 -ctv q8_0 -fa on` (8.5 bits a value)

Method: every server up at once (idle ones sleep); each prefills the same random prompt of
--context token ids once (its TTFT is reported), then --repeats rounds, the systems rotated
each round, time a request of that prompt (now cached: the first token is one step) decoding
--max-tokens tokens; ms/token from the stream's stamps (longctx.measure), median over rounds.
Limit: (weight bytes as stored + context x KV bytes a token in the system's KV dtype) over the
read bandwidth measured before the systems (benchmarks/membw.py).

Run:  nice -n -15 .venv/bin/python benchmarks/default_long_context.py [--context 7000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from longctx.measure import random_prompt, timed_request  # noqa: E402

SYSTEMS = ("loomserve", "loomserve-kvbf16", "loomserve-kvfp8", "llama-server", "llama-server-kvq8")
KV_BYTES = {"loomserve": 4, "loomserve-kvbf16": 2, "loomserve-kvfp8": 1, "llama-server": 2,
            "llama-server-kvq8": 34 / 32}  # a value's bytes


def argv_for(name: str, gguf: str, context: int, threads: int, port: int) -> list[str]:
    if name.startswith("llama-server"):
        q8 = ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"] if name == "llama-server-kvq8" else []
        return [common.ensure_llama_server(build=False), "-m", gguf, "--host", "127.0.0.1",
                "--port", str(port), "-np", "1", "-c", str(context + 512), "-t", str(threads),
                "-tb", str(threads), *common.llama_repack_args(), *q8, "--no-webui"]
    extra = {"loomserve-kvbf16": ["--kv-cache-dtype", "bfloat16"],
             "loomserve-kvfp8": ["--kv-cache-dtype", "fp8_e4m3"]}.get(name, [])
    return [sys.executable, "-m", "loomserve", "serve", gguf, "--quantization", "gguf",
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", "4", *extra]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--context", type=int, default=7000, help="prompt tokens (SmolLM2: <= 7600)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--result", default="default_long_context.json")
    args = ap.parse_args(argv)
    from membw import run_all

    gguf = common.default_gguf_path()
    facts = common.gguf_model_facts(gguf)
    bw = run_all(gib=1.0, threads=args.threads, repeats=5)["read_gbs"]
    prompt = random_prompt(args.context, seed=7, vocab=facts.vocab)
    servers, out = {}, {}
    with ExitStack() as stack:
        for name in args.systems:
            port = common.free_port()
            servers[name] = stack.enter_context(common.ServerProcess(
                argv_for(name, gguf, args.context, args.threads, port), port, name=name,
                startup_timeout=900))
        for name, srv in servers.items():  # prefill each once, alone
            first = timed_request(srv.base_url, prompt, 2)
            assert first.error is None, (name, first.error)
            out[name] = {"prefill_s": round(first.ttft_s, 2), "ms_per_token_all": []}
        for r in range(args.repeats):
            order = args.systems[r % len(args.systems):] + args.systems[:r % len(args.systems)]
            for name in order:
                t = timed_request(servers[name].base_url, prompt, args.max_tokens)
                assert t.error is None, (name, t.error)
                out[name]["ms_per_token_all"].append(round(t.decode_ms_per_token, 3))
                print(f"[{name}] round {r + 1}: {t.decode_ms_per_token:.2f} ms/token", flush=True)
    for name, e in out.items():
        step_bytes = facts.file_tensor_bytes + args.context * facts.kv_bytes_per_token(KV_BYTES[name])
        e["ms_per_token"] = round(statistics.median(e["ms_per_token_all"]), 2)
        e["limit_ms"] = round(1e3 * step_bytes / (bw * 1e9), 2)
        e["x_limit"] = round(e["ms_per_token"] / e["limit_ms"], 2)
        e["command"] = argv_for(name, gguf, args.context, args.threads, 0)
        print(f"{name}: prefill {e['prefill_s']} s, decode {e['ms_per_token']} ms/token "
              f"(limit {e['limit_ms']} ms at {bw:.1f} GB/s: {e['x_limit']}x)")
    payload = {"host": common.host_info(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "read_gbs": bw, "context": args.context, "max_tokens": args.max_tokens,
               "weight_bytes": facts.file_tensor_bytes, "systems": out}
    print("wrote", common.write_json(args.result, payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
