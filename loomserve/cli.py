"""Command line: `loomserve serve [MODEL] [options]`, `loomserve bench ...`, `loomserve store`,
`loomserve router`, `loomserve cluster`.

Subcommands keep room for `loomserve bench ...`. Option defaults are read from EngineConfig so
the numbers live in one place.
"""

from __future__ import annotations

import argparse
import os
import sys

from loomserve.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    EVICTION_POLICIES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    EngineConfig,
    flat_defaults,
    flat_fields,
)
from loomserve.api.response_store import DEFAULT_MAX_SIZE as DEFAULT_STORE_SIZE
from loomserve.api.response_store import DEFAULT_TTL_S as DEFAULT_STORE_TTL_S

_DEFAULTS = flat_defaults()
_DEFAULTS["retention"] = ",".join(_DEFAULTS["retention"]) or "none"


def _target_ms(value: str) -> float | None:
    """--target-step-ms: auto (None) or milliseconds >= 0."""
    if value == "auto":
        return None
    ms = float(value)
    if ms < 0:
        raise argparse.ArgumentTypeError("must be auto or >= 0")
    return ms


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", default=_DEFAULTS["model"],
                   help="HF model folder or .gguf file (default: the built-in SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    p.add_argument("--served-model-name", dest="served_model_names", nargs="+", metavar="NAME",
                   default=None,
                   help="names clients may send as `model` (one or more; the first is the one "
                        "responses report and /v1/models lists first) (default: from the model)")
    p.add_argument("--max-model-len", type=int, default=_DEFAULTS["max_model_len"],
                   help="context length (default: the model's own, capped at the KV capacity)")
    p.add_argument("--kv-cache-memory", default=_DEFAULTS["kv_cache_memory"],
                   help="KV cache size: bytes (2GiB, 500MB) or a fraction of free GPU memory "
                        "(0.8) (default: 1 GiB on CPU, 0.85 on GPU)")
    p.add_argument("--kv-cache-dtype", default=_DEFAULTS["kv_cache_dtype"], metavar="DTYPE",
                   help=f"dtype of the stored K/V: {', '.join(KV_CACHE_DTYPES)} (or fp32, bf16, "
                        "fp16, fp8 = fp8_e4m3); auto: the model's --dtype. bfloat16 beside float32 "
                        "weights halves the KV bytes a decode step reads and doubles the tokens "
                        "the cache holds; fp8 quarters them (8-bit floats, no scale, saturating; "
                        "less exact: see the README) (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=_DEFAULTS["block_size"],
                   help="tokens per KV block (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=_DEFAULTS["max_num_batched_tokens"], help="token budget per step (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=_DEFAULTS["max_num_seqs"],
                   help="most requests in the running batch (default: %(default)s)")
    p.add_argument("--long-prefill-threshold", type=int,
                   default=_DEFAULTS["long_prefill_threshold"],
                   help="per-request prefill tokens per step (0 disables the cap) (default: %(default)s)")
    p.add_argument("--scheduling-policy", choices=["cache_aware", "priority", "fcfs"],
                   default=_DEFAULTS["scheduling_policy"],
                   help="waiting requests' admission order: cache_aware (request priority, then "
                        "warm sessions and least uncached work, with aging), priority (request "
                        "priority, then arrival), fcfs (arrival) (default: %(default)s)")
    p.add_argument("--target-step-ms", type=_target_ms, default=_DEFAULTS["target_step_ms"],
                   help="step-time budget: long prefills are cut so a step's predicted time "
                        "stays within it; auto: 2.5x the learned cost of the running decodes; 0: "
                        "off, the token budget only (default: 0; see README)")
    p.add_argument("--max-postpone-ms", type=float, default=_DEFAULTS["max_postpone_ms"],
                   help="aging: a request waiting longer goes to the front of the admission "
                        "order (default: %(default)s)")
    p.add_argument("--prefill-schedule-interval", type=int, metavar="N",
                   default=_DEFAULTS["prefill_schedule_interval"],
                   help="admit new prefill work only every N steps (decodes and running prefill "
                        "chunks continue every step), so data-parallel ranks prefill on the same "
                        "steps (default: %(default)s = every step)")
    p.add_argument("--stream-interval", type=int, metavar="N",
                   default=_DEFAULTS["stream_interval"],
                   help="send a request's tokens to the client N at a time (its first and last at "
                        "once): fewer wake-ups per token for the API process and the client, "
                        "chunkier streams (default: %(default)s = every token)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=_DEFAULTS["dtype"],
                   help="weights and activations dtype (and the KV cache's, unless "
                        "--kv-cache-dtype); auto: bfloat16 on CUDA, float32 on CPU "
                        "(default: %(default)s)")
    p.add_argument("--quantization", choices=list(QUANTIZATIONS), default=_DEFAULTS["quantization"],
                   help="weight quantization: none, gguf (keep a .gguf file's own blocks), int8 or "
                        "int4 (weight-only, quantized at load), fp8 (e4m3 weights, fp8 matmuls on "
                        "CUDA sm_89+) (default: %(default)s)")
    p.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS),
                   default=_DEFAULTS["attention_backend"],
                   help="auto: in-place paged kernels where the device has them, else torch "
                        "(default: %(default)s)")
    p.add_argument("--cuda-graphs", action="store_true", default=_DEFAULTS["cuda_graphs"],
                   help="capture decode steps as CUDA graphs (one CUDA rank, triton attention, "
                        "no linear-state layers; off until measured on a GPU)")
    p.add_argument("--device", default=_DEFAULTS["device"],
                   help="auto, cpu, cuda, cuda:1, ... (default: %(default)s)")
    p.add_argument("--seed", type=int, default=_DEFAULTS["seed"],
                   help="random seed (default: %(default)s)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=_DEFAULTS["enable_prefix_caching"], help="disable prefix caching")
    p.add_argument("--retention", default=_DEFAULTS["retention"],
                   help="hybrid models: state checkpoints to keep besides sequence ends, a comma "
                        "list of interval (end of each turn's prompt) and marconi (where a prefix "
                        "is reused without one), or none (default: %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=_DEFAULTS["checkpoint_every"],
                   help="with interval retention, also a checkpoint every N tokens (0: off)")
    p.add_argument("--max-checkpoints-per-path", type=int,
                   default=_DEFAULTS["max_checkpoints_per_path"],
                   help="most state checkpoints one request keeps (default: %(default)s)")
    p.add_argument("--eviction", choices=EVICTION_POLICIES, default=_DEFAULTS["eviction"],
                   help="which cached block goes first: least recently used, or lowest recency + "
                        "FLOPs-saved-per-byte utility (default: %(default)s)")
    p.add_argument("--session-pin-ttl", type=float, default=_DEFAULTS["session_pin_ttl"],
                   help="keep a session's latest prefix through tool pauses for this many seconds "
                        "(0: off; needs --session-pin-budget)")
    p.add_argument("--session-pin-budget", default=_DEFAULTS["session_pin_budget"],
                   help="most KV bytes pinned for sessions in all, e.g. 512MiB")
    t = p.add_argument_group("KV tiers", "pages below the device pool; all off by default")
    t.add_argument("--host-cache-memory", default=_DEFAULTS["host_cache_memory"],
                   help="host memory for KV pages evicted from the device, e.g. 8GiB (default: off)")
    t.add_argument("--disk-cache-dir", default=_DEFAULTS["disk_cache_dir"],
                   help="local disk tier directory; pages survive a restart (default: off)")
    t.add_argument("--disk-cache-size", default=_DEFAULTS["disk_cache_size"],
                   help="bytes the disk tier may use (default: %(default)s)")
    t.add_argument("--remote-cache", default=_DEFAULTS["remote_cache"],
                   help="shared pool: mooncake://HOST:PORT (the master, see `loomserve store`) "
                        "or redis://HOST:PORT (default: off)")
    t.add_argument("--tier-write-after-seen", type=int,
                   default=_DEFAULTS["tier_write_after_seen"],
                   help="write a block down once computed or hit this many times "
                        "(default: %(default)s)")
    t.add_argument("--tier-max-inflight", type=int, default=_DEFAULTS["tier_max_inflight"],
                   help="most requests with a tier lookup or load in flight "
                        "(default: %(default)s)")
    _add_parallel(p)
    a = p.add_argument_group("admission and access")
    a.add_argument("--max-waiting-requests", type=int, default=_DEFAULTS["max_waiting_requests"],
                   help="most requests waiting for admission; more get HTTP 429 with "
                        "Retry-After (default: one per KV block of the pool)")
    a.add_argument("--api-key", default=os.environ.get("LOOMSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every "
                        "route but /health and /metrics (default: $LOOMSERVE_API_KEY, else none)")
    c = p.add_argument_group("chat", "how chat requests are rendered and their output parsed")
    c.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a Jinja chat template file used instead of the model's")
    c.add_argument("--tool-call-parser", default="auto", metavar="NAME",
                   help="tool-call format: auto (from the chat template and model type), none, "
                        "or one of hermes, qwen3_coder, llama3_json, mistral, deepseek_v3, "
                        "kimi_k2, glm45, harmony (default: %(default)s)")
    c.add_argument("--reasoning-parser", default="auto", metavar="NAME",
                   help="reasoning format: auto, none, or one of qwen3, deepseek_r1, gpt_oss "
                        "(default: %(default)s)")
    c.add_argument("--responses-store-size", type=int, default=DEFAULT_STORE_SIZE, metavar="N",
                   help="most responses kept for previous_response_id (default: %(default)s)")
    c.add_argument("--responses-store-ttl", type=float, default=DEFAULT_STORE_TTL_S, metavar="SECONDS",
                   help="how long a stored response stays usable (default: %(default)s)")
    d = p.add_argument_group("control plane", "KV events for routers, prefill/decode roles")
    d.add_argument("--role", choices=["both", "prefill", "decode"], default=_DEFAULTS["role"],
                   help="prefill: compute prompts and hand their KV to decode instances; decode: "
                        "import that KV and generate; both: everything (default: %(default)s)")
    d.add_argument("--kv-events-endpoint", default=_DEFAULTS["kv_events_endpoint"], metavar="ZMQ",
                   help="publish KV block stored/removed events (vLLM's wire format) on this "
                        "ZMQ PUB address, e.g. tcp://*:5557 (default: off)")
    d.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ",
                   help="ZMQ ROUTER address answering replay requests for missed events "
                        "(default: the events port + 1)")
    d.add_argument("--kv-events-buffer-steps", type=int,
                   default=_DEFAULTS["kv_events_buffer_steps"], metavar="N",
                   help="event batches kept for replay (default: %(default)s)")
    d.add_argument("--kv-events-topic", default=_DEFAULTS["kv_events_topic"],
                   help="topic frame of every event message (default: empty)")
    d.add_argument("--kv-transfer-backend", choices=["mooncake", "inproc"],
                   default=_DEFAULTS["kv_transfer_backend"],
                   help="how KV moves between prefill and decode instances: mooncake (Transfer "
                        "Engine over TCP, RDMA where present) (default: %(default)s)")
    d.add_argument("--kv-transfer-host", default=_DEFAULTS["kv_transfer_host"],
                   help="address peer instances reach this one's KV transfers at "
                        "(default: %(default)s)")
    d.add_argument("--kv-transfer-buffer", default=_DEFAULTS["kv_transfer_buffer"], metavar="BYTES",
                   help="host memory a prefill instance stages finished prompts' KV in for their "
                        "decode instances, e.g. 4GiB (default: 1 GiB, at most the pool's size)")
    d.add_argument("--kv-transfer-timeout", type=float, default=_DEFAULTS["kv_transfer_timeout"],
                   metavar="SECONDS",
                   help="how long a prefilled KV waits for its decode instance, and the most a "
                        "transfer may take before the decode side recomputes (default: %(default)s)")
    p.add_argument("--engine-in-process", action="store_true",
                   help="run the engine core in a thread of the server's process instead of its "
                        "own process (one process to debug; the HTTP side then shares its GIL)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="(default: %(default)s)")
    p.set_defaults(func=_serve)


def _add_parallel(p) -> None:
    g = p.add_argument_group("parallelism", "ranks over devices, processes and nodes")
    g.add_argument("--tensor-parallel-size", "-tp", type=int,
                   default=_DEFAULTS["tensor_parallel_size"], metavar="N",
                   help="ranks that run the model together, each with 1/N of the weights and KV "
                        "heads; --kv-cache-memory is per rank (default: %(default)s)")
    g.add_argument("--data-parallel-size", type=int, default=_DEFAULTS["data_parallel_size"],
                   metavar="N", help="engine cores (each its own scheduler and KV pool) "
                   "behind one front end, which places requests by session, cached prefix and "
                   "load; --kv-cache-memory is per core (default: %(default)s)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   default=_DEFAULTS["enable_expert_parallel"],
                   help="with --data-parallel-size N on an MoE model: each DP rank holds 1/N of "
                        "the experts, the ranks step in lockstep (idle ones run dummy steps) and "
                        "exchange tokens at every MoE layer")
    g.add_argument("--decode-context-parallel-size", "-dcp", type=int,
                   default=_DEFAULTS["decode_context_parallel_size"], metavar="D",
                   help="ranks that each hold the whole model and 1/D of every sequence's KV "
                        "(token t on rank (t // I) %% D), attention merged across them by "
                        "log-sum-exp: D x the context per rank's --kv-cache-memory. With "
                        "--tensor-parallel-size 1 only; the Llama family and DeepSeek-V3 "
                        "(default: %(default)s)")
    g.add_argument("--dcp-kv-cache-interleave-size", type=int,
                   default=_DEFAULTS["dcp_kv_cache_interleave_size"], metavar="I",
                   help="consecutive tokens a DCP rank stores before the next rank's turn; "
                        "I x D must divide --block-size (default: %(default)s)")
    g.add_argument("--prefill-context-parallel-size", "-pcp", type=int,
                   default=_DEFAULTS["prefill_context_parallel_size"], metavar="N",
                   help="N ranks (processes), each with the whole model and a KV replica, "
                        "that split every prefill chunk's tokens (PCP: prefill latency, not "
                        "capacity); alone only (default: %(default)s)")
    g.add_argument("--nnodes", type=int, default=_DEFAULTS["nnodes"],
                   help="nodes the ranks are spread over (default: %(default)s)")
    g.add_argument("--node-rank", type=int, default=_DEFAULTS["node_rank"],
                   help="this node's index; node 0 serves HTTP, the others run workers only "
                        "(default: %(default)s)")
    g.add_argument("--master-addr", default=_DEFAULTS["master_addr"],
                   help="address of node 0 for the rendezvous (default: %(default)s)")
    g.add_argument("--master-port", type=int, default=_DEFAULTS["master_port"],
                   help="rendezvous port on node 0; 0 picks a free one (one node only) "
                        "(default: %(default)s)")


def _add_store(sub) -> None:
    from loomserve.control.store_launcher import add_store_parser  # imports no backend
    add_store_parser(sub)


def _add_optional(sub, module_name: str, adder: str) -> None:
    """A subcommand whose module may not exist yet in a partial checkout."""
    import importlib
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not module_name.startswith(exc.name or "\0"):
            raise
        return
    getattr(module, adder)(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loomserve",
                                     description="An LLM serving engine for agentic traffic.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_serve(sub)
    from loomserve.bench.cli import add_bench_parser
    add_bench_parser(sub)
    _add_store(sub)
    _add_optional(sub, "loomserve.control.router.cli", "add_router_parser")
    _add_optional(sub, "loomserve.control.cluster", "add_cluster_parser")
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = flat_fields()
    kwargs = {k: v for k, v in vars(args).items() if k in names}
    served = getattr(args, "served_model_names", None)
    if served:  # the engine reports the first; the server accepts them all
        kwargs["served_model_name"] = served[0]
    return EngineConfig.from_kwargs(**kwargs)


def _serve(args: argparse.Namespace) -> int:
    from loomserve.api.serve import serve
    try:
        config = engine_config_from_args(args)
    except ValueError as e:
        print(f"loomserve: error: {e}", file=sys.stderr)
        return 2
    if config.parallel.node_rank > 0:  # a worker node: its ranks or DP cores only, no HTTP
        if config.parallel.data_parallel_size > 1:
            import logging

            from loomserve.engine.dp_remote import run_headless_dp
            logging.basicConfig(level=args.log_level.upper(),
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            return run_headless_dp(config, args.log_level)
        from loomserve.engine.executor.multiproc import run_headless
        return run_headless(config)
    return serve(args, config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
