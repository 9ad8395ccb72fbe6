"""`loomserve bench simulate`: the command line of the offline cache simulator.

    loomserve bench simulate TRACE_OR_DIR... --capacity-tokens N [--block-size B]
        [--policy lru|optimal|infinite[,...]] [--sweep [FRACTIONS] | --sweep-capacities LIST]
        [--semantics loomserve|kvcache-sim] [--stagger S] [--append-outputs] [--plot PNG] [--json]

Prints, per run, the token hit rate, per-request hit-rate percentiles and, for lru, the
manager's CPU time per request (median / p99 / mean us) and requests/s; a sweep also prints the
hit-rate-vs-capacity table (`--plot` draws it with matplotlib).

Invariants: exit status 2 on a bad option or trace, 0 otherwise; with --json exactly one JSON
object on stdout, progress on stderr.
"""

from __future__ import annotations

import json
import sys
import time

from loomserve.bench.miss_gap import format_gap
from loomserve.bench.simulate.policies import PERCENTILES, POLICIES, _log
from loomserve.bench.simulate.sweep import DEFAULT_SWEEP, simulate
from loomserve.bench.simulate.workload import SEMANTICS, Workload
from loomserve.bench.trace import TraceError, load_traces

__all__ = ["format_result", "plot_curve", "add_arguments", "main"]


def format_result(res: dict) -> str:
    lines = [f"simulate: {res['traces']} traces, {res['requests']} requests, block "
             f"{res['block_size']} tokens, semantics {res['semantics']}"
             + (f", measured from request {res['warmup_requests']}"
                if res["warmup_requests"] else "")]
    if "working_set_tokens" in res:
        lines.append(f"working set    {res['working_set_tokens']:,} tokens "
                     f"({res['unique_blocks']:,} blocks)")
    if "curve" in res:
        pols = [p for p in ("lru", "optimal", "infinite") if p in res["policies"]]
        lines.append("")
        lines.append(f"{'capacity tokens':>16} {'of WS':>6} " + " ".join(f"{p:>9}" for p in pols))
        for row in res["curve"]:
            frac = row.get("capacity_fraction")
            lines.append(f"{row['capacity_tokens']:>16,} "
                         + (f"{frac:>6.0%} " if frac is not None else f"{'':>6} ")
                         + " ".join(f"{row[p]:>9.4f}" if p in row else f"{'-':>9}"
                                    for p in pols))
        lines.append("")
    for run in res["runs"]:
        cap = run["capacity_tokens"]
        pr = run["per_request_hit_rate"]
        head = (f"{run['policy']:8} " + (f"capacity {cap:,} tokens" if cap is not None
                                         else "unlimited capacity"))
        lines.append(f"{head}: token hit rate {run['token_hit_rate']:.4f}")
        if pr["n"]:
            lines.append("    per-request hit rate " + " ".join(
                f"p{q} {pr[f'p{q}']:.3f}" for q in PERCENTILES) + f" mean {pr['mean']:.3f}")
        if run.get("miss_gap"):
            lines.extend(format_gap(run["miss_gap"], "    "))
            a = run.get("attribution_cpu_us")
            if a:
                lines.append(f"    miss attribution CPU per request: median {a['median']:.1f} "
                             f"us, p99 {a['p99']:.1f} us")
        if "manager_cpu_us" in run:
            c = run["manager_cpu_us"]
            lines.append(f"    manager CPU per request: median {c['median']:.0f} us, "
                         f"p99 {c['p99']:.0f} us, mean {c['mean']:.0f} us; "
                         f"{run['requests_per_s']:.0f} requests/s; "
                         f"{run['truncated_requests']} truncated, {run['evictions']:,} evictions"
                         + ("" if run["filled_before_window"] is None else
                            f", filled before window: {run['filled_before_window']}"))
    return "\n".join(lines)


