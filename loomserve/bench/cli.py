"""`loomserve bench ...`: trace statistics, synthesis, replay, cache simulation, comparison.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `main(args) -> int`.
With `--json`, a command prints its result as one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

from loomserve.bench import pd_profile, replay, report, simulate, stats, synth

COMMANDS = {
    "stats": (stats, "validate traces and print their statistics"),
    "synth": (synth, "generate synthetic traces matching a target profile"),
    "agentx": (replay, "replay traces closed-loop against an OpenAI-compatible endpoint"),
    "simulate": (simulate, "replay traces through the KV cache manager offline"),
    "compare": (report, "set two replay results side by side"),
    "pd-profile": (pd_profile, "profile prefill/decode saturation, derive the P:D ratio"),
}


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="agentic-workload benchmarks (AgentX)",
                           description=__doc__.splitlines()[0])
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
