"""`loomserve serve`: the engine core in its own process, the HTTP front end in this one.

Supervision: when the core dies (an exception in its loop, or its process killed) every
in-flight request has already been failed by AsyncLLM; /health and new requests answer 503 for
DEAD_GRACE_S (so a load balancer sees the instance go), then the server shuts down and the
process exits with code 1, for systemd or Kubernetes to restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from loomserve.config import EngineConfig

DEAD_GRACE_S = 2.0
OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
EXIT_CORE_DIED = 1


def _human(n: float) -> str:
    for unit in ("", "K", "M", "B"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"


def startup_line(engine, config: EngineConfig, url: str) -> str:
    ready = engine.ready
    layout = "engine in-process" if engine.core is not None else f"engine core pid {ready.pid}"
    pids = getattr(engine.client, "pids", None)  # data parallelism: one core per DP rank
    if pids:
        layout = f"{len(pids)} data-parallel engine cores (pids {', '.join(map(str, pids))})"
    return (f"loomserve: serving {engine.model_name} "
            f"(from {config.model.model or 'built-in default'}, {_weights(ready)}, {ready.device}, "
            f"{_human(ready.num_params)} params), context {engine.max_model_len} tokens, "
            f"KV cache {engine.kv_capacity_tokens} tokens{_kv_dtype(ready)}, {layout}, on {url}")


def _weights(ready) -> str:
    """How the weights run: a GGUF's blocks in place, or the dtype they were loaded in."""
    if ready.quantization == "gguf":
        return (f"GGUF blocks run in place, activations {ready.dtype}; "
                "--quantization none dequantizes")
    if ready.quantization != "none":
        return f"{ready.quantization} weights, activations {ready.dtype}"
    return ready.dtype


def _kv_dtype(ready) -> str:
    """' (bfloat16)' where the pages' dtype is not the model's (--kv-cache-dtype), else ''."""
    return "" if ready.kv_cache_dtype == ready.dtype else f" ({ready.kv_cache_dtype})"


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run the server for the parsed `loomserve serve` arguments; the process's exit code."""
    import uvicorn

    from loomserve.api.app import build_app
    from loomserve.api.log_format import configure_logging, uvicorn_log_config
    from loomserve.engine.async_llm import AsyncLLM, EngineStartError

    log_format = getattr(args, "log_format", "text")
    configure_logging(args.log_level, log_format)
    if getattr(args, "disable_log_requests", False):  # vLLM's option: no line per request
        logging.getLogger("loomserve.requests").setLevel(logging.WARNING)
    try:
        options = chat_options(args)  # before the model loads: a typo fails fast
    except ValueError as e:
        print(f"loomserve: error: {e}", file=sys.stderr)
        return 2
    try:
        engine = AsyncLLM(config, in_process=args.engine_in_process,
                          log_level=args.log_level.upper())
    except EngineStartError as e:
        print(f"loomserve: error: {e}", file=sys.stderr)
        return 1
    app = None
    try:
        app = build_app(engine, api_keys=[args.api_key] if args.api_key else None,
                        otlp_traces_endpoint=traces_endpoint(
                            getattr(args, "otlp_traces_endpoint", None)), **options)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level=args.log_level,
                                               log_config=uvicorn_log_config(log_format),
                                               timeout_graceful_shutdown=5))
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(startup_line(engine, config, f"http://{host}:{args.port}"), flush=True)
        _run_loop(_run(server, engine))
    finally:
        engine.shutdown()
        if app is not None and app.state.tracing is not None:
            app.state.tracing.shutdown()  # export the spans still buffered
    if engine.dead is not None:
        print(f"loomserve: the engine core died ({engine.dead.error}); exiting",
              file=sys.stderr, flush=True)
        return EXIT_CORE_DIED
    return 0


def chat_options(args: argparse.Namespace) -> dict:
    """build_app's chat options from the serve flags; ValueError for an unreadable template
    or an unknown parser name."""
    from loomserve.api.reasoning import get_reasoning_parser
    from loomserve.api.tool_parsers import get_tool_parser

    for flag, get in (("tool_call_parser", get_tool_parser),
                      ("reasoning_parser", get_reasoning_parser)):
        name = getattr(args, flag, "auto")
        if name not in ("auto", "none"):
            try:
                get(name)
            except ValueError as e:
                raise ValueError(f"--{flag.replace('_', '-')}: {e}") from None
    template = None
    if getattr(args, "chat_template", None):
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise ValueError(f"--chat-template: cannot read {args.chat_template}: {e}") from e
    return {"served_model_names": getattr(args, "served_model_names", None),
            "chat_template": template,
            "tool_call_parser": getattr(args, "tool_call_parser", "auto"),
            "reasoning_parser": getattr(args, "reasoning_parser", "auto"),
            "response_store": _response_store(args)}


def _response_store(args: argparse.Namespace):
    from loomserve.api.response_store import (
        DEFAULT_MAX_SIZE,
        DEFAULT_TTL_S,
        ResponseStore,
    )

    size = getattr(args, "responses_store_size", DEFAULT_MAX_SIZE)
    ttl = getattr(args, "responses_store_ttl", DEFAULT_TTL_S)
    try:
        return ResponseStore(max_size=size, ttl_s=ttl)
    except ValueError as e:
        raise ValueError(f"--responses-store-size / --responses-store-ttl: {e}") from None


def _run_loop(main) -> None:
    """Run the server on uvloop where it is installed (a dependency on Linux and macOS), as
    vLLM and SGLang do, else on asyncio's own loop. With uvicorn's httptools parser (picked
    when installed) it cuts the API process's CPU per streamed token, which on a small host
    competes with the decode (docs/design/scheduler.md)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


async def _run(server, engine) -> None:
    loop = asyncio.get_running_loop()

    def stop_later(_dead) -> None:  # on a client thread
        loop.call_soon_threadsafe(loop.call_later, DEAD_GRACE_S, _stop, server)

    engine.on_dead(stop_later)
    await server.serve()


def _stop(server) -> None:
    server.should_exit = True


def traces_endpoint(flag: str | None) -> str | None:
    """--otlp-traces-endpoint, else $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else None (off)."""
    return flag or os.environ.get(OTLP_ENDPOINT_ENV) or None
