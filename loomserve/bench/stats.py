"""`loomserve bench stats TRACE_OR_DIR... [--json]`: validate traces and print their statistics.

Definitions (all per the AgentX conventions of shared/AGENTX.md):

* requests: main-agent requests plus subagent requests; a "turn" is a main-agent request.
* theoretical hit (infinite, ideal cache): per trace, requests in time order
  (Session.all_requests()), a request's hit is its longest prefix of hash ids all seen in
  earlier requests of the same trace (ids are chained, so this is a prefix match), in tokens
  min(hit_blocks * block_size, in). `theoretical_hit_rate` = sum(hit) / sum(in) over all
  requests of all traces (token-weighted); each trace's own rate is in `per_trace`.
* new prefill: in - hit for each request (what an ideal cache still has to compute).
* think time: the recorded `think_time` of every main-agent turn after the first (the first is
  0 by construction); subagent gaps are reported apart.
* subagents: groups are runs of subagents between two parent turns; concurrency counts
  subagents whose recorded [t, t + duration) intervals overlap, within a session.

Percentile summaries are {"n", "mean", "p50", "p90", "p99", "max"} (linear interpolation).
"""

from __future__ import annotations

import json
import sys
from itertools import takewhile

import numpy as np

from loomserve.bench.trace import Session, TraceError, TraceRequest, load_trace, trace_paths

__all__ = ["theoretical_hits", "summarize", "StatsAccumulator", "compute_stats",
           "add_arguments", "main", "format_stats"]


def theoretical_hits(session: Session) -> list[tuple[TraceRequest, int]]:
    """(request, hit tokens under an infinite ideal cache) for every request, in time order."""
    seen: set[int] = set()
    contains = seen.__contains__
    bs = session.block_size
    out = []
    for r in session.all_requests():
        ids = r.hash_ids
        hit_blocks = len(list(takewhile(contains, ids)))
        out.append((r, min(hit_blocks * bs, r.in_tokens)))
        seen.update(ids)
    return out


