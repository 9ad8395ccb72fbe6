"""The synthesizer's check: measured statistics of generated traces against a profile's targets.

`compare` gives one row per target figure of the profile (statistic key, target, measured,
ratio, source of the target); `format_compare` prints them as a table. Keys are paths into the
statistics of `loomserve bench stats` ("a.b"), plus "requests_per_session".

Invariant: the ratio is None when either the measured value or the target is missing or zero.
"""

from __future__ import annotations

from loomserve.bench.synth.profiles import SynthProfile

__all__ = ["compare", "format_compare"]


def _get(st: dict, key: str):
    if key == "requests_per_session":
        return st["requests"]["total"] / st["sessions"] if st["sessions"] else None
    v = st
    for part in key.split("."):
        v = v[part]
    return v


def compare(prof: SynthProfile, st: dict) -> list[dict]:
    """Rows {key, target, measured, ratio, source} for the profile's targets."""
    rows = []
    for key, (target, note) in prof.targets.items():
        m = _get(st, key)
        rows.append({"key": key, "target": target, "measured": m,
                     "ratio": (m / target) if (m is not None and target) else None,
                     "source": note})
    return rows


def format_compare(rows: list[dict]) -> str:
    def f(v):
        if v is None:
            return "-"
        if isinstance(v, float) and abs(v) < 10:
            return f"{v:.3f}"
        return f"{v:,.0f}"
    lines = [f"{'statistic':42}{'target':>12}{'measured':>12}{'ratio':>8}"]
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"{r['key']:42}{f(r['target']):>12}{f(r['measured']):>12}{ratio:>8}"
                     f"  {r['source']}")
    return "\n".join(lines)
