"""Command line: `loomserve serve [MODEL] [options]`, `loomserve router`, `loomserve cluster`,
`loomserve store`, `loomserve bench ...`.

The one module that imports every plane. Option defaults are read from EngineConfig so the
numbers live in one place. Help strings stay short: docs/usage/ explains each option, and
docs/usage/cli.md is generated from these parsers (docs/gen_cli.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from loomserve.api.response_store import DEFAULT_MAX_SIZE as DEFAULT_STORE_SIZE
from loomserve.api.response_store import DEFAULT_TTL_S as DEFAULT_STORE_TTL_S
from loomserve.bench.cli import add_bench_parser
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
from loomserve.config.hf_overrides import parse_hf_overrides
from loomserve.config.speculative import SpeculativeConfig
from loomserve.control.cluster.cli import add_cluster_parser
from loomserve.control.router.cli import add_router_parser
from loomserve.control.store_launcher import add_store_parser

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


def _json_object(value: str) -> dict | None:
    """--hf-overrides: a JSON object (a usage error otherwise)."""
    try:
        return parse_hf_overrides(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--hf-overrides ")) from None


def _speculative(value: str):
    """--speculative-config: checked here, so a bad one is a usage error."""
    try:
        return SpeculativeConfig.parse(value)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative-config")
                                         .lstrip(": ")) from None


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI and Anthropic HTTP APIs",
                       description="Serve a model over the OpenAI (Chat Completions, Completions, "
                                   "Responses) and Anthropic (Messages) HTTP APIs. Each option "
                                   "is explained in docs/usage/.")
    p.add_argument("model", nargs="?", default=_DEFAULTS["model"],
                   help="HF model folder, .gguf file, or Hugging Face hub id (org/name; "
                        "org/name:QUANT picks a GGUF) (default: the built-in "
                        "SmolLM2-135M-Instruct)")
    _add_server(p)
    _add_model(p)
    _add_kv_cache(p)
    _add_scheduling(p)
    _add_tiers(p)
    _add_parallel(p)
    _add_chat(p)
    _add_control(p)
    _add_vllm_options(p)
    p.set_defaults(func=_serve)


def _add_server(p) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    g.add_argument("--served-model-name", dest="served_model_names", nargs="+", metavar="NAME",
                   default=None,
                   help="names clients may send as `model`; the first is the one reported "
                        "(default: the model's folder or file name)")
    g.add_argument("--api-key", default=os.environ.get("LOOMSERVE_API_KEY"), metavar="KEY",
                   help="require `Authorization: Bearer KEY` or `x-api-key: KEY` on every "
                        "route but /health and /metrics (default: $LOOMSERVE_API_KEY, else none)")
    g.add_argument("--max-waiting-requests", type=int, metavar="N",
                   default=_DEFAULTS["max_waiting_requests"],
                   help="most requests waiting for admission; more get HTTP 429 "
                        "(default: one per KV block)")
    g.add_argument("--engine-in-process", action="store_true",
                   help="run the engine core in a thread of the server's process, not its own "
                        "process (for debugging)")
    g.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log level (default: %(default)s)")
    g.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="log lines as text, or one JSON object per line (request logs: "
                        "request_id, session_id, tokens, latency) (default: %(default)s)")
    g.add_argument("--otlp-traces-endpoint", metavar="URL", default=None,
                   help="export OpenTelemetry traces over OTLP/HTTP to URL (a bare "
                        "http://host:4318 gets /v1/traces) (default: "
                        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing)")


def _add_model(p) -> None:
    g = p.add_argument_group("model and device")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=_DEFAULTS["dtype"],
                   help="weights and activations; auto: bfloat16 on CUDA, float32 on CPU "
                        "(default: %(default)s)")
    g.add_argument("--quantization", choices=list(QUANTIZATIONS),
                   default=_DEFAULTS["quantization"],
                   help="auto: a .gguf model's own blocks on a CPU (gguf), else none; none: "
                        "weights dequantized to --dtype at load; gguf: run a .gguf file's own "
                        "blocks; int8, int4: weight-only, quantized at load; fp8: e4m3 weights "
                        "(default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=_DEFAULTS["max_model_len"],
                   metavar="TOKENS",
                   help="context length, prompt and output; past the trained length needs "
                        "RoPE scaling in --hf-overrides (default: the model's own, capped at "
                        "the KV capacity)")
    g.add_argument("--hf-overrides", type=_json_object, default=_DEFAULTS["hf_overrides"],
                   metavar="JSON",
                   help="JSON object merged into the model's config.json as it is read, nested "
                        "objects key by key, e.g. {\"rope_scaling\": {\"rope_type\": \"yarn\", "
                        "\"factor\": 4.0}} to run past the trained context")
    g.add_argument("--revision", default=_DEFAULTS["revision"], metavar="REV",
                   help="a hub model's branch, tag or commit (default: main)")
    g.add_argument("--download-dir", default=_DEFAULTS["download_dir"], metavar="DIR",
                   help="hub cache to download into and read from (default: huggingface_hub's: "
                        "HF_HUB_CACHE, else HF_HOME/hub)")
    g.add_argument("--device", default=_DEFAULTS["device"],
                   help="auto, cpu, cuda, cuda:1, ...; auto: CUDA when present "
                        "(default: %(default)s)")
    g.add_argument("--seed", type=int, default=_DEFAULTS["seed"],
                   help="seed of sampling without a per-request seed (default: %(default)s)")
    g.add_argument("--attention-backend", choices=list(ATTENTION_BACKENDS),
                   default=_DEFAULTS["attention_backend"],
                   help="auto: the in-place paged kernels where the device has them (C on CPU, "
                        "Triton on CUDA), else torch (default: %(default)s)")
    g.add_argument("--cuda-graphs", action="store_true", default=_DEFAULTS["cuda_graphs"],
                   help="replay decode steps as CUDA graphs (one CUDA rank, triton attention; "
                        "off until measured on a GPU)")


def _add_kv_cache(p) -> None:
    g = p.add_argument_group("KV cache")
    g.add_argument("--kv-cache-memory", default=_DEFAULTS["kv_cache_memory"], metavar="SIZE",
                   help="KV pool size: bytes (2GiB, 500MB) or a fraction of memory (0.8), per "
                        "rank (default: 1 GiB on CPU, 0.85 on GPU)")
    g.add_argument("--kv-cache-dtype", default=_DEFAULTS["kv_cache_dtype"], metavar="DTYPE",
                   help=f"dtype K/V rows are stored in: {', '.join(KV_CACHE_DTYPES)} (or fp32, "
                        "bf16, fp16, fp8 = fp8_e4m3); auto: the model's --dtype "
                        "(default: %(default)s)")
    g.add_argument("--block-size", type=int, default=_DEFAULTS["block_size"], metavar="TOKENS",
                   help="tokens per KV block, the prefix-cache granularity (default: %(default)s)")
    g.add_argument("--max-hybrid-block-size", type=int,
                   default=_DEFAULTS["max_hybrid_block_size"], metavar="TOKENS",
                   help="hybrid (attention + linear-state) models: the largest multiple of "
                        "--block-size the block may be raised to so attention and state pages "
                        "hold the same bytes; 0 keeps --block-size (default: 512 when "
                        "--block-size is left at 16, else 0)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   default=_DEFAULTS["enable_prefix_caching"], help="turn prefix caching off")
    g.add_argument("--eviction", choices=EVICTION_POLICIES, default=_DEFAULTS["eviction"],
                   help="which cached block goes first: lru, or flop_aware (recency and FLOPs "
                        "saved per byte) (default: %(default)s)")
    g.add_argument("--retention", default=_DEFAULTS["retention"], metavar="LIST",
                   help="hybrid models: state checkpoints kept besides sequence ends: a comma list "
                        "of interval and marconi, or none (default: %(default)s)")
    g.add_argument("--checkpoint-every", type=int, default=_DEFAULTS["checkpoint_every"],
                   metavar="TOKENS",
                   help="with interval retention, also a checkpoint every N tokens "
                        "(default: %(default)s = off)")
    g.add_argument("--max-checkpoints-per-path", type=int, metavar="N",
                   default=_DEFAULTS["max_checkpoints_per_path"],
                   help="most state checkpoints one request keeps (default: %(default)s)")
    g.add_argument("--session-pin-ttl", type=float, default=_DEFAULTS["session_pin_ttl"],
                   metavar="SECONDS",
                   help="keep each session's latest prefix through tool pauses this long; needs "
                        "--session-pin-budget (default: 0 = off)")
    g.add_argument("--session-pin-budget", default=_DEFAULTS["session_pin_budget"],
                   metavar="SIZE",
                   help="most KV bytes pinned for sessions in all, e.g. 512MiB (default: 0)")


def _add_scheduling(p) -> None:
    g = p.add_argument_group("scheduling")
    g.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                   default=_DEFAULTS["max_num_batched_tokens"],
                   help="token budget of one engine step (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=_DEFAULTS["max_num_seqs"], metavar="N",
                   help="most requests running at once (default: %(default)s)")
    g.add_argument("--long-prefill-threshold", type=int, metavar="N",
                   default=_DEFAULTS["long_prefill_threshold"],
                   help="most prefill tokens one request takes per step; 0: no cap "
                        "(default: %(default)s)")
    g.add_argument("--scheduling-policy", choices=["cache_aware", "priority", "fcfs"],
                   default=_DEFAULTS["scheduling_policy"],
                   help="admission order of waiting requests (default: %(default)s)")
    g.add_argument("--target-step-ms", type=_target_ms, default=_DEFAULTS["target_step_ms"],
                   metavar="MS",
                   help="step-time budget long prefills are cut to fit: auto, a number of ms, "
                        "or 0 (off: the token budget only) (default: 0)")
    g.add_argument("--max-postpone-ms", type=float, default=_DEFAULTS["max_postpone_ms"],
                   metavar="MS",
                   help="a request waiting longer goes to the front of the admission order "
                        "(default: %(default)s)")
    g.add_argument("--prefill-schedule-interval", type=int, metavar="N",
                   default=_DEFAULTS["prefill_schedule_interval"],
                   help="admit new prefill work only every N steps (default: %(default)s = "
                        "every step)")
    g.add_argument("--speculative-config", type=_speculative, metavar="JSON",
                   default=_DEFAULTS["speculative_config"],
                   help="speculative decoding, vLLM's keys: {\"method\": \"ngram\", "
                        "\"suffix\" or \"mtp\", \"num_speculative_tokens\": K, \"prompt_lookup_min\": 2, "
                        "\"prompt_lookup_max\": 5, \"disable_by_batch_size\": N}; "
                        "docs/design/speculative.md (default: off)")
    g.add_argument("--stream-interval", type=int, metavar="N",
                   default=_DEFAULTS["stream_interval"],
                   help="send a request's tokens to the client N at a time (default: "
                        "%(default)s = every token)")
    g.add_argument("--async-scheduling", action="store_true",
                   default=_DEFAULTS["async_scheduling"],
                   help="schedule the next step while this one executes (any rank layout "
                        "with DEP, model, P/D role, KV tier and drafter: a step with drafts "
                        "runs alone); docs/design/scheduler.md (default: off)")


def _add_tiers(p) -> None:
    g = p.add_argument_group("KV tiers", "pages below the device pool; all off by default")
    g.add_argument("--host-cache-memory", default=_DEFAULTS["host_cache_memory"],
                   metavar="SIZE",
                   help="host memory for KV pages evicted from the device, e.g. 8GiB "
                        "(default: off)")
    g.add_argument("--disk-cache-dir", default=_DEFAULTS["disk_cache_dir"], metavar="DIR",
                   help="local disk tier; its pages survive a restart (default: off)")
    g.add_argument("--disk-cache-size", default=_DEFAULTS["disk_cache_size"], metavar="SIZE",
                   help="bytes the disk tier may use (default: 16 GiB)")
    g.add_argument("--remote-cache", default=_DEFAULTS["remote_cache"], metavar="URL",
                   help="shared pool: mooncake://HOST:PORT (see `loomserve store`) or "
                        "redis://HOST:PORT (default: off)")
    g.add_argument("--tier-write-after-seen", type=int, metavar="N",
                   default=_DEFAULTS["tier_write_after_seen"],
                   help="write a block down once computed or hit N times (default: %(default)s)")
    g.add_argument("--tier-max-inflight", type=int, default=_DEFAULTS["tier_max_inflight"],
                   metavar="N",
                   help="most requests with a tier lookup or load in flight "
                        "(default: %(default)s)")


def _add_parallel(p) -> None:
    g = p.add_argument_group("parallelism", "ranks over devices, processes and nodes")
    g.add_argument("--tensor-parallel-size", "-tp", type=int,
                   default=_DEFAULTS["tensor_parallel_size"], metavar="N",
                   help="ranks that run the model together, each with 1/N of the weights and KV "
                        "heads (default: %(default)s)")
    g.add_argument("--data-parallel-size", type=int, default=_DEFAULTS["data_parallel_size"],
                   metavar="N",
                   help="engine cores, each with its own scheduler and KV pool, behind one "
                        "front end (default: %(default)s)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   default=_DEFAULTS["enable_expert_parallel"],
                   help="MoE models with --data-parallel-size N: each core holds 1/N of the "
                        "experts (DEP)")
    g.add_argument("--decode-context-parallel-size", "-dcp", type=int,
                   default=_DEFAULTS["decode_context_parallel_size"], metavar="D",
                   help="ranks that each hold 1/D of every sequence's KV: D x the context "
                        "(default: %(default)s)")
    g.add_argument("--dcp-kv-cache-interleave-size", type=int,
                   default=_DEFAULTS["dcp_kv_cache_interleave_size"], metavar="I",
                   help="consecutive tokens a DCP rank stores before the next rank's turn "
                        "(default: %(default)s)")
    g.add_argument("--prefill-context-parallel-size", "-pcp", type=int,
                   default=_DEFAULTS["prefill_context_parallel_size"], metavar="N",
                   help="ranks that split every prefill chunk's tokens, each with the whole "
                        "model and a KV replica (default: %(default)s)")
    g.add_argument("--nnodes", type=int, default=_DEFAULTS["nnodes"], metavar="K",
                   help="nodes the ranks or engine cores are spread over (default: %(default)s)")
    g.add_argument("--node-rank", type=int, default=_DEFAULTS["node_rank"], metavar="R",
                   help="this node's index; node 0 serves HTTP (default: %(default)s)")
    g.add_argument("--master-addr", default=_DEFAULTS["master_addr"], metavar="ADDR",
                   help="address of node 0 for the rendezvous (default: %(default)s)")
    g.add_argument("--master-port", type=int, default=_DEFAULTS["master_port"], metavar="PORT",
                   help="rendezvous port on node 0; required with --nnodes > 1 "
                        "(default: a free port)")


def _add_chat(p) -> None:
    g = p.add_argument_group("chat", "how chat requests are rendered and their output parsed")
    g.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a Jinja chat template file used instead of the model's")
    g.add_argument("--tool-call-parser", default="auto", metavar="NAME",
                   help="tool-call format: auto, none, hermes, qwen3_coder, llama3_json, "
                        "mistral, deepseek_v3, deepseek_v32, kimi_k2, glm45, minimax_m2, "
                        "harmony (default: %(default)s)")
    g.add_argument("--reasoning-parser", default="auto", metavar="NAME",
                   help="reasoning format: auto, none, qwen3, deepseek_r1, gpt_oss "
                        "(default: %(default)s)")
    g.add_argument("--responses-store-size", type=int, default=DEFAULT_STORE_SIZE, metavar="N",
                   help="most responses kept for previous_response_id (default: %(default)s)")
    g.add_argument("--responses-store-ttl", type=float, default=DEFAULT_STORE_TTL_S,
                   metavar="SECONDS",
                   help="how long a stored response stays usable (default: %(default)s)")


def _add_control(p) -> None:
    g = p.add_argument_group("prefill/decode and KV events",
                             "what routers and other instances see of this one")
    g.add_argument("--role", choices=["both", "prefill", "decode"], default=_DEFAULTS["role"],
                   help="this instance's part in prefill/decode disaggregation "
                        "(default: %(default)s)")
    g.add_argument("--kv-events-endpoint", default=_DEFAULTS["kv_events_endpoint"],
                   metavar="ZMQ",
                   help="publish KV block events (vLLM's format) on this ZMQ PUB address, "
                        "e.g. tcp://*:5557 (default: off)")
    g.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ",
                   help="ZMQ ROUTER address answering replay requests for missed events "
                        "(default: the events port + 1)")
    g.add_argument("--kv-events-buffer-steps", type=int,
                   default=_DEFAULTS["kv_events_buffer_steps"], metavar="N",
                   help="event batches kept for replay (default: %(default)s)")
    g.add_argument("--kv-events-topic", default=_DEFAULTS["kv_events_topic"], metavar="TOPIC",
                   help="topic frame of every event message (default: empty)")
    g.add_argument("--kv-transfer-backend", choices=["mooncake", "inproc"],
                   default=_DEFAULTS["kv_transfer_backend"],
                   help="how KV moves between prefill and decode instances; inproc: engines "
                        "in one process (tests) (default: %(default)s)")
    g.add_argument("--kv-transfer-host", default=_DEFAULTS["kv_transfer_host"], metavar="ADDR",
                   help="address peers reach this instance's KV transfers at "
                        "(default: %(default)s)")
    g.add_argument("--kv-transfer-buffer", default=_DEFAULTS["kv_transfer_buffer"],
                   metavar="SIZE",
                   help="host memory a prefill instance stages prompts' KV in "
                        "(default: 1 GiB, at most the pool's size)")
    g.add_argument("--kv-transfer-timeout", type=float, default=_DEFAULTS["kv_transfer_timeout"],
                   metavar="SECONDS",
                   help="how long staged KV waits for its decode instance, and the most one "
                        "pull may take (default: %(default)s)")


# vLLM options that ask for what loomserve always does: accepted, with no effect
_VLLM_ALWAYS = {
    "--trust-remote-code": "loomserve runs its own model code, never a checkpoint's",
    "--enable-auto-tool-choice": "tool_choice auto works wherever a tool-call parser applies "
                                 "(--tool-call-parser)",
    "--enable-chunked-prefill": "prefill is always chunked",
    "--enforce-eager": "eager is the default (--cuda-graphs turns graphs on)",
    "--disable-log-stats": "loomserve logs no periodic stats (/metrics has them)",
}


def _add_vllm_options(p) -> None:
    g = p.add_argument_group(
        "vLLM's options", "accepted so that a vLLM command line runs as it is: each maps to "
                          "loomserve's own option, or asks for what loomserve always does")
    g.add_argument("--model", dest="model_option", metavar="MODEL",
                   help="the model, as the positional MODEL")
    g.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                   help="on a GPU, --kv-cache-memory F (F of the device's memory for this "
                        "engine); on a CPU no effect (its pool: --kv-cache-memory)")
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true",
                   default=_DEFAULTS["enable_prefix_caching"], help="on by default")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="--no-prefix-caching")
    g.add_argument("--kv-offloading-size", type=float, metavar="GIB",
                   help="--host-cache-memory of this many GiB")
    g.add_argument("--kv-offloading-backend", choices=["native"], metavar="NAME",
                   help="native only: loomserve's own host tier")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per finished request")
    for flag, what in _VLLM_ALWAYS.items():
        g.add_argument(flag, action="store_true", help=f"no effect: {what}")


def vllm_options(args: argparse.Namespace) -> None:
    """Fold vLLM's options (_add_vllm_options) into loomserve's own, in place; ValueError on
    a conflict."""
    model = getattr(args, "model_option", None)
    if model is not None:
        if args.model not in (None, _DEFAULTS["model"], model):
            raise ValueError(f"two models given: {args.model} and --model {model}")
        args.model = model
    f = getattr(args, "gpu_memory_utilization", None)
    if f is not None:
        if not 0 < f <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if args.kv_cache_memory is None and _on_cuda(args):
            args.kv_cache_memory = str(f)
    size = getattr(args, "kv_offloading_size", None)
    if size is not None:
        if args.host_cache_memory not in (None, _DEFAULTS["host_cache_memory"]):
            raise ValueError("both --host-cache-memory and --kv-offloading-size given")
        args.host_cache_memory = f"{size}GiB"
    if getattr(args, "enforce_eager", False) and args.cuda_graphs:
        raise ValueError("--enforce-eager and --cuda-graphs contradict each other")


def _on_cuda(args: argparse.Namespace) -> bool:
    device = getattr(args, "device", "auto")
    if device != "auto":
        return device.startswith("cuda")
    import torch
    return torch.cuda.is_available()


class ArgumentParser(argparse.ArgumentParser):
    """argparse that also takes vLLM's spellings of an option (its FlexibleArgumentParser):
    underscores for dashes (--max_model_len), and a JSON option's keys one at a time
    (--speculative-config.method ngram, nested with more dots), merged over the option's own
    JSON when both are given. Each parser rewrites only its own options (subcommands' parsers
    are of this class too), so an unknown option is reported as it was typed."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(vllm_spellings(args, self._option_string_actions),
                                        namespace)


