"""The router's share of a request's miss attribution (loomserve.kv.miss_causes).

The instance splits the uncached prompt tokens by what it saw; the router knows what the
instance could not: where the prompt was cached across instances when it chose. From the KV
index at decision time (`RouteView`), it moves tokens to its own causes, taking them from the
instance's in the order of their positions in the prompt (the instance's held-then-lost
blocks come first, the never-held ones after; the router's ranges are nested the same way):
- index_stale: the index said the chosen instance held blocks it no longer had;
- session_moved: the session left its home (overload, lost context, instance down), which held
  more of the prompt than the new instance;
- placed_elsewhere: another instance held a longer prefix than the chosen one.
The sum is unchanged (partial_block is never taken: no instance could have served it).

A disaggregated request's answer comes from its decode leg, which counts the prompt it
imported as cached: its prefill leg's cached tokens and causes (`PrefillLeg`) replace the
decode leg's when the prefill leg found less cached (it computed what was transferred), so
the client sees what its prompt cost, not what the decode instance saved.

Both apply to a JSON answer and to a stream's usage line alike (`rewrite_json`).

Invariant: reattribute() returns counts with the same total as the instance's, each > 0;
the rewritten usage's causes sum to its prompt - cached tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# Instance causes the router's may replace, in the order they are taken: by position, the
# blocks held once (kv.miss_causes: from the hit onwards) before the never-held ones.
_TAKE_ORDER = ("evicted", "evicted_tier", "pin_expired", "preempted", "state_missing",
               "first_sight", "salt", "diverged")
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


@dataclass(frozen=True)
class PrefillLeg:
    """A prefill leg's usage: prompt tokens, cached tokens, and why the rest missed."""

    prompt_tokens: int
    cached: int
    causes: dict[str, int]
    view: RouteView | None = None  # the KV index's view when the prefill instance was chosen


def _usage_of(body) -> dict | None:
    """The usage dict of an answer or stream event (Responses: under response; Anthropic's
    message_start: under message)."""
    if not isinstance(body, dict):
        return None
    for holder in (body, body.get("response"), body.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            return holder["usage"]
    return None


def _causes_of(usage: dict) -> tuple[dict, str] | None:
    """(the dict holding miss_causes, the name of its cached-tokens count): OpenAI chat and
    completions: usage.prompt_tokens_details; Responses: usage.input_tokens_details;
    Anthropic: usage, with cache_read_input_tokens."""
    for holder, key in ((usage.get("prompt_tokens_details"), "cached_tokens"),
                        (usage.get("input_tokens_details"), "cached_tokens"),
                        (usage, "cache_read_input_tokens")):
        if isinstance(holder, dict) and isinstance(holder.get("miss_causes"), dict):
            return holder, key
    return None


def prefill_leg_of(body) -> PrefillLeg | None:
    """The PrefillLeg of a prefill leg's JSON answer (None: no miss causes in it)."""
    usage = _usage_of(body)
    found = _causes_of(usage) if usage is not None else None
    if found is None:
        return None
    holder, key = found
    causes = {k: v for k, v in holder["miss_causes"].items() if isinstance(v, int)}
    cached = holder.get(key, 0)
    return PrefillLeg(cached + sum(causes.values()), cached, causes)


def rewrite_usage(body: dict, view: RouteView | None, block_size: int,
                  prefill: PrefillLeg | None = None) -> dict[str, int] | None:
    """Merge the prefill leg's causes into (see the module doc), then reattribute, the
    miss_causes of a JSON answer or stream event in place. Returns the new causes, None if
    the body has none."""
    usage = _usage_of(body)
    found = _causes_of(usage) if usage is not None else None
    if found is None:
        return None
    holder, key = found
    causes = holder["miss_causes"]
    cached = holder.get(key, 0)
    prompt = cached + sum(causes.values())
    if prefill is not None and prefill.prompt_tokens == prompt and prefill.cached < cached:
        if key == "cache_read_input_tokens":  # Anthropic counts input without cached
            usage["input_tokens"] = usage.get("input_tokens", 0) + cached - prefill.cached
        # the prompt was computed on the prefill instance: judged by the view of that choice
        cached, causes, view = prefill.cached, dict(prefill.causes), prefill.view
        holder[key] = cached
    new = reattribute(causes, prompt, cached, view, block_size) \
        if view is not None else {k: v for k, v in causes.items() if v > 0}
    holder["miss_causes"] = new
    return new


def rewrite_json(data: bytes, view: RouteView | None, block_size: int,
                 prefill: PrefillLeg | None = None) -> tuple[bytes, dict[str, int] | None]:
    """A JSON answer or an SSE data payload with its usage rewritten (rewrite_usage), and the
    causes it now reports; `data` itself when there is nothing to change."""
    if b'"miss_causes"' not in data:
        return data, None
    if view is None and prefill is None:
        return data, find_causes(data)
    try:
        body = json.loads(data)
    except ValueError:
        return data, find_causes(data)
    causes = rewrite_usage(body, view, block_size, prefill)
    if causes is None:
        return data, find_causes(data)
    return json.dumps(body, separators=(",", ":")).encode(), causes


def rewrite_sse(block: bytes, view: RouteView | None, block_size: int,
                prefill: PrefillLeg | None = None) -> tuple[bytes, list[dict[str, int]]]:
    """Whole SSE lines with each data line's usage rewritten (rewrite_json); the causes of
    the lines that had some."""
    if b'"miss_causes"' not in block:
        return block, []
    lines = block.split(b"\n")
    found = []
    for i, line in enumerate(lines):
        if line.startswith(b"data:") and b'"miss_causes"' in line:
            cr = b"\r" if line.endswith(b"\r") else b""
            payload, causes = rewrite_json(line[5:].strip(), view, block_size, prefill)
            lines[i] = b"data: " + payload + cr
            if causes is not None:
                found.append(causes)
    return b"\n".join(lines), found