def plot_curve(res: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib not installed: no plot")
        return False
    curve = res.get("curve") or []
    if not curve:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    use_frac = all(r.get("capacity_fraction") is not None for r in curve)
    xs = [r["capacity_fraction"] * 100 if use_frac else r["capacity_tokens"] for r in curve]
    labels = {"infinite": "infinite (theoretical)", "optimal": "Belady (offline optimum)",
              "lru": "LRU (loomserve KVCacheManager)"}
    for p, style in (("infinite", "k--"), ("optimal", "g-o"), ("lru", "b-o")):
        if any(p in r for r in curve):
            ax.plot(xs, [r.get(p) for r in curve], style, label=labels[p], markersize=4)
    ax.set_xlabel("capacity, % of working set" if use_frac else "capacity, tokens")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"{res['traces']} traces, {res['requests']} requests, "
                 f"semantics {res['semantics']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(float(x)) for x in s.split(",") if x.strip()]


def add_arguments(p) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE_OR_DIR",
                   help="Weka-format trace files or directories of *.json")
    p.add_argument("--capacity-tokens", type=int, help="KV capacity in tokens")
    p.add_argument("--block-size", type=int, default=None,
                   help="simulator KV block size in tokens (default: the traces' own)")
    p.add_argument("--policy", default=None,
                   help="lru, optimal, infinite or a comma list (default: lru; for a sweep "
                        "lru,optimal,infinite)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--sweep", nargs="?", const=",".join(map(str, DEFAULT_SWEEP)),
                   metavar="FRACTIONS",
                   help="capacities as fractions of the working set (unique blocks * block "
                        "size), comma separated (default 0.1,0.2,...,1.0)")
    g.add_argument("--sweep-capacities", metavar="LIST",
                   help="capacities in tokens, comma separated")
    p.add_argument("--semantics", choices=SEMANTICS, default="loomserve",
                   help="hit accounting: loomserve's or kvcache-simulator's (last 50%% of "
                        "requests, full trace blocks only, no last-token cap)")
    p.add_argument("--warmup-fraction", type=float, default=None,
                   help="leading fraction of requests not measured (default 0, 0.5 for "
                        "kvcache-sim semantics)")
    p.add_argument("--stagger", type=float, default=0.0, metavar="SECONDS",
                   help="start trace i at i*SECONDS (default 0: all traces start together)")
    p.add_argument("--append-outputs", action="store_true",
                   help="also allocate each request's output tokens before freeing it")
    p.add_argument("--plot", metavar="PNG", help="draw the sweep's hit-rate curve (matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def main(args) -> int:
    policies = [x.strip() for x in (args.policy or "").split(",") if x.strip()]
    sweeping = args.sweep is not None or args.sweep_capacities is not None
    if not policies:
        policies = list(POLICIES) if sweeping else ["lru"]
    bad = [x for x in policies if x not in POLICIES]
    if bad:
        print(f"error: unknown policy {bad[0]!r} (choose from {', '.join(POLICIES)})",
              file=sys.stderr)
        return 2
    fractions = capacities = None
    try:
        if args.sweep is not None:
            fractions = _floats(args.sweep)
            if not fractions or any(not 0 < f for f in fractions):
                raise ValueError("--sweep fractions must be > 0")
        elif args.sweep_capacities is not None:
            capacities = _ints(args.sweep_capacities)
        elif args.capacity_tokens is not None:
            capacities = [args.capacity_tokens]
        elif policies != ["infinite"]:
            raise ValueError("give --capacity-tokens, --sweep or --sweep-capacities")
        if capacities is not None and any(c < 1 for c in capacities):
            raise ValueError("capacities must be positive")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        t = time.perf_counter()
        sessions = load_traces(args.traces)
        w = Workload(sessions, block_size=args.block_size, semantics=args.semantics,
                     stagger_s=args.stagger, append_outputs=args.append_outputs,
                     warmup_fraction=args.warmup_fraction)
        _log(f"loaded {len(sessions)} traces, {len(w)} requests "
             f"({time.perf_counter() - t:.1f} s)")
        res = simulate(w, policies, capacities=capacities, fractions=fractions, progress=True)
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        if plot_curve(res, args.plot):
            res["plot"] = args.plot
            _log(f"plot: {args.plot}")
    if args.json:
        print(json.dumps(res))
    else:
        print(format_result(res))
    return 0
