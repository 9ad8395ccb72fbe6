"""docs/benchmarks.md, generated from benchmarks/results/: the current figure of every benchmark
beside its machine, commit, date, command, runs and spread.

    .venv/bin/python -m benchmarks.report          # write docs/benchmarks.md
    .venv/bin/python -m benchmarks.report --check  # exit 1 when the committed page is stale

One summariser per benchmark family (FAMILIES: a file-name pattern -> a function returning
blocks of rows, a block per run). A results file no family claims, or claimed twice, stops the
report (ReportError): a new benchmark adds its summariser here. Provenance of a block: what a
summariser reads from a result's own entries, then the file's envelope (benchmarks/common/
results.py stamps one on every new result), then the keys older files carry (host, date,
command, commit), then `recorded`: for files whose run recorded no commit, the commit that
added the file, stamped into it once (shown as "recorded at").

Invariants: the page depends only on the results files (sorted, no generation time, no git), so --check is stable; a ratio is taken only between two measurements of one
run on one host with one statistic (`ratio` raises RatioRefused otherwise); llama-server run
with a workaround (--no-repack) says so beside its figure.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"

# Commit 067360b (2026-12-03 16:27 UTC): llama-server keeps its weight repacking (its default)
# except on AMX hosts, where it crashed; every run before it used --no-repack everywhere.
REPACK_DEFAULT_SINCE = "2026-12-03 16:27"
NO_REPACK_AMX = ("llama-server with --no-repack: its AMX repack crashed on this host; not its "
                 "full strength")
NO_REPACK_OLD = "llama-server with --no-repack (as every run before 067360b): not its full strength"


class ReportError(Exception):
    """A results file the report cannot summarise (no family claims it, or two do)."""


class RatioRefused(ValueError):
    """A ratio asked between measurements of different hosts, runs or statistics."""


@dataclass(frozen=True)
class Source:
    """Where a block's figures come from: one run of one file on one machine."""

    file: str
    cpu: str
    commit: str
    date: str
    command: str
    run: str


@dataclass(frozen=True)
class Row:
    figure: str
    value: str
    limit: str = "-"
    runs: str = "-"
    spread: str = "-"


@dataclass(frozen=True)
class Measure:
    """One system's statistic in one run: the only operand of a ratio. ``samples`` are its
    per-round values where the systems' rounds were interleaved (round i of each together)."""

    system: str
    statistic: str
    value: float
    host: str
    run: str
    samples: tuple[float, ...] = ()
    caveat: str = ""  # the workaround the system ran with (llama_caveat), carried into ratios


def ratio(a: Measure, b: Measure) -> float:
    """a's value over b's; refused unless both come from one run on one host, same statistic."""
    for what, x, y in (("hosts", a.host, b.host), ("runs", a.run, b.run),
                       ("statistics", a.statistic, b.statistic)):
        if x != y:
            raise RatioRefused(f"{a.system} / {b.system}: different {what} ({x!r} vs {y!r})")
    return a.value / b.value


Block = tuple[Source, list[Row]]


@dataclass(frozen=True)
class Family:
    pattern: str  # fnmatch pattern of a results file name
    title: str
    about: str  # what it measures, one or two sentences
    summarise: Callable[[Result], list[Block]]


# -- reading results ------------------------------------------------------------------------


@dataclass
class Result:
    path: Path
    data: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.name

    def source(self, host: Any = None, date: str | None = None, commit: str | None = None,
               command: Any = None, run: str | None = None) -> Source:
        """A block's provenance: the arguments (a summariser's per-entry reading), then the
        envelope, then the file's own keys, then `recorded` (the commit that added a file whose
        run recorded none, stamped into it once so the page needs no git history)."""
        env = self.data.get("envelope") or {}
        # The envelope, written by the run itself, names the host and command better than a
        # summariser's guess for older files; a date stays per entry (a run's rounds differ).
        host = env.get("host") or host or self.data.get("host") or self.data.get("cpu")
        date = date or env.get("date") or self.data.get("date") or self.data.get("measured_at")
        commit = commit or env.get("commit") or self.data.get("commit")
        command = (env.get("command") or command or self.data.get("command")
                   or self.data.get("argv"))
        recorded = self.data.get("recorded") or {}
        return Source(
            file=self.name, cpu=cpu_text(host),
            commit=(f"commit {short_commit(commit)}" if commit
                    else f"recorded at {recorded['commit']}" if recorded.get("commit")
                    else "commit not recorded"),
            date=(date_text(date) if date
                  else f"{recorded['date']} (recorded)" if recorded.get("date")
                  else "date not recorded"),
            command=command_text(command), run=run or env.get("run") or f"file {self.name}")


def load(path: Path) -> Result:
    text = path.read_text()
    if path.suffix == ".jsonl":  # records; a line {"recorded": ...} is the file's provenance
        lines = [json.loads(x) for x in text.splitlines() if x.strip()]
        recorded = next((x["recorded"] for x in lines if set(x) == {"recorded"}), None)
        data = {"records": [x for x in lines if set(x) != {"recorded"}]}
        return Result(path, data | ({"recorded": recorded} if recorded else {}))
    return Result(path, json.loads(text))


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def short_commit(commit: str) -> str:
    m = re.fullmatch(r"([0-9a-f]{7,40})(-dirty)?", commit.strip())
    return m[1][:7] + (m[2] or "") if m else commit


# The host of a result that times nothing (a simulation, a compiler's resource report): any.
NO_TIMING = "any CPU (no timing: the figures do not depend on the host)"


def cpu_text(host: Any) -> str:
    """"Intel Xeon, 2 CPUs, AVX-512 VNNI/BF16 + AMX": the model, and the vector extensions
    that change the kernels' speed (AVX-512 implies AVX2; benchmarks/common/host.py)."""
    if not host:
        return "CPU not recorded"
    if host == NO_TIMING:
        return NO_TIMING
    if isinstance(host, str):
        return f"{_clean_cpu(host)}, extensions not recorded"
    name = _clean_cpu(host.get("cpu") or "CPU not recorded")
    if host.get("nproc"):
        name += f", {host['nproc']} CPUs"
    isa = host.get("isa")
    if isa is None:
        return f"{name}, extensions not recorded"
    extra = [x.removeprefix("avx512_").upper() for x in isa if x.startswith("avx512_")]
    ext = ("AVX-512" + (" " + "/".join(extra) if extra else "") if "avx512f" in isa
           else "AVX2" if "avx2" in isa else "no AVX2")
    return f"{name}, {ext}" + (" + AMX" if "amx_tile" in isa else "")


def _clean_cpu(name: str) -> str:
    words = name.replace("(R)", "").replace("(TM)", "").split()
    return " ".join(w for w in words if w != "Processor")


def has_amx(host: Any) -> bool:
    return isinstance(host, dict) and "amx_tile" in (host.get("isa") or [])


_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})(?:[T ](\d{2}):(\d{2})(?::\d{2})?"
                   r"\s*(?:([+-])(\d{2}):?(\d{2})|UTC|Z)?)?")


_RENDERED = re.compile(r"\d{4}-\d{2}-\d{2}( \d{2}:\d{2}(-\d{2}:\d{2})? UTC| \(recorded\))?")


def date_text(value: str) -> str:
    """"2026-12-03 19:21 UTC" (or the day alone) from the formats the files hold; a date
    already in that form (or a span of one day, date_span) stays as it is."""
    if _RENDERED.fullmatch(str(value)):
        return str(value)
    m = _DATE.match(str(value))
    if not m:
        return str(value)
    if m[2] is None:
        return m[1]
    t = datetime.fromisoformat(f"{m[1]}T{m[2]}:{m[3]}")
    if m[4]:
        offset = timedelta(hours=int(m[5]), minutes=int(m[6]))
        t = t - offset if m[4] == "+" else t + offset
    return t.strftime("%Y-%m-%d %H:%M UTC")


def command_text(command: Any) -> str:
    if not command:
        return "command not recorded"
    text = command if isinstance(command, str) else " ".join(map(str, command))
    return f"`{text.strip().replace(str(ROOT) + '/', '')}`"


# -- numbers --------------------------------------------------------------------------------