def vllm_spellings(args: list[str], options: dict) -> list[str]:
    """args with this parser's options in its own spelling (see ArgumentParser)."""
    out: list[str] = []
    keys: dict[str, dict] = {}  # a JSON option -> the keys given one at a time
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            out += args[i:]
            break
        name, eq, value = tok.partition("=")
        base, dot, path = name.partition(".")
        dashed = base.replace("_", "-") if base.startswith("--") else base
        action = options.get(dashed)
        if action is None:
            out.append(tok)
        elif not dot:
            out.append(dashed + eq + value)
        elif action.metavar == "JSON":  # --option.key value / --option.key=value
            if not eq:
                i += 1
                if i == len(args):
                    raise SystemExit(f"loomserve: error: {name} needs a value")
                value = args[i]
            _set_path(keys.setdefault(dashed, {}), path.split("."), _json_or_text(value))
        else:
            out.append(tok)
        i += 1
    for option, given in keys.items():
        out = _merge_json_option(out, option, given)
    return out


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def _set_path(d: dict, path: list[str], value) -> None:
    for key in path[:-1]:
        d = d.setdefault(key, {})
    d[path[-1]] = value


def _merge_json_option(args: list[str], option: str, keys: dict) -> list[str]:
    """args with option's JSON (the last one given, if any) updated by keys, given once."""
    whole: dict = {}
    out: list[str] = []
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == option or tok.startswith(option + "="):
            text = tok.partition("=")[2] if "=" in tok else (args[i + 1] if i + 1 < len(args)
                                                              else "{}")
            i += 1 if "=" in tok else 2
            parsed = _json_or_text(text)
            whole = parsed if isinstance(parsed, dict) else whole
            continue
        out.append(tok)
        i += 1
    _deep_update(whole, keys)
    return out + [option, json.dumps(whole)]


