"""`loomserve bench ...`: trace statistics, synthesis, replay, cache simulation, comparison.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `main(args) -> int`.
With `--json`, a command prints its result as one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import importlib

COMMANDS = {
    "stats": ("loomserve.bench.stats", "validate traces and print their statistics"),
    "synth": ("loomserve.bench.synth", "generate synthetic traces matching a target profile"),
    "agentx": ("loomserve.bench.replay", "replay traces closed-loop against an OpenAI-compatible endpoint"),
    "simulate": ("loomserve.bench.simulate", "replay traces through the KV cache manager offline"),
    "compare": ("loomserve.bench.report", "set two replay results side by side"),
    "pd-profile": ("loomserve.bench.pd_profile", "profile prefill/decode saturation, derive the P:D ratio"),
}


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="agentic-workload benchmarks (AgentX)",
                           description=__doc__.splitlines()[0])
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # not built yet
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
