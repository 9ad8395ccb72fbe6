"""Benchmark results: JSON files under benchmarks/results, plain text tables, medians.

Invariants: `write_json` replaces the file atomically (a reader never sees half a result) and
serialises dataclasses and numpy scalars; `median` of nothing is NaN, not an error.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict
from typing import Any, Sequence

from common.paths import RESULTS_DIR

__all__ = ["result_path", "write_json", "median", "format_table"]


def result_path(name: str) -> str:
    """benchmarks/results/<name>, or ``name`` itself when it names a folder (a path such as
    benchmarks/results/x.json or /tmp/x.json): where results named so are read and written."""
    return name if os.path.dirname(name) else os.path.join(RESULTS_DIR, name)


def write_json(name: str, payload: dict[str, Any]) -> str:
    """Write ``payload`` atomically to result_path(name); returns the path."""
    path = result_path(name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)
    return path


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
        if v != v:
            return "nan"
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)
