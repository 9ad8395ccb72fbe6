"""Reports over replay results: the summary table, `loomserve bench compare`, and PNG plots.

`loomserve bench compare A.json B.json [C.json ...] [--json] [--plots DIR]` sets runs side by
side with ratios against the first run (B/A). With --plots it also draws the Pareto view
(interactivity vs TPGS, one curve per system over its concurrency points) and the TTFT CDFs.
Runs are only comparable when they did the same work: compare refuses (exit 3) runs whose
context or output caps differ or whose prompt tokens per request differ by more than
WORK_TOLERANCE from the first run's, unless --allow-different-work (then they are flagged).
Runs against loomserve also show the served hit rate split by source (device and each KV tier:
the share of prompt tokens each served, and its hit tokens), one row per source any run has.
"""

from __future__ import annotations

import json
import os
import re
import sys

from loomserve.bench.miss_gap import format_gap

WORK_TOLERANCE = 0.02  # prompt tokens per request may differ this much between compared runs

# (label, path into the result, format, higher is better?)
ROWS = [
    ("concurrency", ("config", "concurrency"), "{:.0f}", None),
    ("scale (tokens/block)", ("config", "scale"), "{:.0f}", None),
    ("time scale", ("config", "time_scale"), "{:g}", None),
    ("prompt mode", ("server", "mode"), "{}", None),
    ("window s", ("metrics", "window_s"), "{:.1f}", None),
    ("requests ok", ("metrics", "requests", "ok"), "{:.0f}", True),
    ("errors", ("metrics", "requests", "errors"), "{:.0f}", False),
    ("truncated", ("metrics", "requests", "truncated"), "{:.0f}", None),
    ("TPGS tok/s/device", ("metrics", "tpgs"), "{:.1f}", True),
    ("output tok/s", ("metrics", "output_tps"), "{:.1f}", True),
    ("interactivity (E2E) tok/s", ("metrics", "interactivity"), "{:.2f}", True),
    ("interactivity (ITL p90) tok/s", ("metrics", "interactivity_itl_p90"), "{:.2f}", True),
    ("TTFT p50 s", ("metrics", "ttft_s", "p50"), "{:.4f}", False),
    ("TTFT p90 s", ("metrics", "ttft_s", "p90"), "{:.4f}", False),
    ("TTFT p99 s", ("metrics", "ttft_s", "p99"), "{:.4f}", False),
    ("ITL p50 s", ("metrics", "itl_s", "p50"), "{:.4f}", False),
    ("ITL p90 s", ("metrics", "itl_s", "p90"), "{:.4f}", False),
    ("ITL p99 s", ("metrics", "itl_s", "p99"), "{:.4f}", False),
    ("E2E p50 s", ("metrics", "e2e_s", "p50"), "{:.3f}", False),
    ("E2E p90 s", ("metrics", "e2e_s", "p90"), "{:.3f}", False),
    ("E2E p99 s", ("metrics", "e2e_s", "p99"), "{:.3f}", False),
    ("hit rate served", ("metrics", "hit_rate", "served"), "{:.2%}", True),
    ("hit rate theoretical", ("metrics", "hit_rate", "theoretical"), "{:.2%}", None),
    ("spec decode acceptance", ("metrics", "spec_decode", "acceptance_rate"), "{:.2%}", True),
    ("spec decode mean accept length", ("metrics", "spec_decode", "mean_acceptance_length"),
     "{:.2f}", True),
    ("prompt tokens", ("metrics", "tokens", "prompt"), "{:.0f}", None),
    ("output tokens", ("metrics", "tokens", "output"), "{:.0f}", None),
    ("tokens per $", ("metrics", "cost", "tokens_per_usd"), "{:.4g}", True),
    ("served $", ("metrics", "cost", "served_usd"), "{:.4g}", False),
    ("API-equivalent $", ("metrics", "cost", "api_equivalent_usd"), "{:.4g}", None),
    ("API / served cost", ("metrics", "cost", "api_to_served_ratio"), "{:.3g}", True),
]