def _deep_update(d: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            _deep_update(d[k], v)
        else:
            d[k] = v


def build_parser() -> argparse.ArgumentParser:
    """The `loomserve` parser with every subcommand; builds it, runs nothing."""
    parser = ArgumentParser(prog="loomserve",
                                     description="An LLM serving engine for agentic traffic.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_serve(sub)
    add_bench_parser(sub)
    add_store_parser(sub)
    add_router_parser(sub)
    add_cluster_parser(sub)
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    vllm_options(args)
    names = flat_fields()
    kwargs = {k: v for k, v in vars(args).items() if k in names}
    served = getattr(args, "served_model_names", None)
    if served:  # the engine reports the first; the server accepts them all
        kwargs["served_model_name"] = served[0]
    return EngineConfig.from_kwargs(**kwargs)


def _serve(args: argparse.Namespace) -> int:
    from loomserve.api.serve import chat_options, serve
    try:
        config = engine_config_from_args(args)
        chat_options(args)  # parser names, templates: a typo fails before a download or load
    except ValueError as e:
        print(f"loomserve: error: {e}", file=sys.stderr)
        return 2
    from loomserve.execution.models.loading.hub import pin_hub_model
    try:  # a hub id is fetched here, once, before any process starts; a path passes
        config = pin_hub_model(config)
    except OSError as e:  # HubError, or a model path that does not exist
        print(f"loomserve: error: {e}", file=sys.stderr)
        return 1
    if config.parallel.node_rank > 0:  # a worker node: its ranks or DP cores only, no HTTP
        if config.parallel.data_parallel_size > 1:
            from loomserve.api.log_format import configure_logging
            from loomserve.engine.dp_remote import run_headless_dp
            # its DP cores inherit the format (config.log_lines)
            configure_logging(args.log_level, getattr(args, "log_format", "text"))
            return run_headless_dp(config, args.log_level)
        from loomserve.engine.executor.multiproc import run_headless
        return run_headless(config)
    return serve(args, config)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
