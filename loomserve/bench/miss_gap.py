"""The gap between the served and the theoretical (infinite-cache) prefix-hit rate, attributed
to the miss causes the server reported (loomserve.kv.miss_causes).

Per request: its uncached tokens are split by cause (they sum to prompt - cached); the
infinite cache would have missed `compulsory` = prompt - theoretical hit of them anyway. Those
are taken first from the causes an infinite cache shares (first_sight, partial_block, diverged,
salt), then from the others; what is left is the request's share of the gap, by cause. Summed
over requests and divided by the prompt tokens, the causes give the gap in points; the
unattributed remainder is the gap minus their sum (requests without causes, hits beyond the
per-session theoretical bound, text-mode token mismatches).
"""

from __future__ import annotations

from typing import Iterable

COMPULSORY_FIRST = ("first_sight", "partial_block", "diverged", "salt")


def request_gap(causes: dict[str, int], compulsory: int) -> dict[str, int]:
    """causes less `compulsory` tokens, taken from COMPULSORY_FIRST first, then any."""
    out = dict(causes)
    need = max(0, compulsory)
    for c in (*COMPULSORY_FIRST, *sorted(k for k in causes if k not in COMPULSORY_FIRST)):
        if need <= 0:
            break
        take = min(out.get(c, 0), need)
        if take:
            out[c] -= take
            need -= take
    return {k: v for k, v in out.items() if v > 0}


def attribute_gap(items: Iterable[tuple[int, int, int, dict | None]]) -> dict:
    """items: per request (prompt tokens, served cached, theoretical cached, miss causes or
    None). Returns hit rates, the gap and its attribution in tokens and points (x100 of the
    prompt tokens)."""
    prompt = cached = theo = 0
    gap_tokens: dict[str, int] = {}
    missing = 0
    for p, c, t, causes in items:
        prompt += p
        cached += c
        theo += min(t, p)
        if causes is None:
            missing += 1
            continue
        for k, v in request_gap(causes, p - min(t, p)).items():
            gap_tokens[k] = gap_tokens.get(k, 0) + v
    if not prompt:
        return {"requests_without_causes": missing}
    served, theoretical = cached / prompt, theo / prompt
    gap = (theoretical - served) * 100
    points = {k: v * 100 / prompt for k, v in sorted(gap_tokens.items(), key=lambda kv: -kv[1])}
    return {"served": served, "theoretical": theoretical, "gap_points": gap,
            "tokens": dict(sorted(gap_tokens.items(), key=lambda kv: -kv[1])),
            "points": points,
            "unattributed_points": round(gap - sum(points.values()), 9),  # float noise off
            "prompt_tokens": prompt, "requests_without_causes": missing}


def format_gap(g: dict, indent: str = "  ") -> list[str]:
    """Lines of the report table (empty when there is nothing to attribute)."""
    if "gap_points" not in g:
        return []
    lines = [f"{indent}hit-rate gap, theoretical - served: {g['gap_points']:.2f} points "
             f"({g['theoretical']:.2%} - {g['served']:.2%}), by cause:"]
    for k, v in g["points"].items():
        lines.append(f"{indent}  {k:<17} {v:6.2f} points  {g['tokens'][k]:>12,} tokens")
    lines.append(f"{indent}  {'unattributed':<17} {g['unattributed_points']:6.2f} points")
    if g.get("requests_without_causes"):
        lines.append(f"{indent}  ({g['requests_without_causes']} requests reported no causes)")
    return lines