def summarize(values) -> dict:
    """Percentile summary of a sequence of numbers (all None when it is empty)."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(a.max())}


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    events = []
    for a, b in intervals:
        events.append((a, 1))
        events.append((max(a, b), -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end at the same instant frees first
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


class StatsAccumulator:
    """Add sessions one at a time (so a large corpus need not sit in memory), then result()."""

    def __init__(self) -> None:
        self.sessions = 0
        self.block_sizes: set[int] = set()
        self.turns: list[int] = []
        self.in_all: list[int] = []
        self.in_main: list[int] = []
        self.in_sub: list[int] = []
        self.out_all: list[int] = []
        self.out_main: list[int] = []
        self.new_prefill: list[int] = []
        self.new_prefill_main: list[int] = []
        self.think_main: list[float] = []
        self.think_sub: list[float] = []
        self.durations: list[float] = []
        self.groups_per_session: list[int] = []
        self.subagents_per_group: list[int] = []
        self.requests_per_group: list[int] = []
        self.requests_per_subagent: list[int] = []
        self.max_concurrent: list[int] = []
        self.joined = 0
        self.groups = 0
        self.in_total = 0
        self.hit_total = 0
        self.out_total = 0
        self.per_trace: list[dict] = []

    def add(self, s: Session) -> None:
        self.sessions += 1
        self.block_sizes.add(s.block_size)
        self.turns.append(len(s.main))
        hits = theoretical_hits(s)
        t_in = t_hit = t_out = 0
        for r, h in hits:
            main = r.agent == "main"
            self.in_all.append(r.in_tokens)
            self.out_all.append(r.out_tokens)
            self.new_prefill.append(r.in_tokens - h)
            (self.in_main if main else self.in_sub).append(r.in_tokens)
            if main:
                self.out_main.append(r.out_tokens)
                self.new_prefill_main.append(r.in_tokens - h)
            t_in += r.in_tokens
            t_hit += h
            t_out += r.out_tokens
        self.think_main.extend(r.think_time for r in s.main[1:])
        subs = s.subagents()
        for sa in subs:
            self.think_sub.extend(r.think_time for r in sa.requests[1:])
            self.requests_per_subagent.append(len(sa.requests))
        if hits:
            first = hits[0][0].t
            last = max(r.t + (r.api_time or 0.0) for r, _ in hits)
            self.durations.append(last - first)
        if s.groups:
            self.groups_per_session.append(len(s.groups))
            self.max_concurrent.append(_max_overlap([(sa.t, sa.end) for sa in subs]))
            for g in s.groups:
                self.groups += 1
                self.joined += g.joined
                self.subagents_per_group.append(len(g.subagents))
                self.requests_per_group.append(sum(len(sa.requests) for sa in g.subagents))
        self.in_total += t_in
        self.hit_total += t_hit
        self.out_total += t_out
        self.per_trace.append({
            "id": s.id, "path": s.path, "requests": len(hits), "main_turns": len(s.main),
            "subagent_requests": len(hits) - len(s.main), "groups": len(s.groups),
            "input_tokens": t_in, "hit_tokens": t_hit, "output_tokens": t_out,
            "theoretical_hit_rate": t_hit / t_in if t_in else None,
        })

    def result(self) -> dict:
        n_sub = len(self.in_sub)
        with_groups = len(self.groups_per_session)
        return {
            "sessions": self.sessions,
            "block_size": sorted(self.block_sizes),
            "requests": {"total": len(self.in_all), "main": len(self.in_main), "subagent": n_sub},
            "turns_per_session": summarize(self.turns),
            "in_tokens": summarize(self.in_all),
            "in_tokens_main": summarize(self.in_main),
            "in_tokens_subagent": summarize(self.in_sub),
            "out_tokens": summarize(self.out_all),
            "out_tokens_main": summarize(self.out_main),
            "new_prefill": summarize(self.new_prefill),
            "new_prefill_main": summarize(self.new_prefill_main),
            "think_time": summarize(self.think_main),
            "think_time_subagent": summarize(self.think_sub),
            "session_duration_s": summarize(self.durations),
            "subagents": {
                "sessions_with_groups": with_groups,
                "fraction_sessions_with_groups": with_groups / self.sessions if self.sessions else None,
                "groups": self.groups,
                "subagents": len(self.requests_per_subagent),
                "joined_groups": self.joined,
                "groups_per_session": summarize(self.groups_per_session),
                "subagents_per_group": summarize(self.subagents_per_group),
                "requests_per_group": summarize(self.requests_per_group),
                "requests_per_subagent": summarize(self.requests_per_subagent),
                "max_concurrent_subagents": max(self.max_concurrent, default=0),
                "max_concurrent_per_session": summarize(self.max_concurrent),
            },
            "input_tokens": self.in_total,
            "hit_tokens": self.hit_total,
            "output_tokens": self.out_total,
            "theoretical_hit_rate": self.hit_total / self.in_total if self.in_total else None,
            "per_trace": self.per_trace,
        }


def compute_stats(sessions) -> dict:
    acc = StatsAccumulator()
    for s in sessions:
        acc.add(s)
    return acc.result()


# ---------------------------------------------------------------------------------------------
# human-readable output

def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "s":
        return f"{v:.1f}s" if v < 600 else f"{v / 60:.1f}min"
    if abs(v) >= 10_000:
        return f"{v / 1000:.1f}K"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.1f}"
    return f"{int(v)}"


def format_stats(st: dict) -> str:
    sub = st["subagents"]
    lines = [
        f"sessions       {st['sessions']}  (block_size {', '.join(map(str, st['block_size']))})",
        f"requests       {st['requests']['total']}  (main {st['requests']['main']}, "
        f"subagent {st['requests']['subagent']})",
        f"hit rate       {st['theoretical_hit_rate']:.4f}  theoretical, infinite ideal cache "
        f"({_fmt(st['hit_tokens'])} of {_fmt(st['input_tokens'])} input tokens)"
        if st["theoretical_hit_rate"] is not None else "hit rate       -",
        "",
        f"{'':24}" + "".join(f"{k:>10}" for k in ("p50", "p90", "p99", "mean", "max")),
    ]
    rows = [("turns per session", "turns_per_session", ""), ("input tokens", "in_tokens", ""),
            ("  main agent", "in_tokens_main", ""), ("  subagents", "in_tokens_subagent", ""),
            ("output tokens", "out_tokens", ""), ("new prefill (ideal)", "new_prefill", ""),
            ("think time (main)", "think_time", "s"),
            ("think time (subagent)", "think_time_subagent", "s"),
            ("session duration", "session_duration_s", "s")]
    for label, key, unit in rows:
        d = st[key]
        lines.append(f"{label:24}" + "".join(f"{_fmt(d[k], unit):>10}"
                                               for k in ("p50", "p90", "p99", "mean", "max")))
    lines += [
        "",
        f"subagent groups in {sub['sessions_with_groups']} of {st['sessions']} sessions "
        f"({100 * (sub['fraction_sessions_with_groups'] or 0):.1f}%): {sub['groups']} groups, "
        f"{sub['subagents']} subagents, {sub['joined_groups']} joined by the next parent turn",
    ]
    for label, key in (("groups per session", "groups_per_session"),
                       ("subagents per group", "subagents_per_group"),
                       ("requests per group", "requests_per_group"),
                       ("max concurrent subagents", "max_concurrent_per_session")):
        d = sub[key]
        lines.append(f"  {label:22}" + "".join(f"{_fmt(d[k]):>10}"
                                                 for k in ("p50", "p90", "p99", "mean", "max")))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI

def add_arguments(p) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE_OR_DIR",
                   help="Weka-format trace files or directories of *.json")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--per-trace", action="store_true",
                   help="also list each trace's requests and hit rate (human output)")


def main(args) -> int:
    try:
        paths = trace_paths(args.traces)
        acc = StatsAccumulator()
        for p in paths:  # one at a time: validation is all-or-nothing, memory stays small
            acc.add(load_trace(p))
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    st = acc.result()
    if args.json:
        print(json.dumps(st))
    else:
        print(format_stats(st))
        if getattr(args, "per_trace", False):
            print()
            for t in st["per_trace"]:
                rate = t["theoretical_hit_rate"]
                print(f"  {t['id']:24} {t['requests']:6} req {t['groups']:3} groups "
                      f"{_fmt(t['input_tokens']):>8} in  hit {rate:.4f}" if rate is not None
                      else f"  {t['id']:24} {t['requests']:6} req")
    return 0
