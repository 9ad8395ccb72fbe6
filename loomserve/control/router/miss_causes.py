"""The router's share of a request's miss attribution (loomserve.kv.miss_causes).

The instance splits the uncached prompt tokens by what it saw; the router knows what the
instance could not: where the prompt was cached across instances when it chose. From the KV
index at decision time (`RouteView`), it moves tokens to its own causes, taking them from the
instance's in a fixed order (first_sight first: "never seen" there is often "held elsewhere"):
- index_stale: the index said the chosen instance held blocks it no longer had;
- session_moved: the session left its home (overload, lost context, instance down), which held
  more of the prompt than the new instance;
- placed_elsewhere: another instance held a longer prefix than the chosen one.
The sum is unchanged (partial_block is never taken: no instance could have served it).

Invariant: reattribute() returns counts with the same total as the instance's, each > 0.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# Instance causes the router's may replace, in the order they are taken.
_TAKE_ORDER = ("first_sight", "evicted", "evicted_tier", "pin_expired", "preempted",
               "state_missing", "diverged", "salt")
_MISS_RE = re.compile(rb'"miss_causes"\s*:\s*(\{[^{}]*\})')


@dataclass(frozen=True)
class RouteView:
    """At decision time, in blocks of the prompt's hash chain: on the chosen instance (what
    the index predicted), the best on any other, and on the home a moved session left (-1:
    not moved)."""

    chosen: int
    best_other: int
    home: int = -1


def view_of(index, hashes, chosen: str, moved_from: str | None) -> RouteView:
    overlaps = index.overlaps(hashes)
    others = [v for k, v in overlaps.items() if k != chosen]
    return RouteView(overlaps.get(chosen, 0), max(others, default=0),
                     overlaps.get(moved_from, 0) if moved_from is not None else -1)


def reattribute(causes: dict[str, int], prompt_tokens: int, cached: int, view: RouteView,
                block_size: int) -> dict[str, int]:
    """The instance's causes with the router's moved in (see the module doc)."""
    cap = prompt_tokens - causes.get("partial_block", 0)  # the hittable tokens
    predicted = min(view.chosen * block_size, cap)
    home = min(view.home * block_size, cap) if view.home >= 0 else 0
    other = min(view.best_other * block_size, cap)
    want = {"index_stale": predicted - cached,
            "session_moved": home - max(cached, predicted),
            "placed_elsewhere": other - max(cached, predicted, home)}
    out = dict(causes)
    for cause, n in want.items():
        for src in _TAKE_ORDER:
            if n <= 0:
                break
            have = out.get(src, 0)
            take = min(have, n)
            if take:
                out[src] = have - take
                out[cause] = out.get(cause, 0) + take
                n -= take
    return {k: v for k, v in out.items() if v > 0}


def find_causes(data: bytes) -> dict[str, int] | None:
    """The usage extension's miss_causes in a response body or SSE chunk (None: absent)."""
    m = _MISS_RE.search(data)
    if m is None:
        return None
    try:
        causes = json.loads(m.group(1))
    except ValueError:
        return None
    return causes if isinstance(causes, dict) else None


def rewrite_usage(body: dict, view: RouteView, block_size: int) -> dict[str, int] | None:
    """Reattribute the miss_causes of a JSON response body in place (OpenAI chat and
    completions: usage.prompt_tokens_details; Responses: usage.input_tokens_details;
    Anthropic: usage). Returns the new causes, None if the body has none."""
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None
    for holder in (usage.get("prompt_tokens_details"), usage.get("input_tokens_details"),
                   usage):
        if isinstance(holder, dict) and isinstance(holder.get("miss_causes"), dict):
            causes = holder["miss_causes"]
            cached = holder.get("cached_tokens", usage.get("cache_read_input_tokens", 0))
            total = sum(causes.values())
            new = reattribute(causes, cached + total, cached, view, block_size)
            holder["miss_causes"] = new
            return new
    return None
