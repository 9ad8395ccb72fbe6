"""`loomserve router`: the command line of the router (docs/usage/cluster-and-router.md)."""

from __future__ import annotations

import argparse
import logging
import sys

from loomserve.api.log_format import configure_logging, uvicorn_log_config
from loomserve.control.router.pd import DEFAULT_PD_THRESHOLD_TOKENS
from loomserve.control.router.policies import (
    OVERLAP_WEIGHT,
    OVERLOAD_FACTOR,
    OVERLOAD_MIN_REQUESTS,
    POLICIES,
)


def add_router_parser(sub) -> None:
    p = sub.add_parser(
        "router", help="route requests across loomserve instances (session- and KV-aware)",
        description="An HTTP front for N `loomserve serve` instances: the OpenAI and Anthropic "
                    "APIs proxied (streaming included) to the instance the policy picks.")
    p.add_argument("--instance", action="append", required=True, metavar="URL",
                   help="an instance's base URL, e.g. http://127.0.0.1:8000 (repeat per "
                        "instance; role, block size and KV events are read from its /info)")
    p.add_argument("--policy", choices=POLICIES, default="default",
                   help="default: sticky sessions placed by KV overlap and load; kv_aware: "
                        "lowest KV cost per request; session: consistent hashing; "
                        "least_loaded; round_robin (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=9000, help="port (default: %(default)s)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="model folder or hub id (org/name) whose tokenizer and chat template "
                        "the router renders prompts with (default: the first instance's "
                        "model_folder)")
    p.add_argument("--chat-template", metavar="PATH",
                   help="the instances' own --chat-template file, so the router renders "
                        "prompts as they do (default: the model's)")
    p.add_argument("--overlap-weight", type=float, default=OVERLAP_WEIGHT, metavar="W",
                   help="KV cost of a block to prefill against a block decoding "
                        "(default: %(default)s)")
    p.add_argument("--overload-factor", type=float, default=OVERLOAD_FACTOR, metavar="X",
                   help="default policy: an instance is overloaded when its active blocks "
                        "exceed this x the healthy instances' mean, now and over ~30 s "
                        "(default: %(default)s)")
    p.add_argument("--overload-min-requests", type=int, default=OVERLOAD_MIN_REQUESTS,
                   metavar="N", help="default policy: ... and has at least N requests in "
                   "flight (default: %(default)s)")
    p.add_argument("--pd-threshold-tokens", type=int, default=DEFAULT_PD_THRESHOLD_TOKENS,
                   metavar="N", help="with prefill-role instances: prefill a request there "
                   "when more than N of its prompt tokens are not cached on its decode "
                   "instance (default: %(default)s)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require this key of clients; repeatable (default: none)")
    p.add_argument("--instance-api-key", metavar="KEY",
                   help="key the router sends to instances (default: the client's "
                        "Authorization, forwarded)")
    p.add_argument("--read-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="longest silence from an instance before a request fails "
                        "(default: %(default)s)")
    p.add_argument("--health-interval", type=float, default=0.5, metavar="SECONDS",
                   help="time between health checks of each instance (default: %(default)s)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log level (default: %(default)s)")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="log lines as text, or one JSON object per line (default: %(default)s)")
    p.add_argument("--otlp-traces-endpoint", metavar="URL", default=None,
                   help="export OpenTelemetry traces over OTLP/HTTP to URL; the router's spans "
                        "parent the instances' (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
                        "else no tracing)")
    p.set_defaults(func=run_router)


def build_from_args(args: argparse.Namespace):
    """The router app the flags describe (tests build it the same way)."""
    from loomserve.api.serve import traces_endpoint
    from loomserve.control.router.app import build_router_app
    from loomserve.control.router.instances import InstanceSet
    from loomserve.control.router.kv_index import KVIndex
    from loomserve.control.router.metrics import RouterMetrics
    from loomserve.control.router.policies import make_policy
    from loomserve.control.router.routing import Router

    index = KVIndex()
    instances = InstanceSet(args.instance, index, api_key=args.instance_api_key,
                            interval=args.health_interval)
    policy = make_policy(args.policy, index, instances.block_size, args.overlap_weight,
                         args.overload_factor, args.overload_min_requests)
    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise ValueError(f"--chat-template: cannot read {args.chat_template}: {e}") from e
    router = Router(instances, index, policy, RouterMetrics(), tokenizer=args.tokenizer,
                    chat_template=template, pd_threshold_tokens=args.pd_threshold_tokens)
    return build_router_app(router, api_keys=args.api_key,
                            instance_api_key=args.instance_api_key,
                            read_timeout=args.read_timeout,
                            otlp_traces_endpoint=traces_endpoint(
                                getattr(args, "otlp_traces_endpoint", None)))


def run_router(args: argparse.Namespace) -> int:
    import uvicorn
    log_format = getattr(args, "log_format", "text")
    configure_logging(args.log_level, log_format)
    # httpx logs every request at INFO: the health checks alone would be 2 lines/s/instance
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        app = build_from_args(args)
    except ValueError as e:
        print(f"loomserve router: error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                log_config=uvicorn_log_config(log_format), timeout_graceful_shutdown=5)
    return 0
