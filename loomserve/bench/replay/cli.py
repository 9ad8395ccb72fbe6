"""`loomserve bench agentx`: the command line of the replay (options, run, result JSON).

`run_replay` probes the endpoint, builds the prompt builder and the `Replayer`, scrapes the hit
counters around the run, and returns the result object (config, server, replay, metrics and,
with --records, each request); `main` prints the summary table, writes --json-out and --plots.

Invariants:
- the result's "config" holds every setting that changes what was sent (scale, caps, seed);
- SIGINT interrupts the replay and still returns the partial result (marked "interrupted");
- exit status 0 only when at least one measured request succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

from loomserve.bench.metrics import DEFAULT_PRICES, compute_metrics
from loomserve.bench.prompts import PromptBuilder
from loomserve.bench.replay.driver import Replayer
from loomserve.bench.replay.probe import probe_server
from loomserve.bench.replay.scrape import (
    counter_delta,
    scrape_hit_tokens_by_source,
    scrape_spec_decode,
    spec_decode_summary,
)
from loomserve.bench.replay.timing import RealClock
from loomserve.bench.replay.transport import HttpxTransport, Transport

__all__ = ["add_arguments", "run_replay", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", required=True, help="server root URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--traces", required=True, nargs="+", help="trace files or directories")
    p.add_argument("--concurrency", type=int, default=4, help="live sessions (default: 4)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds to replay (default: 60)")
    p.add_argument("--once", action="store_true",
                   help="fixed work: each live session replays one trace (its slot's first, from "
                        "its warm-start turn to the end) and the run ends when all have "
                        "(--duration still caps it), so every server gets the same requests")
    p.add_argument("--scale", type=int, default=None,
                   help="tokens per trace block (default: the trace block size, i.e. unscaled)")
    p.add_argument("--scale-output", action="store_true", help="scale output tokens like inputs")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply recorded think gaps by this (default: 1)")
    p.add_argument("--max-context", type=int, default=None,
                   help="context cap (default: the server's max_model_len, else 2048)")
    p.add_argument("--max-output", type=int, default=None,
                   help="cap on max_tokens (default: 256 when the context cap is under 32K)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids stay below this (default: /v1/models or probed, else 32000)")
    p.add_argument("--prompt-mode", choices=("auto", "ids", "text"), default="auto",
                   help="token-id or text prompts (default: ids when the server accepts them)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="warm start: random start point plus a one-token primer (default: on)")
    p.add_argument("--seed", type=int, default=None, help="seed for the warm-start points")
    p.add_argument("--pull-in", type=float, default=10.0,
                   help="when nothing is in flight, send the next request within this many s "
                        "(default: %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="after --duration, wait this long for in-flight requests (default: 60)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as a bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--devices", type=int, default=1,
                   help="accelerators behind the endpoint (default: %(default)s)")
    p.add_argument("--device-price-per-hour", type=float, default=None,
                   help="$ per device-hour, for tokens per dollar")
    p.add_argument("--price-cached-input", type=float, default=DEFAULT_PRICES["cached_input"],
                   help="API price, $ per M cached input tokens (default: %(default)s)")
    p.add_argument("--price-input", type=float, default=DEFAULT_PRICES["uncached_input"],
                   help="API price, $ per M uncached input tokens (default: %(default)s)")
    p.add_argument("--price-output", type=float, default=DEFAULT_PRICES["output"],
                   help="API price, $ per M output tokens (default: %(default)s)")
    p.add_argument("--json-out", default=None, help="write the result JSON here")
    p.add_argument("--records", action="store_true", help="include per-request records in JSON")
    p.add_argument("--record-prompts", action="store_true",
                   help="with --records, also each prompt's token ids (ids mode), so the same "
                        "requests can be re-played offline through the KV manager")
    p.add_argument("--record-outputs", action="store_true",
                   help="with --records, also each request's output text")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature sent with every request (default: the server's; "
                        "0 makes outputs comparable across servers)")
    p.add_argument("--metrics-url", nargs="+", default=None,
                   help="scrape these servers' /metrics for the hit split by source instead of "
                        "the endpoint's (e.g. the instances behind a router)")
    p.add_argument("--plots", default=None, help="write PNG plots into this folder")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


async def _ticker(replayer: Replayer, bar, duration: float) -> None:
    while True:
        await asyncio.sleep(1.0)
        ok = sum(1 for r in replayer.records if r.ok and not r.primer)
        err = sum(1 for r in replayer.records if r.error and not r.primer)
        bar.n = min(duration, round(replayer.now(), 1))
        bar.set_postfix(ok=ok, err=err, inflight=replayer.pacer.inflight, refresh=False)
        bar.refresh()


async def run_replay(args, sessions, transport: Transport | None = None, on_record=None) -> dict:
    """Probe, replay and measure. on_record(record) is called as each request ends (tests use
    it to inject faults mid-replay)."""
    own = transport is None
    if own:
        transport = HttpxTransport(args.endpoint, pool=4 * args.concurrency,
                                   request_timeout=args.request_timeout, api_key=args.api_key)
    try:
        info = await probe_server(transport, args.model, args.vocab_size, args.prompt_mode)
        block_size = sessions[0].block_size or 64
        block_tokens = args.scale or block_size
        max_context = args.max_context or info.max_model_len or 2048
        max_output = args.max_output
        if max_output is None and max_context < 32768:
            max_output = 256
        builder = PromptBuilder(info.vocab_size, block_tokens)
        replayer = Replayer(
            sessions, transport=transport, clock=RealClock(), builder=builder, model=info.model,
            concurrency=args.concurrency, duration=args.duration, time_scale=args.time_scale,
            max_context=max_context, max_output=max_output, scale_output=args.scale_output,
            warmup=args.warmup, seed=args.seed, mode=info.mode, pull_in_s=args.pull_in,
            once=getattr(args, "once", False),
            drain_timeout_s=args.drain_timeout, text_ratio=info.text_token_ratio or 1.0,
            keep_prompts=getattr(args, "record_prompts", False) and info.mode == "ids",
            keep_outputs=getattr(args, "record_outputs", False),
            temperature=getattr(args, "temperature", None), on_record=on_record)
        metrics_urls = getattr(args, "metrics_url", None)
        hits_before = await scrape_hit_tokens_by_source(transport, metrics_urls)
        spec_before = await scrape_spec_decode(transport, metrics_urls)
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, replayer.interrupt)
            handler = True
        except (NotImplementedError, RuntimeError, ValueError):
            handler = False
        bar = ticker = None
        if getattr(args, "progress", True):
            from tqdm import tqdm

            bar = tqdm(total=args.duration, unit="s", file=sys.stderr, desc="agentx",
                       bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}s {postfix}")
            ticker = asyncio.ensure_future(_ticker(replayer, bar, args.duration))
        started = time.time()
        try:
            records = await replayer.run()
        finally:
            if handler:
                loop.remove_signal_handler(signal.SIGINT)
            if ticker is not None:
                ticker.cancel()
                bar.close()
        hits_after = await scrape_hit_tokens_by_source(transport, metrics_urls) \
            if hits_before is not None else None
        spec_after = await scrape_spec_decode(transport, metrics_urls) \
            if spec_before is not None else None
    finally:
        if own:
            await transport.aclose()
    prices = {"cached_input": args.price_cached_input, "uncached_input": args.price_input,
              "output": args.price_output}
    metrics = compute_metrics(records, devices=args.devices,
                              device_price_per_hour=args.device_price_per_hour, prices=prices,
                              hit_tokens_by_source=counter_delta(hits_before, hits_after))
    spec = spec_decode_summary(counter_delta(spec_before, spec_after))
    if spec is not None:  # the server speculated (loomserve's spec_decode_* counters)
        metrics["spec_decode"] = spec
    result = {
        "command": "agentx",
        "started_at": started,
        "interrupted": replayer.interrupted,
        "config": {
            "endpoint": args.endpoint, "model": info.model, "traces": list(args.traces),
            "num_traces": len(sessions), "concurrency": args.concurrency,
            "duration_s": args.duration, "once": getattr(args, "once", False),
            "time_scale": args.time_scale,
            "trace_block_size": block_size, "scale": block_tokens,
            "scale_factor": block_tokens / block_size, "scale_output": args.scale_output,
            "max_context": max_context, "max_output": max_output, "warmup": args.warmup,
            "seed": args.seed, "pull_in_s": args.pull_in, "devices": args.devices,
            "temperature": getattr(args, "temperature", None),
            "metrics_urls": metrics_urls,
            "marker_tokens": builder.marker_tokens,
            "truncation": "leading tokens kept (prefix structure), context minus max_tokens",
        },
        "server": {"mode": info.mode, "vocab_size": info.vocab_size,
                   "vocab_source": info.vocab_source, "max_model_len": info.max_model_len,
                   "ids_prompt_tokens_delta": info.ids_prompt_tokens_delta,
                   "text_token_ratio": info.text_token_ratio, "text_stable": info.text_stable,
                   "notes": info.notes},
        "replay": {"session_replays": replayer._replays, "pulled_in_s": replayer.pacer.pulled_in_s},
        "metrics": metrics,
    }
    if getattr(args, "records", False):
        result["records"] = [r.to_dict() for r in records]
    return result


def main(args) -> int:
    from loomserve.bench import report
    from loomserve.bench.trace import load_traces

    sessions = load_traces(args.traces)
    if not sessions:
        print("no traces found", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run_replay(args, sessions))
    except RuntimeError as e:
        print(f"agentx: {e}", file=sys.stderr)
        return 1
    print(report.summary_table(result), file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    if args.plots:
        for path in report.write_run_plots(result, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    return 0 if result["metrics"]["requests"]["ok"] > 0 else 1