def source_rows(results: list[dict]) -> list[tuple]:
    """Rows for the served hit rate split by source, over the sources any result has."""
    from loomserve.bench.metrics import source_key

    sources: set[str] = set()
    for r in results:
        sources.update(get(r, ("metrics", "hit_rate", "by_source")) or {})
    ordered = sorted(sources, key=source_key)
    return ([(f"hit rate from {s}", ("metrics", "hit_rate", "by_source", s), "{:.2%}", None)
             for s in ordered]
            + [(f"hit tokens from {s}", ("metrics", "tokens", "cached_by_source", s), "{:.0f}",
                None) for s in ordered])


def gap_rows(results: list[dict]) -> list[tuple]:
    """Rows for the hit-rate gap by miss cause, over the causes any result has."""
    causes: dict[str, float] = {}
    for r in results:
        for c, v in (get(r, ("metrics", "miss_gap", "points")) or {}).items():
            causes[c] = max(causes.get(c, 0.0), v)
    if not causes and not any(get(r, ("metrics", "miss_gap", "gap_points")) is not None
                              for r in results):
        return []
    return ([("hit gap points", ("metrics", "miss_gap", "gap_points"), "{:.2f}", False)]
            + [(f"gap from {c}", ("metrics", "miss_gap", "points", c), "{:.2f}", False)
               for c in sorted(causes, key=lambda c: -causes[c])]
            + [("gap unattributed", ("metrics", "miss_gap", "unattributed_points"), "{:.2f}",
                None)])


def rows_for(results: list[dict]) -> list[tuple]:
    """ROWS, with the split by source and the gap by miss cause (when any run has them)
    after the theoretical hit rate."""
    extra = source_rows(results) + gap_rows(results)
    if not extra:
        return list(ROWS)
    at = next(i for i, r in enumerate(ROWS) if r[0] == "hit rate theoretical") + 1
    return [*ROWS[:at], *extra, *ROWS[at:]]


def get(obj, path):
    for k in path:
        if not isinstance(obj, dict) or k not in obj:
            return None
        obj = obj[k]
    return obj


def _fmt(fmt: str, v) -> str:
    if v is None:
        return "-"
    try:
        return fmt.format(v)
    except (ValueError, TypeError):
        return str(v)


def summary_table(result: dict) -> str:
    m = result.get("metrics", {})
    lines = [f"agentx replay: {get(result, ('config', 'model'))} @ "
             f"{get(result, ('config', 'endpoint'))}" + ("  (INTERRUPTED, partial)"
                                                          if result.get("interrupted") else "")]
    rows = rows_for([result])
    width = max(len(r[0]) for r in rows)
    for label, path, fmt, _ in rows:
        lines.append(f"  {label:<{width}}  {_fmt(fmt, get(result, path))}")
    scrape = m.get("hit_source_scrape")
    if scrape and not scrape.get("exact"):
        lines.append(f"  note: hit split from /metrics: {scrape['server_delta_total']:.0f} hit "
                     f"tokens on the server vs {scrape['replay_cached_tokens']:.0f} in the "
                     "measured usage (primers or other traffic); attributed pro rata")
    lines.extend(format_gap(m.get("miss_gap") or {}))
    errs = m.get("errors_by_kind") or {}
    if errs:
        lines.append("  errors by kind: " + ", ".join(f"{k}={v}" for k, v in sorted(errs.items())))
    for note in get(result, ("server", "notes")) or []:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def compare(results: list[dict], labels: list[str] | None = None) -> dict:
    labels = labels or [f"run{i}" for i in range(len(results))]
    rows = []
    for label, path, fmt, better in rows_for(results):
        vals = [get(r, path) for r in results]
        base = vals[0]
        ratios = []
        for v in vals[1:]:
            ok = isinstance(v, (int, float)) and isinstance(base, (int, float)) and base
            ratios.append(v / base if ok and not isinstance(v, bool) else None)
        rows.append({"metric": label, "key": ".".join(path), "values": vals, "ratios": ratios,
                     "higher_is_better": better, "format": fmt})
    return {"command": "compare", "labels": labels, "rows": rows,
            "work": [work(r) for r in results], "work_problems": work_problems(results, labels)}


def work(result: dict) -> dict:
    """What a replay asked of its server: the caps it ran under and the prompt tokens it sent."""
    t = get(result, ("metrics", "tokens")) or {}
    ok = get(result, ("metrics", "requests", "ok")) or 0
    sent = t.get("intended_prompt") or t.get("prompt") or 0
    return {"max_context": get(result, ("config", "max_context")),
            "max_output": get(result, ("config", "max_output")),
            "requests": ok, "prompt_tokens": sent,
            "prompt_per_request": sent / ok if ok else None}


