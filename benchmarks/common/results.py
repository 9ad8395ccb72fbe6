"""Benchmark results: JSON files under benchmarks/results, plain text tables, medians.

Every result file starts with an envelope (`envelope`): the machine (`host_info`), the commit
("-dirty" when tracked files differ from it), the UTC date, the command line and the run (this
process: its start time and pid), so `python -m benchmarks.report` can trace each figure and
tell runs apart without a per-benchmark rule.

Invariants: `write_json` replaces the file atomically (a reader never sees half a result),
stamps a fresh envelope on every write (a stored one is replaced: it describes the last write)
and serialises dataclasses and numpy scalars; `median` of nothing is NaN, not an error.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

from common.host import host_info
from common.paths import REPO_ROOT, RESULTS_DIR

__all__ = ["envelope", "format_table", "median", "result_path", "write_json"]

_STARTED = datetime.now(timezone.utc)
RUN_ID = f"{_STARTED.isoformat(timespec='seconds')}/{os.getpid()}"  # this process's run


def result_path(name: str) -> str:
    """benchmarks/results/<name>, or ``name`` itself when it names a folder (a path such as
    benchmarks/results/x.json or /tmp/x.json): where results named so are read and written."""
    return name if os.path.dirname(name) else os.path.join(RESULTS_DIR, name)


def write_json(name: str, payload: dict[str, Any]) -> str:
    """Write ``payload`` under a fresh envelope, atomically, to result_path(name); returns the
    path."""
    path = result_path(name)
    doc = {"envelope": envelope(), **{k: v for k, v in payload.items() if k != "envelope"}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)
    return path


def envelope() -> dict[str, Any]:
    """What every new result carries: host, commit, date (UTC, ISO 8601), command, run."""
    return {"host": host_info(), "commit": git_commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(sys.argv), "run": RUN_ID}


def git_commit() -> str:
    """HEAD's short hash, "-dirty" when tracked files differ from it; "unknown" without git.
    Result files do not count: a run rewriting its own file (a resumed store, a rerun) has not
    changed the code that made it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", REPO_ROOT, *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                    ":(exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def command_line(argv: Sequence[str]) -> str:
    """The command as typed from the repository root: `python benchmarks/x.py ARGS`."""
    argv = list(argv)
    if argv and argv[0].endswith(".py"):
        script = os.path.relpath(os.path.abspath(argv[0]), REPO_ROOT)
        argv = ["python", argv[0] if script.startswith("..") else script, *argv[1:]]
    return shlex.join(argv)


def _json_default(o: Any) -> Any:
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o)}")


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width text table (numbers right-aligned)."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
           "  ".join("-" * w for w in widths)]
    for r, raw in zip(cells, rows):
        out.append("  ".join(c.rjust(w) if isinstance(v, (int, float)) else c.ljust(w)
                             for c, w, v in zip(r, widths, raw)))
    return "\n".join(out)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)
