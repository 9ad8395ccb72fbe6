"""`loomserve bench pd-profile`: size a prefill/decode split from live instances.

Phase 1 profiles prefill-only throughput (max_tokens=1, unique uncached prompts of the input
length) on --prefill and decode-only throughput (a cached prompt of the input length, output-len
tokens with ignore_eos) on --decode, each at concurrency 1, 2, 4, ... until it saturates; the
P:D ratio follows from the two saturation rates and the workload's lengths (model.py documents
the formula). Phase 2, with --router, sweeps concurrency on the combined deployment and reports
throughput, TTFT and ITL at each point. Output: a markdown table (or --json), a plot (--plot) and
the recommended --role layout for --instances instances.

With --traces the workload's lengths come from recorded sessions: the mean input and output
tokens per request, and the mean uncached input (what a request adds to the previous request's
blocks in its agent's history, the rest being a prefix-cache hit) as the prefill length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

__all__ = ["add_arguments", "main", "workload_from_traces"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, metavar="URL",
                   help="instance to profile prefill on (role prefill or both)")
    p.add_argument("--decode", metavar="URL",
                   help="instance to profile decode on (default: the --prefill one, co-located)")
    p.add_argument("--router", metavar="URL",
                   help="the combined deployment's front (a router or one instance): phase 2")
    p.add_argument("--input-len", type=int, default=2048, help="(default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--traces", metavar="DIR",
                   help="take input/output lengths from these traces instead")
    p.add_argument("--max-concurrency", type=int, default=16, help="(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="requests per level = rounds x concurrency (default: %(default)s)")
    p.add_argument("--gain", type=float, default=0.05,
                   help="a level that gains no more than this fraction is saturated "
                        "(default: %(default)s)")
    p.add_argument("--instances", type=int, default=4,
                   help="instances to lay out with the ratio (default: %(default)s)")
    p.add_argument("--model", help="model name to send (default: the server's first)")
    p.add_argument("--vocab-size", type=int, help="(default: probed from the server)")
    p.add_argument("--api-key")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS")
    p.add_argument("--plot", metavar="PNG", help="write the plot here")
    p.add_argument("--out", metavar="JSON", help="also write the result here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def workload_from_traces(path: str):
    """Mean in/out tokens per request and mean uncached input (see the module docstring)."""
    from loomserve.bench.pd_profile.runner import Workload
    from loomserve.bench.trace import load_traces
    ins, outs, news = [], [], []
    for s in load_traces([path]):
        last: dict[str, tuple] = {}  # agent -> hash_ids of its previous request
        for r in s.all_requests():
            prev = last.get(r.agent, ())
            shared = 0
            for a, b in zip(prev, r.hash_ids):
                if a != b:
                    break
                shared += 1
            ins.append(r.in_tokens)
            outs.append(r.out_tokens)
            news.append(max(r.in_tokens - shared * s.block_size, 1))
            last[r.agent] = r.hash_ids
    if not ins:
        raise ValueError(f"no request in the traces under {path}")
    return Workload(round(sum(ins) / len(ins)), max(round(sum(outs) / len(outs)), 1),
                    round(sum(news) / len(news)))


async def _vocab(url: str, api_key: str | None, model: str | None) -> tuple[int, str | None]:
    from loomserve.bench.replay.probe import probe_server
    from loomserve.bench.replay.transport import HttpxTransport
    t = HttpxTransport(url, pool=1, request_timeout=120, api_key=api_key)
    try:
        info = await probe_server(t, model, None, mode="ids")
    finally:
        await t.aclose()
    return info.vocab_size, info.model


async def _run(args, workload) -> dict:
    from loomserve.bench.pd_profile.report import summarize
    from loomserve.bench.pd_profile.runner import Profiler
    vocab, model = args.vocab_size, args.model
    if not vocab or not model:
        probed_vocab, probed_model = await _vocab(args.prefill, args.api_key, model)
        vocab, model = vocab or probed_vocab, model or probed_model
    prof = Profiler(workload, vocab, model, args.rounds, args.gain, args.seed,
                    args.request_timeout, args.api_key)
    decode_url = args.decode or args.prefill
    prefill = await prof.phase(args.prefill, "prefill", args.max_concurrency)
    decode = await prof.phase(decode_url, "decode", args.max_concurrency)
    combined = []
    if args.router:
        combined = await prof.phase(args.router, "combined", args.max_concurrency,
                                    stop_at_saturation=False)
    return summarize(workload, prefill, decode, combined, args.instances, args.gain,
                     colocated=decode_url.rstrip("/") == args.prefill.rstrip("/"))


def main(args: argparse.Namespace) -> int:
    from loomserve.bench.pd_profile.report import markdown, plot
    from loomserve.bench.pd_profile.runner import Workload
    try:
        if args.traces:
            workload = workload_from_traces(args.traces)
        else:
            if args.input_len < 1 or args.output_len < 1:
                raise ValueError("--input-len and --output-len must be >= 1")
            workload = Workload(args.input_len, args.output_len)
        result = asyncio.run(_run(args, workload))
    except (ValueError, RuntimeError) as e:
        print(f"loomserve bench pd-profile: error: {e}", file=sys.stderr)
        return 1
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result) if args.json else markdown(result))
    return 0