def work_problems(results: list[dict], labels: list[str]) -> list[str]:
    """Why the runs did not do the same work (empty when they did), each against the first."""
    base, out = work(results[0]), []
    for r, lb in zip(results[1:], labels[1:]):
        w = work(r)
        for cap in ("max_context", "max_output"):
            if w[cap] != base[cap]:
                out.append(f"{lb}: {cap} {w[cap]} vs {base[cap]} in {labels[0]}")
        a, b = base["prompt_per_request"], w["prompt_per_request"]
        if a and b and abs(b / a - 1) > WORK_TOLERANCE:
            out.append(f"{lb}: {b:.0f} prompt tokens per request vs {a:.0f} in {labels[0]} "
                       f"({b / a - 1:+.1%}, more than {WORK_TOLERANCE:.0%})")
    return out


def compare_table(cmp: dict) -> str:
    labels = cmp["labels"]
    fmts = {label: fmt for label, _, fmt, _ in ROWS}
    head = ["metric", *labels] + [f"{lb}/{labels[0]}" for lb in labels[1:]]
    body = []
    for row in cmp["rows"]:
        fmt = fmts.get(row["metric"]) or row.get("format") or "{}"
        body.append([row["metric"], *(_fmt(fmt, v) for v in row["values"]),
                     *(_fmt("{:.3f}", r) for r in row["ratios"])])
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    out = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                     for i, (c, w) in enumerate(zip(line, widths))) for line in [head, *body]]
    return "\n".join(out)


# ---------------------------------------------------------------------------- plots

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(result: dict, fallback: str) -> str:
    c = get(result, ("config", "concurrency"))
    return f"{fallback} (c={c})" if c is not None else fallback


def system_of(label: str) -> str:
    """A run label without its concurrency suffix: `loomserve-c16`, `llama@4` -> the system."""
    return re.sub(r"[-_@ ]?c?=?\d+$", "", label) or label


