"""`loomserve bench synth`: the command line of the trace synthesizer.

    loomserve bench synth --profile agentx --sessions N --seed S --out DIR
                          [--forked-subagents FRACTION] [--json]

Writes trace_0000.json ... into DIR, then prints the measured statistics and the comparison with
the profile's targets (with --json: one JSON object on stdout, progress on stderr).

Invariant: exit status 2 on a bad option, 0 otherwise.
"""

from __future__ import annotations

import json
import sys

from loomserve.bench.synth.generate import write_traces
from loomserve.bench.synth.profiles import PROFILES
from loomserve.bench.synth.targets import compare, format_compare

__all__ = ["add_arguments", "main"]


def add_arguments(p) -> None:
    p.add_argument("--profile", default="agentx", choices=sorted(PROFILES),
                   help="target profile (default agentx: the AgentX v1.0 published figures)")
    p.add_argument("--sessions", type=int, default=64, help="number of sessions (default 64)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--out", required=True, help="output directory (trace_NNNN.json)")
    p.add_argument("--forked-subagents", type=float, default=0.0, metavar="FRACTION",
                   help="fraction of subagents forked from the parent's context (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def main(args) -> int:
    prof = PROFILES[args.profile]
    if args.sessions < 1:
        print("error: --sessions must be >= 1", file=sys.stderr)
        return 2
    if not 0.0 <= args.forked_subagents <= 1.0:
        print("error: --forked-subagents must lie in [0, 1]", file=sys.stderr)
        return 2

    def progress(i, n):
        if i == n or i % max(1, n // 20) == 0:
            print(f"\rsynth: {i}/{n} sessions", end="\n" if i == n else "", file=sys.stderr)

    st = write_traces(prof, args.sessions, args.seed, args.out, args.forked_subagents, progress)
    rows = compare(prof, st)
    if args.json:
        stats = {k: v for k, v in st.items() if k != "per_trace"}
        print(json.dumps({"profile": prof.name, "sessions": args.sessions, "seed": args.seed,
                          "out": args.out, "forked_subagents": args.forked_subagents,
                          "compare": rows, "stats": stats}))
    else:
        from loomserve.bench.stats import format_stats
        print(f"wrote {args.sessions} sessions to {args.out} (profile {prof.name}: "
              f"{prof.description})", file=sys.stderr)
        print(format_stats(st))
        print()
        print(format_compare(rows))
    return 0