def num(x: float | None) -> str:
    if x is None:
        return "-"
    a = abs(x)
    if a == float("inf"):
        return "inf"
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}" if a else "0"


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def med(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def minmax(xs: Sequence[float], unit: str = "") -> str:
    return f"min-max {num(min(xs))}-{num(max(xs))}{unit}" if len(xs) > 1 else "-"


def runs_of(xs: Sequence[Any]) -> str:
    return str(len(xs)) if xs else "-"


class Blocks:
    """Rows collected per source, then sorted by date and run (the page must be stable)."""

    def __init__(self) -> None:
        self.by: dict[Source, list[Row]] = {}

    def add(self, src: Source, figure: str, value: str, limit: str = "-", runs: Any = "-",
            spread: str = "-") -> None:
        self.by.setdefault(src, []).append(Row(figure, value, limit, str(runs), spread))

    def add_ratio(self, src: Source, a: Measure, b: Measure, label: str,
                  interleaved: bool, faster: str = "higher") -> None:
        """a against b as "how many times better": a / b where higher is better, b / a where
        lower is (times). Per-round ratios give the spread where rounds were interleaved."""
        x, y = (a, b) if faster == "higher" else (b, a)
        value = ratio(x, y)
        rounds = list(zip(x.samples, y.samples)) if interleaved else []
        per_round = [p / q for p, q in rounds if q]
        runs = (f"{len(per_round)} interleaved rounds" if per_round
                else "one run" if interleaved else "one run, one after another")
        peer = next((m for m in (a, b) if m.caveat), None)
        note = f" — {peer.system} with --no-repack: not its full strength" if peer else ""
        self.add(src, f"{a.system} / {b.system}, {label}{note}", f"{value:.2f}x", "-", runs,
                 minmax(per_round, "x") + (" per round" if len(per_round) > 1 else ""))

    def out(self) -> list[Block]:
        return sorted(self.by.items(), key=lambda kv: (kv[0].date, kv[0].run))


def llama_caveat(command: Any, host: Any, date: str) -> str:
    """The workaround llama-server ran with, where it did (empty at full strength)."""
    if command:
        flags = command if isinstance(command, str) else " ".join(map(str, command))
        if "--no-repack" not in flags:
            return ""
        return NO_REPACK_AMX if has_amx(host) else NO_REPACK_OLD
    if has_amx(host):
        return NO_REPACK_AMX
    return NO_REPACK_OLD if date_text(date) < REPACK_DEFAULT_SINCE else ""


def with_caveat(figure: str, caveat: str) -> str:
    return f"{figure} — {caveat}" if caveat else figure


# -- summarisers: served decode and long context ------------------------------------------


def decode_throughput(r: Result) -> list[Block]:
    out = Blocks()
    for name, e in sorted(r.data["systems"].items()):
        src = r.source(host=e.get("host"), date=e["measured_at"], run=e["measured_at"])
        cav = llama_caveat(e.get("command"), e.get("host"), e["measured_at"]) \
            if name.startswith("llama") else ""
        for c, x in sorted(e["by_concurrency"].items(), key=lambda kv: int(kv[0])):
            runs = x.get("runs_tok_per_s", [])
            out.add(src, with_caveat(f"{name}, {streams(c)}", cav), f"{num(x['tok_per_s'])} tok/s",
                    f"{num(x['roofline_tok_per_s'])} tok/s (bandwidth; {x['pct_of_roofline']}%)",
                    runs_of(runs), minmax(runs))
    for src, rows in list(out.by.items()):  # ratios within a run: loomserve-* / llama-server
        systems = {n: e for n, e in r.data["systems"].items() if e["measured_at"] == src.run}
        if "llama-server" not in systems:
            continue
        for name, e in sorted(systems.items()):
            if not name.startswith("loomserve"):
                continue
            for c in sorted(e["by_concurrency"], key=int):
                peer = systems["llama-server"]["by_concurrency"].get(c)
                if peer:
                    peer_cav = llama_caveat(systems["llama-server"].get("command"),
                                            systems["llama-server"].get("host"), src.run)
                    a = _tok_measure(name, e["by_concurrency"][c], c, src)
                    b = _tok_measure("llama-server", peer, c, src, peer_cav)
                    out.add_ratio(src, a, b, f"{streams(c)} (median tok/s)", interleaved=True)
    return out.out()


def _spec_goal(set_name: str, c: str) -> str:
    """Issue 45's goals: >= 2x at 1 stream and >= 1.3x at 8 on the edit set, never below 0.97x
    on the control set or at 32 streams."""
    if set_name == "control" or c == "32":
        return "goal >= 0.97x"
    return {"1": "goal >= 2x", "8": "goal >= 1.3x"}.get(c, "-") if set_name == "edit" else "-"


def spec_decode(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    c = d.get("drafter_cost")
    if c:
        out.add(src, f"suffix drafter propose(), {c['prompt_tokens']:,}-token prompt: while "
                     "copying / nothing to copy",
                f"{num(c['propose_us_copy_median'])} / {num(c['propose_us_novel_median'])} us",
                "-", "-", f"p90 {num(c['propose_us_copy_p90'])} / "
                          f"{num(c['propose_us_novel_p90'])} us; ingest "
                          f"{num(c['ingest_us_per_token'])} us/token")
    row_costs = d.get("row_costs", {})
    for cs, rc in sorted(row_costs.get("by_streams", {}).items(), key=lambda x: int(x[0])):
        rel = rc["relative"]  # step time at r rows a request / at 1 row (a verified step's cost)
        out.add(src, f"step of 2 / 5 / 8 rows a request over a 1-row step, {streams(cs)}",
                " / ".join(f"{rel[r]:.2f}x" for r in ("2", "5", "8") if r in rel), "-",
                row_costs.get("steps_per_row_count", "-"),
                f"1-row step {num(rc['step_ms']['1'])} ms; threads {row_costs.get('threads')}; "
                f"load {num(rc['loadavg'][0])}")
    systems = d.get("systems", {})
    base = systems.get("none", {}).get("rounds", {})
    for name in sorted(base, key=lambda n: (n.split("/")[0], int(n.split("/")[1]), n)):
        set_name, cs = name.split("/")[:2]
        label = f"{name.replace('/turn', ', turn ').split('/')[0]} set, {streams(cs)}" + (
            f", turn {name.split('/turn')[1]}" if "/turn" in name else "")
        b = base[name]
        out.add(src, f"none, {label}: decode", f"{num(b['tok_per_s'])} tok/s", "-",
                len(b["runs"]), "; ".join(x for x in (minmax([y["tok_per_s"] for y in b["runs"]]),
                                                      _load(systems["none"])) if x != "-"))
        for sys_name, s in sorted(systems.items()):
            x = s["rounds"].get(name)
            if sys_name == "none" or x is None:
                continue
            out.add(src, f"{sys_name} / none, {label}",
                    f"{x['tok_per_s'] / b['tok_per_s']:.2f}x",
                    "-" if sys_name.startswith("none-") else _spec_goal(set_name, cs),
                    len(x["runs"]), f"acceptance length {num(x['acceptance_length'] or 1)}; "
                    + _pass_ratios(x["runs"], b["runs"])
                    + f"{num(x['tok_per_s'])} tok/s; greedy text "
                    + _text_diff(x["runs"], b["runs"]) + f"; {_load(s)}")
            sync_name = sys_name.removesuffix("-async")
            sync = systems.get(sync_name, {}).get("rounds", {}).get(name)
            if sync_name not in (sys_name, "none") and sync is not None:  # async's own share
                out.add(src, f"{sys_name} / {sys_name.removesuffix('-async')}, {label}",
                        f"{x['tok_per_s'] / sync['tok_per_s']:.2f}x", "-", len(x["runs"]),
                        _pass_ratios(x["runs"], sync["runs"]) + _load(s))
    return out.out()


def _pass_ratios(runs: list[dict], base: list[dict]) -> str:
    """Each pass's ratio to none's in the same pass (interleaved: the same host drift), when
    there are several; their spread is the measurement's."""
    if len(runs) < 2:
        return ""
    return "per pass " + " / ".join(f"{x['tok_per_s'] / y['tok_per_s']:.2f}x"
                                    for x, y in zip(runs, base)) + "; "


def _text_diff(runs: list[dict], base: list[dict]) -> str:
    """How many streams' greedy text differs from none's (none-staggered: between two plain
    servers whose prefill chunks differ, the baseline for the others)."""
    pairs = [(x, y) for r, b in zip(runs, base) for x, y in zip(r["text_sha"], b["text_sha"])]
    diff = sum(x != y for x, y in pairs)
    return "identical" if not diff else f"DIFFERS in {diff} of {len(pairs)} streams"


def _load(system: dict) -> str:
    """The host's load average as each pass of a system started (a shared host drifts)."""
    loads = [h.get("loadavg_at_start", [float("nan")])[0] for h in system.get("hosts", [])]
    return "load " + "/".join(num(x) for x in loads)


def streams(c: Any, what: str = "stream") -> str:
    return f"{c} {what}" + ("" if int(c) == 1 else "s")


def _tok_measure(system: str, x: dict, c: str, src: Source, caveat: str = "") -> Measure:
    return Measure(system, f"median tok/s at {c} streams", x["tok_per_s"], src.cpu, src.run,
                   tuple(x.get("runs_tok_per_s", [])), caveat)


KV_FRACTION = {"kvbf16": 0.5, "kvf16": 0.5, "kvfp8": 0.25, "kvq8": 34 / 128}


def long_context(r: Result) -> list[Block]:
    """Entries of one invocation share its commit and its start's load average."""
    out, limits = Blocks(), r.data["limits"]
    groups: dict[tuple, list] = {}
    for name, phases in r.data["systems"].items():
        for phase, e in phases.items():
            key = (e.get("lead_commit"), tuple(e.get("loadavg_at_start") or ()))
            groups.setdefault(key, []).append((name, phase, e))
    for (commit, load), entries in sorted(groups.items(), key=lambda kv: str(kv[0])):
        first = min(e["measured_at"] for _, _, e in entries)
        src = r.source(date=first, commit=commit, run=f"{commit} {load}",
                       command="python benchmarks/long_context.py (arguments not recorded)")
        measures: dict[str, list[Measure]] = {}
        for name, phase, e in sorted(entries, key=lambda t: (t[1], t[0])):
            cav = llama_caveat(e.get("command"), r.data.get("host"), e["measured_at"]) \
                if name.startswith("llama") else ""
            m = _long_context_row(out, src, name, phase, e, limits, cav)
            if m:
                measures.setdefault(phase, []).append(m)
        for phase, ms in measures.items():
            _against_fastest_peer(out, src, ms, phase_label(phase),
                                  lower_is_better=not phase.startswith("c"))
    return out.out()


def phase_label(phase: str) -> str:
    """decode@131072 -> "decode at 128K"; prefill24k; c64@32768 -> "64 streams at 32K"."""
    kind, _, ctx = phase.partition("@")
    if not ctx:
        return "24K prefill" if phase == "prefill24k" else phase
    at = f"at {int(ctx) // 1024}K"
    return f"decode {at}" if kind == "decode" else f"{kind[1:]} streams {at}"


def _long_context_row(out: Blocks, src: Source, name: str, phase: str, e: dict, limits: dict,
                      caveat: str) -> Measure | None:
    if phase.startswith("decode@"):
        ctx = phase.split("@")[1]
        xs = [x["decode_ms_per_token"] for x in e["runs"]]
        lim = (limits.get("decode") or {}).get(ctx)
        frac = next((f for k, f in KV_FRACTION.items() if name.endswith(k)), 1.0)
        limit = (f"{num(lim['kv_limit_ms'] * frac)} ms (KV read at {num(limits['read_gbs'])} GB/s)"
                 if lim else "-")
        out.add(src, with_caveat(f"{name}: decode at {int(ctx) // 1024}K context", caveat),
                f"{num(med(xs))} ms/token", limit, runs_of(xs), minmax(xs))
        return Measure(name, f"median ms/token, {phase}", med(xs), src.cpu, src.run, tuple(xs), caveat)
    if phase == "prefill24k":
        xs = [x["ttft_s"] for x in e["runs"]]
        p = limits.get("prefill24k") or {}
        limit = (f"{num(p['flop_limit_s'])} s (FLOP at {num(limits['fp32_matmul_gflops'])} "
                 f"GFLOP/s)" if p else "-")
        out.add(src, with_caveat(f"{name}: 24K new tokens over a cached 104K prefix", caveat),
                f"{num(med(xs))} s", limit, runs_of(xs), minmax(xs))
        return Measure(name, "median s, prefill24k", med(xs), src.cpu, src.run, tuple(xs), caveat)
    out.add(src, with_caveat(f"{name}: {e['streams']} streams at {e['context'] // 1024}K context, "
                             "aggregate", caveat), f"{num(e['tok_per_s'])} tok/s", "-", 1)
    return Measure(name, f"tok/s, {phase}", e["tok_per_s"], src.cpu, src.run, (), caveat)


def _against_fastest_peer(out: Blocks, src: Source, ms: list[Measure], label: str,
                          lower_is_better: bool) -> None:
    """Each loomserve system against llama-server's best configuration of the same run."""
    peers = [m for m in ms if m.system.startswith("llama")]
    if not peers:
        return
    best = (min if lower_is_better else max)(peers, key=lambda m: m.value)
    for m in ms:
        if m.system.startswith("loomserve"):
            out.add_ratio(src, m, best, f"{label} (speed)", interleaved=False,
                          faster="lower" if lower_is_better else "higher")


def default_long_context(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/default_long_context.py (arguments not recorded)")
    ms = []
    for name, s in d["systems"].items():
        cav = llama_caveat(s.get("command"), d.get("host"), d["measured_at"]) \
            if name.startswith("llama") else ""
        xs = s["ms_per_token_all"]
        out.add(src, with_caveat(f"{name}: decode after a {d['context']:,}-token prompt", cav),
                f"{num(s['ms_per_token'])} ms/token (prefill {num(s['prefill_s'])} s)",
                f"{num(s['limit_ms'])} ms (weights + KV read)", runs_of(xs), minmax(xs))
        ms.append(Measure(name, "median ms/token", s["ms_per_token"], src.cpu, src.run, tuple(xs),
                          cav))
    _against_fastest_peer(out, src, ms, "decode", lower_is_better=True)
    return out.out()


def agentx_cpu(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/agentx_cpu.py (arguments in the file)")
    cav = llama_caveat(None, d.get("host"), r.source().date)
    ms: dict[str, Measure] = {}
    for name, by_c in d["results"].items():
        for c, x in by_c.items():
            out.add(src, with_caveat(f"{name}, {streams(c, 'session')}",
                                     cav if name.startswith("llama") else ""),
                    f"TPGS {num(x['tpgs'])}; hit {pct(x['hit_served'])}; TTFT p90 "
                    f"{num(x['ttft_p90_s'])} s", f"hit {pct(x['hit_theoretical'])} (theoretical)",
                    f"{x['requests_ok']} requests")
            ms[f"{name}@{c}"] = Measure(name, f"TPGS at {c} sessions", x["tpgs"], src.cpu, src.run,
                                        caveat=cav if name.startswith("llama") else "")
    for key, m in sorted(ms.items(), key=lambda kv: int(kv[0].split("@")[1])):
        peer = ms.get("llama-server@" + key.split("@")[1])
        if m.system == "loomserve" and peer:
            out.add_ratio(src, m, peer, f"{streams(key.split('@')[1], 'session')} (TPGS)",
                          interleaved=False)
    return out.out()


def process_layout(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    rounds = d["rounds"]  # {layout: [round, ...]} or [{layout: round}, ...]
    series = rounds if isinstance(rounds, dict) else {k: [x[k] for x in rounds] for k in rounds[0]}
    ms = {}
    for name, xs in series.items():
        agg = [x["aggregate_tok_s"] for x in xs]
        out.add(src, f"{name}: aggregate decode, {d.get('args', {}).get('concurrency', 32)} streams",
                f"{num(med(agg))} tok/s", "-", runs_of(agg), minmax(agg))
        ms[name] = Measure(name, "median aggregate tok/s", med(agg), src.cpu, src.run, tuple(agg))
    out.add_ratio(src, ms["two-process"], ms["one-process"], "aggregate tok/s", interleaved=True)
    return out.out()


def server_startup(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(host={"cpu": "CPU not recorded", "nproc": d.get("cpus")} if "cpus" in d
                   else None, command="python benchmarks/server_startup.py")
    warm = [w["ready_s"] for w in d.get("warm", [])]
    t = d["targets"]
    out.add(src, "default model: ready (launch to /health), weights cached",
            f"{num(d['warm_ready_s_median'])} s", f"target {t['ready_s']} s", d["repeats"],
            minmax(warm, " s"))
    out.add(src, "resident memory (server + engine core), warm start",
            f"{num(d['warm_rss_mb_median'])} MB (peak {num(d['warm_peak_rss_mb_median'])})",
            f"target {t['rss_mb']} MB", d["repeats"])
    out.add(src, "first start (converts the GGUF into the weight cache)",
            f"{num(d['first_start']['ready_s'])} s", "-", 1)
    return out.out()


# -- summarisers: kernels ----------------------------------------------------------------------


def paged_attention(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/paged_attention.py (arguments not recorded)")
    bw, gf = num(d["bandwidth_gb_s"]), num(d["fp32_matmul_gflops"])
    for x in d["decode"]:
        out.add(src, f"decode, 64 sequences at {x['context'] // 1024}K, one layer",
                f"{num(x['cpu_paged_ms'])} ms (torch: {num(x['torch_ms'])})",
                f"{num(x['limit_ms'])} ms (KV read at {bw} GB/s)")
    p = d["prefill"]
    out.add(src, f"{p['chunk']:,}-token chunk over a cached {p['cached'] // 1024}K, one layer",
            f"{num(p['cpu_paged_ms'])} ms (torch: {num(p['torch_ms'])})",
            f"{num(p['limit_ms'])} ms (FLOP at {gf} GFLOP/s)")
    for w in d.get("windowed_prefill", []):
        out.add(src, f"{w['shape']}, window {w['window']}: {w['chunk']:,}-token chunk over "
                     f"{w['cached'] // 1024}K", f"{num(w['cpu_paged_ms'])} ms (torch: "
                     f"{num(w['torch_ms'])})", f"{num(w['limit_ms'])} ms (FLOP)")
    m = d["metadata"]
    out.add(src, f"step metadata, {m['seqs']} sequences at {m['context'] // 1024}K",
            f"{num(m['cpu_paged_ms'])} ms (torch's padded tables and mask: "
            f"{num(m['torch_padded_tables_and_mask_ms'])})")
    return out.out()


def dense_matmul(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/dense_matmul.py (arguments not recorded)")
    for x in d["results"]:
        if x["model"] == "default" and x["rows"] in (1, 32):
            out.add(src, f"{x['dtype']}, {streams(x['rows'], 'row')}",
                    f"{num(x['ms']['kernel'])} ms = {num(x['gbs']['kernel'])} GB/s (torch: "
                    f"{num(x['ms']['torch'])} ms)", f"{num(d['read_gbs'])} GB/s read")
    return out.out()


def quant_matmul(r: Result) -> list[Block]:
    """Whole-model passes per variant (matrices in cache, then distinct from memory), and the
    K-quant shapes ("kq ...") summed per variant, beside Q4_1 at the same shapes."""
    out, d = Blocks(), r.data
    src = r.source()
    threads = streams(d["threads"], "thread")
    kq: dict[tuple, list[float]] = {}
    for x in d["results"]:
        bpw = f", {x['bpw']:.2f} bits/weight" if "bpw" in x else ""
        if x["shape"] in ("model pass", "model, distinct"):
            what = ", 121 distinct matrices" if x["shape"] == "model, distinct" else ""
            out.add(src, f"{x['variant']}{what}, {streams(x['rows'], 'row')}, {threads}",
                    f"{num(x['median_us'] / 1e3)} ms",
                    f"{num(x['limit_us'] / 1e3)} ms (weights{bpw} at {num(d['read_gbs'])} GB/s)", "-",
                    f"min {num(x['us'] / 1e3)} ms")
        elif x["shape"].startswith("kq "):
            t = kq.setdefault((x["variant"], x["rows"], bpw), [0.0, 0.0, 0.0, 0.0])
            for i, key in enumerate(("median_us", "us", "bytes", "limit_us")):
                t[i] += x[key]
    for (var, rows, bpw), (med, best, nbytes, limit) in kq.items():
        out.add(src, f"{var}, K-quant shapes summed, {streams(rows, 'row')}, {threads}",
                f"{num(med)} us", f"{num(limit)} us (weights{bpw} at {num(d['read_gbs'])} GB/s)", "-",
                f"min {num(best)} us = {num(nbytes / best / 1e3)} GB/s")
    return out.out()


def matmul_layout(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/matmul_layout.py (arguments not recorded)")
    by: dict[tuple, dict] = {}
    for x in d["results"]:
        by.setdefault((x["dtype"], x["rows"]), {})[x["variant"]] = x
    for (dtype, rows), v in by.items():
        if rows not in (1, 32):
            continue
        other = next(k for k in v if k != "default")
        out.add(src, f"{dtype}, {streams(rows, 'row')}",
                f"{other} {num(v[other]['ms'])} ms vs default {num(v['default']['ms'])} ms "
                f"({v[other]['speedup']:.2f}x)", f"{num(d['read_gbs'])} GB/s read")
    return out.out()


def fused_ops(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    for rows, x in (d.get("micro") or {}).items():
        if rows.startswith("rows"):
            a, s = x["add_norm_us"], x["silu_mul_us"]
            out.add(src, f"add + RMSNorm / SiLU x mul, {streams(rows[4:], 'row')}",
                    f"C {num(a['c'])} / {num(s['c'])} us (eager {num(a['eager'])} / "
                    f"{num(s['eager'])})")
    lim = d.get("limit")
    for x in d.get("rows", []):
        out.add(src, f"decode step, default model {d.get('dtype', 'float32')}, "
                     f"{streams(x['streams'])} at {x['ctx']}", f"fused {num(x['fused_ms'])} vs "
                     f"torch {num(x['torch_ms'])} ms",
                f"{num(lim['weights_read_ms'])} ms (weights read)" if lim else "-", x["samples"],
                f"min {num(x['fused_min_ms'])} / {num(x['torch_min_ms'])} ms")
    return out.out()


def mla_decode(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    for x in d["decode_one_layer"]:
        out.add(src, f"{x['context']:,} context: absorbed",
                f"{num(x['absorbed_ms'])} ms", f"{num(x['absorbed_limit_ms'])} ms")
        if "decompressed_ms" in x:
            out.add(src, f"{x['context']:,} context: decompressed", f"{num(x['decompressed_ms'])} ms",
                    f"{num(x['decompressed_limit_ms'])} ms")
    return out.out()


def sparse_mla_decode(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    topk, bw = d["shape"]["index_topk"], d["nominal_bandwidth_gbs"]
    for x in d["decode_one_layer"]:
        ctx = f"{x['context']:,} context"
        for part, what in (("indexer", "indexer pass (every key)"),
                           ("sparse_attention", f"sparse MLA over top-{topk:,}"),
                           ("dense_mla", "dense MLA (absorbed, every row)")):
            out.add(src, f"{ctx}: {what}", f"{num(x[part + '_ms'])} ms",
                    f"{num(x[part + '_limit_ms'])} ms; {num(x[part + '_bytes'] / 2**20)} MiB "
                    f"read = {num(x[part + '_roofline_30gbs_ms'])} ms at {num(bw)} GB/s",
                    spread=f"min {num(x[part + '_min_ms'])} ms")
        out.add(src, f"{ctx}: sparse step (indexer + sparse MLA) vs dense",
                f"{num(x['sparse_total_ms'])} vs {num(x['dense_mla_ms'])} ms",
                spread=f"min {num(x['sparse_total_min_ms'])} ms")
    g = d["growth_8k_to_128k"]
    out.add(src, f"growth 8K -> 128K ({num(g['context'])}x context)",
            f"sparse MLA {num(g['sparse_attention'])}x, indexer {num(g['indexer'])}x, "
            f"dense MLA {num(g['dense_mla'])}x")
    return out.out()


def quant_agreement(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    for mode, x in d["results"].items():
        out.add(src, f"{d['model']}, {mode}: top-1 agreement",
                pct(x["teacher_forced_agreement"]), "-", f"{x['positions']} positions",
                f"max |dlogit| {num(x['max_abs_dlogit'])}, rel L2 {num(x['rel_l2'])}")
    return out.out()


def gguf_agreement(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    lc = d["llama_cpp"]
    for mix, e in d["mixes"].items():
        for name, st in e["sets"].items():
            text = "training text" if name == "train" else "held-out text"
            peaked = (f"llama entropy {num(st['llama']['mean_entropy'])} nats, top-1 p "
                      f"{num(st['llama']['mean_top1_prob'])}")
            for quant in ("gguf", "none"):
                x = st[quant]
                kept = e["loomserve_modules"][quant]["quantized"]
                total = sum(kept.values()) + sum(e["loomserve_modules"][quant]["float"].values())
                exact = st.get("transformers")
                note = (f"; = transformers fp32 within "
                        f"{exact['max_abs_dlogprob_vs_loomserve_none']:.0e} "
                        f"({pct(exact['top1_agreement'])} / {exact['mean_abs_dlogprob']:.4f})"
                        if quant == "none" and exact else "")
                out.add(src, f"{mix}, {text}, --quantization {quant}: top-1 agreement / mean "
                        f"|dlogprob| vs llama-server {lc['commit'][:7]}",
                        f"{pct(x['top1_agreement'])} / {x['mean_abs_dlogprob']:.4f}",
                        f">= {pct(d['bars']['min_top1_agreement'])} / <= "
                        f"{d['bars']['max_mean_abs_dlogprob']}" if name == d["bars"]["set"]
                        else "-", f"{x['positions']} positions",
                        f"{peaked}; {sum(kept.values())}/{total} modules in place{note}")
    return out.out()


def agent_clients_two_turn(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    versions = d["client_versions"]
    for c in d["clients"]:
        for t in c["turns"]:
            codes = ", ".join(str(q["status"]) for q in t["requests"]) or "none"
            share = "-" if t["hit_share"] is None else pct(t["hit_share"])
            out.add(src, f"{versions[c['client']]}, turn {t['turn']}: prompt tokens served "
                    f"from the prefix cache", f"{share} of {t['prompt_tokens_looked_up']:,}",
                    "mostly (turn 2)" if t["turn"] == 2 else "-", 1,
                    f"exit {t['rc']} in {t['seconds']} s; requests {codes}")
    return out.out()


def agent_divergence(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/agent_clients/divergence.py")
    for c in d["clients"]:
        turns = ", ".join(f"{k}: {v}" for k, v in sorted(c["requests_per_turn"].items()))
        causes = ", ".join(f"{k} {v:,}" for k, v in sorted(c["miss_causes"].items())) or "none"
        out.add(src, f"{c['label']}: {c['requests']} requests over {len(c['turns'])} turns "
                f"(per turn {turns}), {c['sessions']} session(s): divergence points found",
                str(len(c["points"])), "-", 1,
                "; ".join(f"request {p['request']}: {p['kind']} message {p['message_index']} "
                          f"({p['message_role']}) at byte {p['byte_offset']}"
                          for p in c["points"]) or "none")
        seen = "; ".join(f"request {p['request']}: {p['diverged_tokens']:,} from token "
                         f"{p['token']:,} (seen by {p['seen_by']})" for p in c["server_points"])
        out.add(src, f"{c['label']}: uncached prompt tokens the server attributed to "
                f"`diverged`", f"{c['diverged_tokens']:,}", "-", 1,
                f"of {c['prompt_tokens'] - c['cached_tokens']:,} uncached "
                f"({c['prompt_tokens']:,} prompt); by cause: {causes}"
                + (f"; {seen}" if seen else ""))
    return out.out()


def membw(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/membw.py")
    s = d["settings"]
    out.add(src, f"read bandwidth (sum of {s['gib']} GiB, {s['threads']} threads)",
            f"{num(d['read_gbs'])} GB/s", "-", s["repeats"],
            f"best {num(d['gbs'].get('torch_sum_best', d['read_gbs']))} GB/s")
    return out.out()


def triton_resources(r: Result) -> list[Block]:
    out = Blocks()
    src = r.source(host=NO_TIMING, command="python -m tests.execution.triton_ahead --resources")
    recs = r.data["records"]
    for kernel in sorted({x["kernel"] for x in recs}):
        xs = [x for x in recs if x["kernel"] == kernel and x["target"] == "sm_90" and x.get("ok")]
        if xs:
            out.add(src, f"{kernel}, sm_90: registers per thread (variants)",
                    f"{min(x['registers'] for x in xs)}-{max(x['registers'] for x in xs)}",
                    "-", f"{len(xs)} variants",
                    f"spill stack max {max(x['stack'] for x in xs)} B; shared max "
                    f"{max(x['shared'] for x in xs):,} B")
    failed = sum(1 for x in recs if not x.get("ok"))
    out.add(src, "variants that failed to compile", str(failed), "-", f"{len(recs)} variants")
    return out.out()


def gpu_check(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    dry = " (CPU dry run: no GPU)" if d.get("cpu_only_dry_run") else f" ({d.get('device')})"
    for m in d["models"]:
        if "agreement" in m:  # else it failed or was skipped: its errors are in the file
            a = m["agreement"]
            out.add(src, f"{m['model']}{dry}: greedy outputs equal to the CPU's",
                    f"{a['equal']} of {a['prompts']} prompts", "-", a["prompts"])
        for c, x in m.get("speed", {}).get("decode", {}).items():
            out.add(src, f"{m['model']}{dry}: decode, {streams(c)}", f"{num(x['tok_per_s'])} tok/s",
                    f"{num(x['bandwidth_limit_tok_per_s'])} tok/s (bandwidth)")
    gpu_check_spec(out, src, d.get("spec"), dry)
    gpu_check_async(out, src, d.get("async"), dry)
    return out.out()


def gpu_check_spec(out: Blocks, src: Source, spec: dict | None, dry: str) -> None:
    """Drafts against plain decoding: greedy agreement, decode tok/s on copy prompts, the
    acceptance length and the draft budget's fitted step and draft-row prices."""
    for method, m in (spec or {}).get("methods", {}).items():
        name = f"{spec['model']}{dry}, {method} (k = {m['config']['num_speculative_tokens']})"
        if "agreement" in m:
            a = m["agreement"]
            out.add(src, f"{name}: greedy outputs equal to plain decoding's",
                    f"{a['equal']} of {a['prompts']} prompts", "-", a["prompts"])
        for c, x in m["decode"].items():
            p, plain = x.get("prices"), spec["none"]["decode"][c]["tok_per_s"]
            out.add(src, f"{name}: decode on copy prompts, {streams(c)}",
                    f"{num(x['tok_per_s'])} tok/s ({num(x.get('speedup'))}x plain's "
                    f"{num(plain)}; acceptance length {num(x['acceptance_length'])})", "-",
                    "one run", "-" if p is None else f"fitted: step {num(1e3 * p['step_s'])} ms,"
                    f" draft row {num(1e3 * p['draft_row_s'])} ms")


def gpu_check_async(out: Blocks, src: Source, x: dict | None, dry: str) -> None:
    """--async-scheduling against the synchronous loop: agreement, decode rate, host share."""
    if not x or "equal" not in x:
        return
    name = f"{x['model']}{dry}, {streams(x['streams'])}"
    out.add(src, f"{name}: greedy outputs with --async-scheduling equal to without",
            f"{x['equal']} of {x['prompts']} prompts", "-", x["prompts"])
    for mode in ("sync", "async"):
        m = x[mode]
        out.add(src, f"{name}, {mode}: decode (streams / median step)",
                f"{num(m['decode_tok_per_s'])} tok/s (host share {100 * m['host_share']:.0f}%)",
                "-", runs_of(m["runs_step_ms"]), minmax(m["runs_step_ms"], " ms"))


# -- summarisers: scheduler, engine, API -----------------------------------------------------


def scheduler_step(r: Result) -> list[Block]:
    """The latest run of each command line (the file may hold several rounds of them)."""
    out = Blocks()
    latest: dict[str, dict] = {}
    for run in sorted(r.data.get("runs", [r.data]), key=lambda x: x["measured_at"]):
        latest[run.get("command", "")] = run
    runs = sorted(latest.values(), key=lambda x: x["measured_at"])
    src = r.source(host=runs[0].get("cpu"), date=date_span(x["measured_at"] for x in runs),
                   run=f"file {r.name}", command="python benchmarks/scheduler_step.py (each row: "
                   "the latest run of its --running/--context/--threads/--no-runner)")
    for run in runs:
        what = "scheduler + KV" if not run.get("runner") else "+ runner input prep"
        for c in run["cases"]:
            t = c["per_step"]["total"]
            reps = t.get("repeat_medians_us", [])
            lo, hi = (x // 1024 for x in c["context_tokens"])
            out.add(src, f"{what}, {c['running']} running at {lo}K" + (f"-{hi}K" if hi != lo else "")
                    + f", {streams(run['torch_threads'], 'thread')}",
                    f"{num(t['median_us'])} us (p99 {num(t['p99_us'])})",
                    f"target {run['target_us']:,} us", runs_of(reps), minmax(reps, " us"))
    return out.out()


def async_scheduling(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    load = "load average {:.1f} before, {:.1f} after (1 min)".format(
        d["load_average_before"][0], d["load_average_after"][0])
    for m in d["models"]:
        name, n = Path(str(m["model"])).name, d["streams"]
        ms = {}
        for mode in ("sync", "async"):
            x = m[mode]
            ms[mode] = Measure(mode, "median ms/step", x["step_ms"], src.cpu, src.run,
                               tuple(x["runs_step_ms"]))
            out.add(src, f"{name}, {mode}: engine step at {streams(n)}",
                    f"{num(x['step_ms'])} ms ({num(x['tok_per_s'])} tok/s)", "-",
                    runs_of(x["runs_step_ms"]), minmax(x["runs_step_ms"], " ms"))
            out.add(src, f"{name}, {mode}: host share of the step (core thread outside the "
                    "model)", f"{100 * x['host_share']:.1f}% ({num(x['host_ms'])} ms)", "-",
                    runs_of(x["runs_host_share"]),
                    minmax([100 * s for s in x["runs_host_share"]], "%"))
        out.add_ratio(src, ms["async"], ms["sync"], f"{name}, step time at {streams(n)}",
                      interleaved=True, faster="lower")
        out.add(src, f"{name}: greedy outputs identical", "yes" if m["greedy_identical"]
                else "NO", "-", d["rounds"], load)
    return out.out()


def executor_overhead(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    o = d["overhead"]
    runs = o["step_ms_runs"]
    uni, multi = runs["uniproc"], runs["multiproc_tp1"]
    for name, xs in (("uniproc", uni), ("multiproc, 1 rank", multi)):
        out.add(src, f"{name}: decode step, {d['message']['streams']} streams, model "
                     f"{Path(str(d['model'])).name}", f"{num(med(xs))} ms", "-", len(xs),
                minmax(xs, " ms"))
    overlap = max(min(uni), min(multi)) <= min(max(uni), max(multi))
    out.add(src, "executor overhead (multiproc over uniproc, medians)",
            "not resolved by this host (the runs overlap)" if overlap
            else f"{o['overhead_pct']:+.1f}%", f"target {o['target_pct']}%", len(uni))
    comm = d.get("communication")
    if comm:
        meas, form = comm["measured_bytes_per_step"], comm["formula_bytes_per_step"]
        out.add(src, f"TP={comm['tp']} bytes per decode step: all-reduce / gather",
                f"{num(meas['all_reduce'])} / {num(meas['gather'])} B",
                f"formula {num(form['all_reduce'])} / {num(form['gather'])} B")
    return out.out()


def mixed_agentx(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    ms = {}
    for name, by_c in d["results"].items():
        cav = llama_caveat(None, d.get("host"), src.date) if name.startswith("llama") else ""
        flags = " ".join(d.get("scheduler_flags", {}).get(name, []))
        for c, runs in by_c.items():
            for x in runs[:1]:
                nc, uc = x["ttft_warm_no_cold_s"], x["ttft_warm_under_cold_s"]
                label = f"{name} ({flags})" if flags else name
                out.add(src, with_caveat(f"{label}, {streams(c, 'session')}", cav),
                        f"TPGS {num(x['tpgs'])}; ITL p99/p50 {x['itl_p99_over_p50']:.2f}; warm "
                        f"TTFT p90 {num(nc['p90'])} s, under a cold prefill {num(uc['p90'])} s "
                        f"(n={uc['count']}); hit {pct(x['hit_served'])}", "-",
                        f"{x['requests_ok']} requests",
                        f"ITL p50-p99 {num(x['itl_p50_s'])}-{num(x['itl_p99_s'])} s")
                ms[(name, c)] = Measure(name, f"TPGS at {c} sessions", x["tpgs"], src.cpu,
                                        src.run, caveat=cav)
    for (name, c), m in sorted(ms.items()):
        if name != "today" and ("today", c) in ms:
            out.add_ratio(src, m, ms[("today", c)], f"{c} sessions (TPGS, the same work)",
                          interleaved=True)
    return out.out()


def mixed_traffic(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    for name, runs in d["runs"].items():
        flags = " ".join(d["configs"].get(name, [])) or "defaults"
        gaps = [x["worst_gap_during_prefill_s"] for x in runs]
        p99 = [x["itl_p99_s"] for x in runs]
        out.add(src, f"{name} ({flags}): worst stream gap during a {d['args']['prefill_tokens']:,}"
                     f"-token prefill", f"{num(med(gaps))} s", "-", len(gaps), minmax(gaps, " s"))
        out.add(src, f"{name}: ITL p99 of {d['args']['streams']} streams", f"{num(med(p99))} s",
                "-", len(p99), minmax(p99, " s"))
    return out.out()


MODE = {"none": "fp32", "gguf": "gguf"}  # --quantization of the step a share is of


def grammar_mask(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    steps = d.get("decode_step_ms", {})
    for mode, by_streams in sorted(steps.items()):
        for n, ms in sorted(by_streams.items(), key=lambda kv: int(kv[0])):
            out.add(src, f"plain decode step, {MODE.get(mode, mode)}, {streams(n)} (the "
                         f"denominator below)", f"{num(ms)} ms", "-", d.get("steps", 1), "median")
    for x in d.get("results", []):
        total = x["fill_ms"] + x["accept_ms"] + x["engine_apply_ms"]
        if "share_of_step" in x:  # the step measured in the same run
            share = ", ".join(f"{pct(v)} of a {MODE.get(m, m)} step"
                              for m, v in sorted(x["share_of_step"].items()))
        else:
            share = f"{pct(x['share_of_given_step'])} of a given {num(d['step_ms_given'])} ms step"
        out.add(src, f"{x['library']}, {x['grammar']}, {streams(x['streams'])}: mask fill + accept "
                     f"+ apply per step", f"{num(total)} ms", share)
    for x in d.get("engine_decode_steps", []):
        out.add(src, f"engine decode step, {x['streams']} streams: constrained vs plain",
                f"{num(x['constrained_ms'])} vs {num(x['plain_ms'])} ms wall", "-", x["steps"],
                f"CPU {num(x['constrained_cpu_ms'])} vs {num(x['plain_cpu_ms'])} ms")
    return out.out()


def tool_parsing(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    for x in d["results"]:
        out.add(src, f"{x['format']} parser, {x['output']}: per token",
                f"{num(x['us_per_token'])} us", "-", x["tokens"], f"p99 feed {num(x['p99_feed_us'])} us")
    return out.out()


def agent_api_cache(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    for api, x in d["results"].items():
        s = x["summary"]
        out.add(src, f"{api}: prefix-cache hit, {d['turns']} turns", pct(s["hit"]),
                f"{pct(s['reuse'])} reusable", f"{s['prompt_tokens']:,} prompt tokens")
    return out.out()


# -- summarisers: KV cache and tiers ---------------------------------------------------------


def kv_manager_cost(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/kv_manager_cost.py (arguments not recorded)")
    w = d["workload"]
    ms = {}
    for name, x in d.items():
        if isinstance(x, dict) and "median_ms_last8_turns" in x:
            label = f"{name} {x.get('version', '')}".strip()
            out.add(src, f"{label}: per turn, the last 8 of {w['turns']}",
                    f"{num(x['median_ms_last8_turns'])} ms", "-", w["reps"])
            ms[name] = Measure(label, "median ms, last 8 turns", x["median_ms_last8_turns"],
                               src.cpu, src.run)
    for name, m in sorted(ms.items()):
        if name.startswith("vllm"):
            out.add_ratio(src, ms["loomserve"], m, "per turn at 128K (speed)", interleaved=True,
                          faster="lower")
    return out.out()


def kv_refresh_cost(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    for what in ("probe", "refresh"):
        xs = d[f"{what}_ms"]
        out.add(src, f"{what} of a {d['tokens']:,}-token cached prompt", f"{num(med(xs))} ms",
                "-", len(xs), minmax(xs, " ms"))
    return out.out()


def hybrid_retention(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(host={"cpu": d.get("machine", "CPU not recorded")})
    for name, s in d["sets"].items():
        out.add(src, f"{name}: best retention / full attention, worst capacity",
                f"{s['min_best_over_fa']:.3f}", "target 0.9", f"{s['requests']:,} requests")
    return out.out()


def hybrid_served(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/hybrid_served.py (arguments in the file)")
    out.add(src, "hybrid model served: hit rate served vs the simulator's",
            f"{pct(d['served_hit_rate'])} vs {pct(d['simulated_hit_rate'])} "
            f"({d['gap_points']:.1f} points)", f"target within {d['target_gap_points']} points",
            f"{d['requests']} requests")
    return out.out()


def hybrid_pages(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    t = d["targets"]
    for m in d["models"]:
        b, a = m["before"], m["after"]
        split = a.get("state_layers_per_group") or "all"
        out.add(src, f"{m['model']}: block tokens, groups (attention + state)",
                f"{b['block_size']}, {b['attention_groups']} + {b['state_groups']} -> "
                f"{a['block_size']}, {a['attention_groups']} + {a['state_groups']} "
                f"({split} state layer{'' if split == 1 else 's'} each)", "-", "-",
                f"vLLM's rule, same dtypes: block {m['vllm_rule_block_size']}")
        uses = " / ".join(f"{100 * g['use']:.1f}%" for g in
                          {(g['kind'], g['layers']): g for g in a["groups"]}.values())
        out.add(src, f"{m['model']}: smallest share of a page in use (page MiB)",
                f"{100 * b['min_use']:.1f}% ({b['page_bytes'] / 2**20:.2f}) -> "
                f"{100 * a['min_use']:.1f}% ({a['page_bytes'] / 2**20:.2f})",
                f">= {100 * t['min_use']:.0f}%", "-", f"after, per group kind: {uses}")
        out.add(src, f"{m['model']}: tokens per GiB of pages (unpadded ideal)",
                f"{b['tokens_per_gib']:,.0f} -> {a['tokens_per_gib']:,.0f} "
                f"({a['ideal_tokens_per_gib']:,.0f}: {100 * a['tokens_vs_ideal']:.1f}%)",
                f">= {100 * t['tokens_vs_ideal']:.0f}% of ideal", "-", "-")
        lims = ", ".join(f"{k}: {x['block_size']} / {x['state_groups']} / "
                         f"{100 * x['min_use']:.0f}%" for k, x in m["limits"].items())
        out.add(src, f"{m['model']}: per --max-hybrid-block-size, block / state groups / use",
                lims, "-", "-", "-")
        ms = m["manager_ms_per_turn"]
        out.add(src, f"{m['model']}: KV manager CPU per agent turn at 64K tokens",
                f"{num(ms['before'])} -> {num(ms['after'])} ms",
                "-", "3 reps", f"raised block, states not split: {num(ms['after_one_state_group'])} ms")
    return out.out()


def simulator_check(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(host=NO_TIMING,
                   command="python benchmarks/simulator_check.py (arguments not recorded)")
    ref = d["reference"]
    out.add(src, f"LRU hit rate vs {ref['package']} {ref['version']}, largest difference",
            f"{d['max_lru_diff_pp']:.2f} points", "target 1 point", f"{len(d['points'])} capacities")
    return out.out()


def simulator_sweep(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(host=NO_TIMING,
                   command=d.get("note", "loomserve bench simulate --sweep").split(" (")[0])
    for c in d["curve"]:
        if c["capacity_fraction"] in (0.1, 0.2, 0.5):
            out.add(src, f"capacity {c['capacity_fraction']:.0%} of the working set: LRU / "
                         f"Belady-optimal", f"{pct(c['lru'])} / "
                         f"{pct(c['optimal'])}", f"{pct(c['infinite'])} (infinite cache)")
    return out.out()


def tier_bandwidth(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/tier_bandwidth.py")
    ref = d["reference"]
    limits = {"host": f"memcpy {num(ref['memcpy_mbs'])} MB/s",
              "disk": f"disk write+fsync {num(ref['disk']['write_fsync_mbs'])} / read "
                      f"{num(ref['disk']['read_mbs'])} MB/s"}
    for tier, x in d["tiers"].items():
        out.add(src, f"{tier} tier: store / load, {d['page_bytes'] >> 20} MiB pages",
                f"{num(x['store_mbs'])} / {num(x['load_mbs'])} MB/s", limits.get(tier, "-"),
                d["repeats"])
    return out.out()


def tiers_agentx(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    ms = {}
    for name, x in d["results"].items():
        split = ", ".join(f"{k} {pct(v)}" for k, v in x["hit_by_source"].items())
        out.add(src, name, f"hit {pct(x['hit_served'])} ({split}); TPGS {num(x['tpgs'])}",
                f"hit {pct(x['hit_theoretical'])} (theoretical)", f"{x['requests_ok']} requests",
                f"TTFT p50 {num(x['ttft_p50_s'])} s")
        ms[name] = Measure(name, "TPGS", x["tpgs"], src.cpu, src.run)
    for name in ("host", "disk", "mc"):
        if name in ms and "device" in ms:
            out.add_ratio(src, ms[name], ms["device"], "TPGS", interleaved=False)
    return out.out()


def kv_events_cost(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/kv_events_cost.py")
    out.add(src, f"KV event publishing, {d['seqs_per_step']} sequences per step: core thread",
            f"{num(d['core_thread_us_per_step'])} us/step", "-", d["reps"],
            f"end to end {num(d['end_to_end_us_per_step'])} us; {d['payload_bytes_per_step']:,} B")
    return out.out()


def miss_attribution_cost(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/miss_attribution_cost.py")
    t = d["traces_part"]
    for x in t["runs"]:
        g, a, m = x["miss_gap"], x["attribution_cpu_us"], x["manager_cpu_us"]
        pool = f"{t['traces']} traces, pool {x['capacity_fraction']:.0%} of the working set"
        causes = ", ".join(f"{k} {num(v)}" for k, v in g["points"].items()) or "none"
        n = x["measured_requests"]
        out.add(src, f"{pool}, {n} requests: hit-rate gap, theoretical {g['theoretical']:.2%} "
                f"- served {g['served']:.2%}", f"{num(g['gap_points'])} points", "-", 1,
                f"by cause: {causes}; unattributed {num(abs(g['unattributed_points']))}")
        out.add(src, f"{pool}: miss attribution CPU per request (manager: "
                f"{num(m['median'])} us)", f"median {num(a['median'])} us",
                "-", 1, f"p99 {num(a['p99'])} us, mean {num(a['mean'])} us")
    e = d.get("engine_part")
    if e:
        out.add(src, f"engine, {e['streams']} streams (tiny Llama, CPU): attribution per step "
                f"({e['admissions']} admissions in {e['steps']} steps)",
                f"{num(e['attribution_us_per_step'])} us",
                "< 1% of the step", 1,
                f"{e['attribution_share_of_step_time']:.3%} of step time (median step "
                f"{num(e['step_ms_median'])} ms); {num(e['attribution_us_per_admission'])} us "
                f"per admission")
    return out.out()


def miss_gap_served(r: Result) -> list[Block]:
    """A row per run: one instance at a pool, or (a -router file) N instances behind the
    router at a pool each, with the router's own miss counter beside the client's gap."""
    out, d = Blocks(), r.data
    router = d.get("router")
    src = r.source(command="python benchmarks/miss_gap_served.py"
                   + (f" --router {router['instances']}" if router else ""))
    for x in d["runs"]:
        g = x["miss_gap"]
        causes = ", ".join(f"{k} {num(v)}" for k, v in g["points"].items()) or "none"
        where = (f"{router['instances']} instances x pool {x['pool']} behind the router "
                 f"({router['policy']} policy)" if router else f"pool {x['pool']}")
        counted = ""
        if router:
            counted = "; the router's counter, tokens: " + ", ".join(
                f"{k} {v}" for k, v in x["router"]["miss_tokens"].items())
        out.add(src, f"{d['model']}, {where}, {x['requests']} requests: hit-rate gap, "
                f"theoretical {g['theoretical']:.2%} - served {g['served']:.2%}",
                f"{num(g['gap_points'])} points", "unattributed < 0.5", 1,
                f"by cause: {causes}; unattributed {num(abs(g['unattributed_points']))}"
                + counted)
    return out.out()


def kv_transfer_bandwidth(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    for x in d["rows"]:
        out.add(src, f"{x['mib']} MiB: Mooncake transfer engine (paged)",
                f"{num(x['mooncake_pages_gbps'])} GB/s", f"memcpy {num(x['memcpy_gbps'])} GB/s",
                d["reps"])
    return out.out()


# -- summarisers: control plane ----------------------------------------------------------------


def router_agentx(r: Result) -> list[Block]:
    """One block per file, a row per run (each alone, one after another). A ratio only
    between runs of one invocation: the file's last (its args.runs), or one envelope's run."""
    out, d, a = Blocks(), r.data, r.data["args"]
    last = set(a.get("runs") or ())
    cmd = (f"python benchmarks/router_agentx.py --concurrency {a['concurrency']} --duration "
           f"{a['duration']:g}{' --once' if a.get('once') else ''}"
           f"{' --model ' + a['model'] if a.get('model') else ''} ... (args in the file)")
    src = r.source(date=date_span(x["date"] for x in d["runs"].values()), run=f"file {r.name}",
                   command=cmd)
    ms: dict[tuple[str, str], dict[str, Measure]] = {}
    for key, x in sorted(d["runs"].items()):
        run = (x.get("envelope") or {}).get("run") or \
            ("last invocation" if key in last else f"{key} alone")
        out.add(src, f"{key} ({date_text(x['date'])[11:16]})",
                f"hit {pct(x['hit_served'])}; TPGS {num(x['tpgs'])}",
                f"hit {pct(x['hit_theoretical'])} (theoretical)",
                f"{x['requests_ok']} ok" + (f", {x['errors']} failed" if x["errors"] else ""),
                f"TTFT p50-p90 {num(x['ttft_p50_s'])}-{num(x['ttft_p90_s'])} s")
        pool, policy = key.split("/", 1)
        ms.setdefault((run, pool), {})[policy] = Measure(key, "TPGS", x["tpgs"], src.cpu, run)
    for (_, pool), by in sorted(ms.items()):
        if "default" in by and "round_robin" in by:
            out.add_ratio(src, by["default"], by["round_robin"], "TPGS, one invocation",
                          interleaved=False)
    return out.out()


def date_span(dates: Iterable[str]) -> str:
    """"2026-12-03 11:01-11:20 UTC" over one day, else first to last."""
    ts = sorted(date_text(x) for x in dates)
    if ts[0] == ts[-1]:
        return ts[0]
    if ts[0][:10] == ts[-1][:10] and len(ts[0]) == len(ts[-1]) == 20:
        return f"{ts[0][:16]}-{ts[-1][11:16]} UTC"
    return f"{ts[0]} to {ts[-1]}"


def router_overhead(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/router_overhead.py")
    for case, x in d["results"].items():
        out.add(src, f"{case}, {d['sessions']:,} sessions over {d['instances']} instances",
                f"{num(x['p50_us'])} us (p50)", "-", x["n"],
                f"p50-p99 {num(x['p50_us'])}-{num(x['p99_us'])} us")
    return out.out()


def pd_agentx(r: Result) -> list[Block]:
    """The runs within an hour of the newest, each its own layout and run;
    the ratio is within a run: warm streams' ITL p99 beside cold prefills over without."""
    out, runs = Blocks(), r.data["runs"]
    newest = datetime.strptime(max(date_text(x["date"]) for x in runs.values()),
                               "%Y-%m-%d %H:%M UTC")
    cutoff = (newest - timedelta(hours=1)).strftime("%Y-%m-%d %H:%M UTC")
    latest = {k: x for k, x in runs.items() if date_text(x["date"]) >= cutoff}
    src = r.source(date=date_span(x["date"] for x in latest.values()), run=f"file {r.name}",
                   command="python benchmarks/pd_agentx.py (arguments in the file, per run)")
    by_config: dict[str, list[float]] = {}
    for key, x in sorted(latest.items()):
        q, c = x["quiet"], x["cold"]
        under, quiet = (Measure(f"{key} {w}", "warm ITL p99", v["warm_itl_p99_ms"], src.cpu, key)
                        for w, v in (("cold", c), ("quiet", q)))
        within = ratio(under, quiet)
        by_config.setdefault(key.split("#")[0], []).append(within)
        tail = (f"; p99.9 {num(q['warm_itl_p999_ms'])} / {num(c['warm_itl_p999_ms'])}, max "
                f"{num(q['warm_itl_max_ms'])} / {num(c['warm_itl_max_ms'])} ms"
                if "warm_itl_p999_ms" in q else "")
        out.add(src, f"{key} ({date_text(x['date'])[11:16]}): warm ITL p99, quiet / beside "
                     f"{c['cold_requests']} cold prefills",
                f"{num(q['warm_itl_p99_ms'])} / {num(c['warm_itl_p99_ms'])} ms "
                f"({within:.2f}x)", "-", f"{q['itl_samples']} / {c['itl_samples']} gaps",
                f"p50 {num(q['warm_itl_p50_ms'])} / {num(c['warm_itl_p50_ms'])} ms{tail}")
    for config, ratios in sorted(by_config.items()):
        if len(ratios) > 1:  # each ratio within its own run; their spread across runs
            out.add(src, f"{config}: warm ITL p99 beside cold prefills over quiet, median of "
                         f"runs", f"{med(ratios):.2f}x", "-", f"{len(ratios)} runs",
                    minmax(ratios, "x"))
    return out.out()


def pd_profile(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="loomserve bench pd-profile (arguments not recorded)")
    w = d["workload"]
    out.add(src, f"prefill saturation, {w['input_len']} in / {w['output_len']} out",
            f"{num(d['prefill']['saturation']['rate'])} tok/s", "-",
            f"{len(d['prefill']['levels'])} levels")
    dec = d["decode"]["saturation"]
    out.add(src, "decode rate" + ("" if dec["reached"] else " (not saturated: a lower bound)"),
            f"{num(dec['rate'])} tok/s", "-", f"{len(d['decode']['levels'])} levels")
    out.add(src, "prefill instances per decode instance", f"{d['ratio']['prefill_per_decode']:.2f}",
            "-", "-", f"layout: {' + '.join(d['layout']['roles'])}")
    return out.out()


def agentx_crosscheck(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/agentx_crosscheck.py (arguments not recorded)")
    for stat, label in (("tpgs", "TPGS"), ("served_hit_rate", "served hit rate")):
        s = d["summary"][stat]
        xs = {t: [x[stat] for x in d["runs"] if x["tool"] == t] for t in ("agentx-harness",
                                                                           "loomserve")}
        a, b = (Measure(t, f"median {label}", s[k], src.cpu, src.run, tuple(xs[t]))
                for t, k in (("loomserve", "loomserve_median"),
                             ("agentx-harness", "harness_median")))
        out.add_ratio(src, a, b, f"median {label}",
                      interleaved=True)
    return out.out()


# -- summarisers: parallelism -----------------------------------------------------------------


def dcp_capacity(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    runs = d["runs"]
    m = d["model"]["name"]
    for dcp, x in runs.items():
        out.add(src, f"{m}, DCP={dcp}: KV capacity", f"{x['capacity']['capacity_tokens']:,} tokens",
                "-", 1)
        dec = x["decode"]
        if dec["gathered_bytes"]:
            out.add(src, f"{m}, DCP={dcp}: all-gathered bytes per layer and token",
                    f"{num(dec['gathered_bytes_per_layer_token'])} B",
                    f"formula {num(x['formula_bytes_per_layer_token'])} B", 1)
    out.add(src, f"{m}: greedy outputs equal across DCP sizes",
            "yes" if d["greedy_identical"] else "no")
    return out.out()


def pcp_prefill(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/pcp_prefill.py (arguments in the file)")
    for x in d["runs"]:
        out.add(src, f"{d['args']['tokens']:,}-token cold prefill, {x['layout']} (PCP={x['pcp']}, "
                     f"{streams(x['threads_per_rank'], 'thread')} per rank)", f"{num(x['median_s'])} s",
                f"{num(x['flop_limit_s'])} s (FLOP)", len(x["seconds"]), minmax(x["seconds"], " s"))
    return out.out()


def prefill_interval(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(date=min((x["date"] for x in d["runs"] if "date" in x), default=None),
                   command="python benchmarks/prefill_interval.py (arguments in the file)")
    for x in d["runs"]:
        out.add(src, f"DEP=2, --prefill-schedule-interval {x['interval']}",
                f"TPGS {num(x['tpgs'])}; dummy steps {pct(x['dummy_fraction'])}", "-",
                f"{x['requests']} requests",
                f"warm ITL p50-p99 {num(x['warm_itl_p50_ms'])}-{num(x['warm_itl_p99_ms'])} ms")
    return out.out()


def dep_comm(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source(command="python benchmarks/dep_comm.py (arguments in the file)")
    for x in d["ranks"]:
        out.add(src, f"rank {x['rank']}: MoE bytes sent off-rank per token and layer",
                f"{num(x['bytes_per_token_layer'])} B",
                f"formula {num(d['formula_bytes_per_token_layer'])} B", f"{x['steps']} steps")
    return out.out()


def moe_grouped(r: Result) -> list[Block]:
    """Per dtype and tokens per step: the grouped call against the loop (one run, medians)."""
    out, d = Blocks(), r.data
    src = r.source()
    for x in d["results"]:
        g, lo = (Measure(v, "median ms", x["ms"][v], src.cpu, src.run) for v in ("grouped", "loop"))
        runs = x["ms_all"]["grouped"]
        out.add(src, f"{x['dtype']}, {streams(x['tokens'], 'token')}/step "
                     f"({x['experts_touched']} experts), {streams(d['threads'], 'thread')}",
                f"{num(x['ms']['grouped'])} ms = {num(x['tokens_per_s']['grouped'])} tok/s "
                f"(loop {num(x['ms']['loop'])} ms: {num(ratio(lo, g))}x)",
                f"{num(x['limit_ms'])} ms ({x['limit_by']}: {num(d['read_gbs'])} GB/s, "
                f"{num(d['gemm_gflops'])} GFLOP/s)", len(runs),
                f"{num(min(runs))}-{num(max(runs))} ms")
    load = ((d.get("envelope") or {}).get("host") or {}).get("loadavg_at_start")
    if load:
        out.add(src, "host load average at the start (1, 5, 15 min)", ", ".join(map(str, load)))
    return out.out()


def moe_grouped_figure(r: Result, png: Path) -> None:
    """tokens/s against tokens per step, grouped and loop per dtype, beside the roofline."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7.6, 4.0))
    for dt, color in zip(sorted({x["dtype"] for x in r.data["results"]}), ("C0", "C2", "C3")):
        xs = [x for x in r.data["results"] if x["dtype"] == dt]
        n = [x["tokens"] for x in xs]
        for v, style in (("grouped", "-o"), ("loop", "--s")):
            ax.plot(n, [x["tokens_per_s"][v] for x in xs], style, color=color, label=f"{dt} {v}")
        ax.plot(n, [x["tokens"] / x["limit_ms"] * 1e3 for x in xs], ":", color=color,
                label=f"{dt} roofline")
    src = r.source()
    load = ((r.data.get("envelope") or {}).get("host") or {}).get("loadavg_at_start", ["?"])[0]
    ax.set(xscale="log", yscale="log", xlabel="tokens per step", ylabel="tokens/s",
           title=f"Qwen3-30B-A3B MoE layer: grouped experts vs loop, "
                 f"{streams(r.data['threads'], 'thread')}\n{src.cpu}, load average {load} "
                 f"at start, {src.date}")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(png, metadata={"Software": None})
    plt.close(fig)


def miss_gap_figure(r: Result, png: Path) -> None:
    """A stacked bar per run (served, then the gap by cause), titled with where it ran."""
    from loomserve.bench.report import plot_miss_gap

    d, src = r.data, r.source()
    router = d.get("router")
    labels = [f"{router['instances']} x {x['pool']}, {router['policy']}" if router
              else x["pool"] for x in d["runs"]]
    plot_miss_gap([x["miss_gap"] for x in d["runs"]], labels, str(png),
                  note=f"{d['model']}; {src.cpu}, {src.commit}, {src.date}")


# Figures drawn from a results file, written beside it as .png by `python -m benchmarks.report`.
FIGURES: dict[str, Callable[[Result, Path], None]] = {"moe_grouped*.json": moe_grouped_figure,
                                                      "miss_gap_served*.json": miss_gap_figure}


def gpu_tp_check(r: Result) -> list[Block]:
    out, d = Blocks(), r.data
    src = r.source()
    out.add(src, f"TP={d['tp']} on {d['device']}: greedy agreement with TP=1", pct(d["agreement"]),
            "-", len(d["first_difference"]))
    return out.out()


FAMILIES: tuple[Family, ...] = (
    Family("decode_throughput*.json", "Decode throughput, the default model served",
           "Aggregate decode tokens/s of streaming completions at 1-32 concurrent streams, the "
           "systems interleaved round by round on one host; the limit is the bandwidth roofline "
           "(weights + KV read per step at the measured read bandwidth).", decode_throughput),
    Family("spec_decode*.json", "Speculative decoding on agent-shaped work",
           "Decode tok/s of the built-in model with ngram and suffix drafts against none, on "
           "edits that copy a source file, multi-turn sessions that re-read it and a control "
           "set with nothing to copy (benchmarks/spec_decode.py); suffix-request is the suffix "
           "drafter without its session tree; none-staggered is plain decoding with its streams' "
           "prefill spread out: its text mismatches against none are the baseline, as greedy "
           "text is exact only for the same prefill chunks (docs/design/speculative.md). "
           "Acceptance length = 1 + accepted / drafts.",
           spec_decode),
    Family("default_long_context*.json", "Default model at a long prompt",
           "Decode ms/token of the default model (its Q4_1 GGUF, `--quantization gguf`) after a "
           "7,000-token prompt, one stream, each server alone; the limit is weights + KV read "
           "per token at the measured bandwidth.", default_long_context),
    Family("long_context*.json", "Long context: decode at 128K, prefill over a cached prefix",
           "A tiny long-context Llama (benchmarks/longctx/model.py), served: ms per generated "
           "token at 128K context and seconds for 24K new tokens over a cached 104K prefix, each "
           "server alone; limits: the KV read at the measured bandwidth, the attention FLOPs at a "
           "measured fp32 matmul rate.", long_context),
    Family("agentx_cpu*.json", "AgentX-style replay on a CPU",
           "A closed-loop replay of synthetic agent sessions (`loomserve bench agentx`) against "
           "loomserve and llama-server, each alone: TPGS (tokens per GPU-second, here per host "
           "second), TTFT, served prefix hit rate.", agentx_cpu),
    Family("process_layout*.json", "Engine core in its own process",
           "Aggregate decode tok/s with the engine core in a second process vs in the API "
           "process, both servers up at once, rounds interleaved.", process_layout),
    Family("server_startup*.json", "Server start and memory",
           "Launch to a healthy /health of `loomserve serve` with the default model, and resident "
           "memory summed over the server's processes.", server_startup),
    Family("paged_attention*.json", "Paged attention kernels",
           "Attention alone, the tiny long-context model's shape, blocks scattered over the "
           "pool: the in-place CPU kernels (cpu_paged) against the torch backend (gather + SDPA), "
           "beside the KV-read and FLOP limits.", paged_attention),
    Family("dense_matmul*.json", "Few-row dense products",
           "The default model's matrices at 1-32 rows: loomserve's kernel against torch, as "
           "read bandwidth.", dense_matmul),
    Family("quant_matmul*.json", "Quantized products",
           "The whole model's matrices per variant (fp32, Q4_1, Q8_0, Q5_0) at 1 and 32 rows, each "
           "timed in cache, then whole models over distinct matrices (the default Q4_1 GGUF, "
           "llama-quantize's Q4_K_M mix, that mix with Q5_0 widened to int8 as before); the "
           "K-quants at the nearest shapes with whole 256-blocks (576x512, 1536x512, 576x1536, "
           "49152x512) beside Q4_1, Q5_0 and Q8_0 there; each beside the time to read the "
           "weights once.", quant_matmul),
    Family("matmul_layout*.json", "Weight layouts for the CPU matmul",
           "The default model's matrices in the stored layout against the re-laid one.",
           matmul_layout),
    Family("fused_ops*.json", "Fused layer ops",
           "The C kernels that fuse residual add + RMSNorm and SiLU x mul, alone and inside "
           "whole decode steps, against torch's eager ops.", fused_ops),
    Family("mla_decode*.json", "MLA decode, one layer",
           "DeepSeek-V3's attention shape: the absorbed (latent) decode against decompressing "
           "to per-head K/V, beside their limits.", mla_decode),
    Family("sparse_mla_decode*.json", "DeepSeek sparse attention decode, one layer",
           "DeepSeek-V3.2's per-layer dims with 16 of its 128 MLA heads, fp32, caches filled "
           "with random rows: the lightning indexer's pass over every key, MLA over its top-2,048 "
           "latent rows read in place, and dense absorbed MLA over the whole context, each beside "
           "its limit and the bytes it reads at 30 GB/s.", sparse_mla_decode),
    Family("quant_agreement*.json", "Quantized weights against the reference",
           "Teacher-forced agreement and logit error of the quantized modes against the GGUF "
           "dequantized to fp32.", quant_agreement),
    Family("agent_clients_two_turn*.json", "Real agent CLIs, two turns, built-in model",
           "Claude Code (default tools) and Codex from npm, each a two-turn session against the "
           "built-in model started with README.md's agent command (read from the README by "
           "benchmarks/agent_clients/two_turn.py): exit codes, statuses, and the share of each "
           "turn's prompt tokens the prefix cache served.", agent_clients_two_turn),
    Family("agent_divergence*.json", "Real agent clients: where their prompts diverge",
           "Claude Code, Codex and opencode from npm, each a 3-turn tool-using session against "
           "the built-in model, recorded request by request (benchmarks/agent_clients/"
           "record_sessions.py); prompt_diff.scan over the recordings finds where a request "
           "stopped extending its session's previous one, beside the uncached tokens the server "
           "attributed to `diverged` (benchmarks/agent_clients/divergence.py).", agent_divergence),
    Family("gguf_agreement*.json", "GGUF K-quant mixes against llama.cpp",
           "Teacher-forced next-token logprobs of loomserve and llama-server on the same files, "
           "a tiny trained llama converted and quantized by llama.cpp's own tools into each mix "
           "(benchmarks/gguf_agreement.py): top-1 agreement and mean |logprob difference| of the "
           "next token. The limits apply to text the model was trained on (peaked); held-out "
           "text is broader, and there the exact fp32 forward (transformers) is no closer to "
           "llama-server than loomserve.", gguf_agreement),
    Family("membw*.json", "Memory bandwidth",
           "Sustained read bandwidth (benchmarks/membw.py), the denominator of every bandwidth "
           "limit on this page for its host.", membw),
    Family("triton_compile_resources*.jsonl", "Triton kernels compiled without a GPU",
           "Every Triton kernel variant compiled for sm_90 by the Triton wheel's ptxas: "
           "registers per thread, spills and shared memory (no speed: no GPU).",
           triton_resources),
    Family("gpu_check*.json", "GPU check", "CUDA against CPU greedy agreement and speed beside "
           "the HBM and FLOP rooflines (benchmarks/gpu_check.py).", gpu_check),
    Family("scheduler_step*.json", "Host CPU per engine step",
           "Scheduler + KV bookkeeping per step, and with the model runner's input preparation "
           "(the model stubbed), against a 1 ms target.", scheduler_step),
    Family("async_scheduling*.json", "Async scheduling",
           "Engine step time at 64 decoding streams with --async-scheduling (the next step "
           "scheduled while this one executes on another thread) and without, rounds "
           "alternating; the host share of the step (the core thread's time outside the model); "
           "greedy outputs compared.", async_scheduling),
    Family("executor_overhead*.json", "Executor step overhead",
           "A decode step through the multiprocess executor at one rank against the in-process "
           "one, runs alternating; and the TP collectives' bytes beside their formula.",
           executor_overhead),
    Family("mixed_traffic*.json", "Mixed traffic: streams under a long prefill",
           "Running streams' worst gap and ITL while a long cold prefill arrives, per scheduler "
           "configuration.", mixed_traffic),
    Family("mixed_agentx*.json", "AgentX replays with forked subagents",
           "Equal-work replays (`--once`: every trace to its end) per scheduler and "
           "llama-server, interleaved: TPGS, ITL tail, warm turns' TTFT with and without a "
           "cold prefill running beside them.", mixed_agentx),
    Family("grammar_mask*.json", "Grammar-constrained decoding cost",
           "xgrammar's (and llguidance's, where installed) mask work per decode step, as a share "
           "of the default model's own plain decode step measured in the same run (fp32 and "
           "gguf); or the engine's step with and without a grammar.", grammar_mask),
    Family("tool_parsing*.json", "Tool-call parsing", "Parser time per streamed token.",
           tool_parsing),
    Family("agent_api_cache*.json", "Agent APIs: prefix-cache hits",
           "The prefix-cache hit rate of one multi-turn tool conversation sent through each "
           "API (Chat Completions, Messages, Responses).", agent_api_cache),
    Family("kv_manager_cost*.json", "KV cache manager cost per agent turn",
           "KV bookkeeping (hash, lookup, allocate, free) per turn of a conversation growing to "
           "128K tokens, loomserve's manager against vLLM's, repetitions interleaved.",
           kv_manager_cost),
    Family("kv_refresh_cost*.json", "Prefix refresh cost",
           "An arriving request's cached prefix made most recently used, beside the probe that "
           "hashes the prompt.", kv_refresh_cost),
    Family("hybrid_retention*.json", "Hybrid models: state-checkpoint retention",
           "Simulated hit rates of retention policies for a Qwen3-Next-like hybrid over recorded "
           "and synthetic traces, against a full-attention-only bound.", hybrid_retention),
    Family("hybrid_served*.json", "Hybrid models served",
           "A served hybrid model's hit rate against the simulator's on the same requests.",
           hybrid_served),
    Family("hybrid_pages*.json", "Hybrid models: KV page use at real dimensions",
           "From config.json dimensions only (benchmarks/hybrid_pages.py): each page's share in "
           "use and tokens per GiB, with one block size and pages as large as a whole state "
           "(before) and with a raised block and split state groups (after).", hybrid_pages),
    Family("simulator_check*.json", "KV-cache simulator check",
           "loomserve's offline cache simulator against kvcache-simulator on the weka traces.",
           simulator_check),
    Family("simulator_sweep*.json", "KV-cache capacity sweep",
           "Token hit rate against cache capacity: LRU, Belady-optimal and an infinite cache.",
           simulator_sweep),
    Family("tier_bandwidth*.json", "KV tiers: transfer bandwidth",
           "Store and load of KV pages per tier (host memory, disk, Redis, Mooncake), beside "
           "memcpy and raw disk.", tier_bandwidth),
    Family("tiers_agentx*.json", "KV tiers in a replay",
           "An AgentX-style replay with a small device pool and each tier behind it: served "
           "hit rate by source, TPGS.", tiers_agentx),
    Family("kv_events_cost*.json", "KV event publishing cost",
           "The engine core's cost of publishing KV events per step.", kv_events_cost),
    Family("miss_attribution_cost*.json", "Prefix-cache miss attribution",
           "Why prompts missed the cache on the shared AgentX traces (the gap between the "
           "served and the theoretical hit rate by cause) and what attributing it costs.",
           miss_attribution_cost),
    Family("miss_gap_served*.json", "Prefix-cache miss attribution, served replays",
           "AgentX replays of the shared traces through a real server at three KV pool sizes, "
           "and through the router over two instances at tight pools: the gap between the "
           "served and the theoretical hit rate, by miss cause.\n\n"
           "![miss gap, one instance](../benchmarks/results/miss_gap_served.png)\n"
           "![miss gap, router](../benchmarks/results/miss_gap_served-router.png)\n"
           "![miss gap, router, kv_aware](../benchmarks/results/"
           "miss_gap_served-router-kv_aware.png)",
           miss_gap_served),
    Family("kv_transfer_bandwidth*.json", "P/D KV transfer bandwidth",
           "KV transfer through Mooncake's transfer engine beside memcpy.", kv_transfer_bandwidth),
    Family("router_agentx*.json", "Router: AgentX-style replay per policy",
           "Three instances behind `loomserve router`, the pool per instance a tenth or half of "
           "the sessions' working set, against round robin and one instance with 3x the pool "
           "(`ideal`): served hit rate, TPGS, TTFT.", router_agentx),
    Family("router_overhead*.json", "Router decision overhead",
           "Time per routing decision at 1,000 sessions.", router_overhead),
    Family("pd_agentx*.json", "Prefill/decode disaggregation: warm streams under cold prefills",
           "Warm streams' inter-token latency with and without cold prefills arriving, per "
           "layout (PD: a prefill and a decode instance; colo: two co-located); each ratio "
           "within one run, then the median over a configuration's runs.", pd_agentx),
    Family("pd_profile*.json", "P/D sizing (`loomserve bench pd-profile`)",
           "Prefill and decode saturation rates of one co-located instance and the P:D ratio "
           "derived from them.", pd_profile),
    Family("agentx_crosscheck*.json", "Replay instrument cross-check",
           "loomserve's replay client against the AgentX harness on the same traces and "
           "server, alternating.", agentx_crosscheck),
    Family("dcp_capacity*.json", "Decode context parallelism: KV capacity",
           "KV capacity at DCP 1 and 2, the all-gather bytes beside the formula, greedy "
           "outputs compared.", dcp_capacity),
    Family("pcp_prefill*.json", "Prefill context parallelism",
           "One cold prefill at PCP 1 and 2, beside the FLOP limit.", pcp_prefill),
    Family("prefill_interval*.json", "Prefill schedule interval under DEP",
           "Fixed work under data + expert parallelism at several prefill schedule intervals.",
           prefill_interval),
    Family("dep_comm*.json", "Communication per decode step under DEP",
           "MoE dispatch bytes per token and layer, measured beside the formula.", dep_comm),
    Family("gpu_tp_check*.json", "Tensor parallel check",
           "Greedy agreement of TP=N with TP=1.", gpu_tp_check),
    Family("moe_grouped*.json", "MoE grouped expert products",
           "One Qwen3-30B-A3B MoE layer (2048 hidden, 128 experts of 768, top-8), random "
           "weights: the routed experts as one grouped C call against a Python loop over "
           "them, calls interleaved; the limit is the touched experts' weights at the read "
           "bandwidth or the FLOPs at a measured fp32 GEMM rate.\n\n"
           "![MoE grouped products](../benchmarks/results/moe_grouped.png)\n"
           "![MoE grouped products, 1 thread](../benchmarks/results/moe_grouped-1thread.png)",
           moe_grouped),
)


# -- the page -------------------------------------------------------------------------------


def result_files(folder: Path) -> list[Path]:
    """The files a family must claim: every top-level file except renderings (.md, .png) that
    sit beside a .json of the same name; subfolders (replay traces) are inputs, not results."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return [p for p in files
            if not (p.suffix in (".md", ".png") and p.with_suffix(".json").exists())]


def family_of(path: Path) -> Family:
    matches = [f for f in FAMILIES if fnmatch.fnmatchcase(path.name, f.pattern)]
    if len(matches) != 1:
        what = "no summariser claims it" if not matches else \
            f"claimed by {len(matches)} families ({', '.join(f.pattern for f in matches)})"
        raise ReportError(f"unparsed result {rel(path)}: {what}; add a summariser "
                          f"to FAMILIES in benchmarks/report.py (or delete a superseded file)")
    return matches[0]


def render(folder: Path = RESULTS) -> str:
    by_family: dict[str, list[Block]] = {}
    for path in result_files(folder):
        fam = family_of(path)
        try:
            by_family.setdefault(fam.pattern, []).extend(fam.summarise(load(path)))
        except (KeyError, TypeError, ValueError, IndexError, StopIteration) as e:
            if isinstance(e, RatioRefused):
                raise
            raise ReportError(f"unparsed result {rel(path)}: {fam.summarise.__name__}"
                              f" failed on it ({type(e).__name__}: {e})") from e
    sections = [f for f in FAMILIES if f.pattern in by_family]
    out = [HEADER]
    for f in sections:
        out += ["", f"## {f.title}", "", f.about]
        for src, rows in by_family[f.pattern]:
            out += ["", f"**`{src.file}`** · {src.cpu} · {src.commit} · {src.date} · {src.command}",
                    ""] + table(rows)
    return "\n".join(out) + "\n"


HEADER = """# Benchmarks

Generated by `python -m benchmarks.report` from `benchmarks/results/`; do not edit by hand
(`python -m benchmarks.report --check` fails when this page is stale). Current figures only: one
result file per benchmark, configuration and host; older ones live in git history.

Each block is one run of one results file (or, where it says so, the runs a file collects): the
file, the CPU (model, vector extensions), the commit (or "recorded at" the commit that last
changed the file, where the file does not record one), the date and the command. Each row gives
the statistic, the physical limit where the file has one, the runs behind it and their spread
(a column is left out where no row of the block has it). A ratio is computed only between two
systems of one run on one host, with the same statistic; "interleaved rounds" means round i of
each system ran back to back, so the per-round ratios give its spread. llama-server measured
with a workaround says so beside the figure.
"""


def table(rows: list[Row]) -> list[str]:
    """Figure and Value always; Limit, Runs and Spread where a row of the block has one."""
    cols = ["figure", "value"] + [c for c in ("limit", "runs", "spread")
                                  if any(getattr(r, c) != "-" for r in rows)]
    lines = ["| " + " | ".join(c.capitalize() for c in cols) + " |", "|---" * len(cols) + "|"]
    return lines + ["| " + " | ".join(cell(getattr(r, c)) for c in cols) + " |" for r in rows]


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 when {PAGE.relative_to(ROOT)} differs from what would be written")
    args = ap.parse_args(argv)
    try:
        page = render()
    except ReportError as e:
        print(f"benchmarks.report: {e}", file=sys.stderr)
        return 2
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `python -m benchmarks.report`",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(page):,} bytes)")
    for path in result_files(RESULTS):
        for pattern, draw in FIGURES.items():
            if fnmatch.fnmatchcase(path.name, pattern):
                draw(load(path), path.with_suffix(".png"))
                print(f"wrote {rel(path.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