def plot_pareto(results: list[dict], path: str, labels: list[str] | None = None,
                systems: list[str] | None = None) -> str:
    """Interactivity (y) vs TPGS (x): one curve per system over its runs, by concurrency."""
    plt = _plt()
    labels = labels or [f"run{i}" for i in range(len(results))]
    systems = systems or [system_of(lb) for lb in labels]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    curves: dict[str, list] = {}
    for r, sysname in zip(results, systems):
        x, y = get(r, ("metrics", "tpgs")), get(r, ("metrics", "interactivity"))
        if x is None or y is None:
            continue
        c = get(r, ("config", "concurrency"))
        curves.setdefault(sysname, []).append((c if c is not None else 0, x, y))
    for sysname, pts in curves.items():
        pts.sort()
        ax.plot([p[1] for p in pts], [p[2] for p in pts], "o-", label=sysname)
        for c, x, y in pts:
            ax.annotate(f"c={c}", (x, y), fontsize=8, textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("TPGS (tokens/s/device)")
    ax.set_ylabel("interactivity (1 / P90 E2E per output token), tok/s")
    ax.set_title("AgentX: interactivity vs throughput")
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_cdf(results: list[dict], path: str, labels: list[str] | None = None) -> str:
    plt = _plt()
    labels = labels or [f"run{i}" for i in range(len(results))]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for r, lb in zip(results, labels):
        cdf = get(r, ("metrics", "ttft_cdf")) or []
        if cdf:
            ax.plot([p[0] for p in cdf], [p[1] for p in cdf], label=_label(r, lb))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_hit_rate(result: dict, path: str) -> str:
    plt = _plt()
    tl = get(result, ("metrics", "timeline")) or []
    fig, ax = plt.subplots(figsize=(7, 4))
    t = [b["t"] for b in tl]
    ax.plot(t, [b["served_hit_rate"] for b in tl], ".-", label="served")
    ax.plot(t, [b["theoretical_hit_rate"] for b in tl], "--", label="theoretical (infinite cache)")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("time since first measured request (s)")
    ax.set_ylabel("prefix-cache hit rate")
    ax.set_title("hit rate over time")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_miss_gap(gaps: list[dict], labels: list[str], path: str, note: str = "") -> str:
    """One stacked bar per run: the served hit rate, then the gap to the theoretical one by
    miss cause (loomserve.bench.miss_gap), the unattributed remainder last; `note` (where and
    when it was measured) goes under the title."""
    plt = _plt()
    causes = sorted({c for g in gaps for c in g.get("points", {})})
    fig, ax = plt.subplots(figsize=(max(5.5, 1.3 * len(gaps) + 3.5), 4.5))
    x = range(len(gaps))
    bottom = [100 * g.get("served", 0.0) for g in gaps]
    ax.bar(x, bottom, color="#4c72b0", label="served hit")
    cmap = plt.get_cmap("tab10")
    for k, c in enumerate(causes + ["unattributed"]):
        h = [g.get("points", {}).get(c, 0.0) if c != "unattributed"
             else max(0.0, g.get("unattributed_points", 0.0)) for g in gaps]
        ax.bar(x, h, bottom=bottom, color="#bbbbbb" if c == "unattributed" else cmap(k + 1),
               label=c)
        bottom = [b + v for b, v in zip(bottom, h)]
    for i, g in enumerate(gaps):
        if "theoretical" in g:
            ax.plot([i - 0.4, i + 0.4], [100 * g["theoretical"]] * 2, "k--", lw=1)
    ax.set_xticks(list(x), labels, rotation=20, fontsize=8)
    ax.set_ylim(0, 100)
    ax.set_ylabel("prompt tokens (%)")
    ax.set_title("served hits, then the gap to the theoretical (dashed) by miss cause"
                 + (f"\n{note}" if note else ""), fontsize=8 if note else 9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_run_plots(result: dict, folder: str) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    gap = get(result, ("metrics", "miss_gap"))
    extra = [plot_miss_gap([gap], ["run"], os.path.join(folder, "miss_gap.png"))] \
        if gap and "gap_points" in gap else []
    return extra + [plot_hit_rate(result, os.path.join(folder, "hit_rate_over_time.png")),
            plot_ttft_cdf([result], os.path.join(folder, "ttft_cdf.png"), ["run"]),
            plot_pareto([result], os.path.join(folder, "pareto.png"), ["run"])]


# ---------------------------------------------------------------------------- CLI (compare)

def add_arguments(p) -> None:
    p.add_argument("results", nargs="+", help="replay result JSON files (A B [C ...])")
    p.add_argument("--labels", nargs="+", default=None, help="names for the runs")
    p.add_argument("--plots", default=None,
                   help="write pareto.png (interactivity vs TPGS) and ttft_cdf.png here")
    p.add_argument("--systems", nargs="+", default=None,
                   help="the system of each run, one curve each in pareto.png (default: the "
                        "label without a trailing concurrency, e.g. loomserve-c16 -> loomserve)")
    p.add_argument("--allow-different-work", action="store_true",
                   help="compare runs whose caps or prompt tokens per request differ (flagged)")
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON object")


def main(args) -> int:
    if len(args.results) < 2 and not args.plots:
        print("compare needs at least two result files", file=sys.stderr)
        return 2
    results = []
    for path in args.results:
        with open(path) as f:
            results.append(json.load(f))
    labels = args.labels or [os.path.splitext(os.path.basename(p))[0] for p in args.results]
    if len(labels) != len(results):
        print("--labels needs one name per result", file=sys.stderr)
        return 2
    if args.systems is not None and len(args.systems) != len(results):
        print("--systems needs one name per result", file=sys.stderr)
        return 2
    cmp = compare(results, labels)
    problems = cmp["work_problems"]
    for line in problems:
        print(f"WORK DIFFERS: {line}", file=sys.stderr)
    if problems and not args.allow_different_work:
        print("compare: the runs did not do the same work (see above); rerun them with the same "
              "--max-context/--max-output, or pass --allow-different-work", file=sys.stderr)
        return 3
    print(compare_table(cmp), file=sys.stderr if args.json else sys.stdout)
    if args.plots:
        os.makedirs(args.plots, exist_ok=True)
        for p in (plot_pareto(results, os.path.join(args.plots, "pareto.png"), labels, args.systems),
                  plot_ttft_cdf(results, os.path.join(args.plots, "ttft_cdf.png"), labels)):
            print(f"wrote {p}", file=sys.stderr)
    if args.json:
        print(json.dumps(cmp))
    return 0
