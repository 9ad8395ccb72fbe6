"""Where a session's prompt stopped extending its previous one (the `diverged` miss cause,
seen from the text side: the front end owns the text, the core the token ids).

An agent's next turn should be its previous prompt plus the reply and new messages; when an
earlier message was edited, a system reminder moved, history was compacted or the template
renders the same messages differently, the prompt diverges and every token after that point
misses the cache. `find_divergence` locates the first difference: the message index, the byte
offset in the rendered text, and a short excerpt of both sides. `SessionPrompts` keeps each
session's latest prompt (bounded) for live traffic; `scan` runs over a recorded sequence of
requests (messages per turn). Design: docs/design/miss-causes.md.

Invariant: a turn whose messages and rendered text extend the previous turn's is never
reported.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import asdict, dataclass

EXCERPT = 40  # characters of each side shown around the first difference


@dataclass(frozen=True)
class Divergence:
    """kind: "edited" (an earlier message changed), "removed" (fewer messages than before:
    compaction or truncation), "template" (the messages extend the previous ones but the
    rendered text does not), "text" (only the texts were compared: live traffic). message_index: the first message that differs (for "template",
    the one whose rendering holds the first differing byte; -1 when unknown). byte_offset: of
    the first difference in the rendered text (UTF-8; -1 without text), else in the message's
    canonical JSON."""

    kind: str
    message_index: int
    byte_offset: int
    previous: str
    current: str

    def as_dict(self) -> dict:
        return asdict(self)


def first_difference(a: str, b: str) -> int:
    """Index of the first differing character (len of the shorter when one is a prefix)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# Request metadata inside messages that no template renders: Anthropic's cache breakpoints,
# which Claude Code moves to the newest message every request (a moved marker is no edit).
# Compared without them, a message's byte offsets are of its canonical JSON less these fields.
UNRENDERED = frozenset({"cache_control"})


def _rendered_part(value):
    """value without UNRENDERED fields; a content list of one text block as its text (both
    render the same, and Claude Code resends a block list as a string)."""
    if isinstance(value, dict):
        out = {k: _rendered_part(v) for k, v in value.items() if k not in UNRENDERED}
        content = out.get("content")
        if (isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict)
                and content[0].keys() == {"type", "text"} and content[0]["type"] == "text"):
            out["content"] = content[0]["text"]
        return out
    if isinstance(value, list):
        return [_rendered_part(v) for v in value]
    return value


def _canon(message) -> str:
    """The message's canonical JSON, without the fields no template renders."""
    return json.dumps(_rendered_part(message), sort_keys=True, ensure_ascii=False,
                      separators=(",", ":"))


def _excerpts(a: str, b: str, i: int) -> tuple[str, str]:
    lo = max(0, i - EXCERPT // 4)
    return a[lo:i + EXCERPT], b[lo:i + EXCERPT]


def _utf8_offset(s: str, i: int) -> int:
    return len(s[:i].encode())


def _message_at(messages: list, text: str, pos: int) -> int:
    """The first message whose rendering ends after text position pos: its content (found in
    order in the rendered text) ends past pos, so the difference is in it or its header; -1
    when no content is found that far."""
    at = 0
    for k, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, str) or not content:
            continue
        j = text.find(content, at)
        if j < 0:
            return -1
        at = j + len(content)
        if pos < at:
            return k
    return -1


def find_divergence(prev_messages: list | None, prev_text: str | None, messages: list | None,
                    text: str | None) -> Divergence | None:
    """The first place where this turn stops extending the previous one; None if it extends
    it (messages: prefix; text: the previous text is a prefix of this one)."""
    if prev_messages is not None and messages is not None:
        for k, old in enumerate(prev_messages):
            if k >= len(messages):
                a = _canon(old)
                return Divergence("removed", k, _text_offset(prev_text, text), a[:EXCERPT], "")
            a, b = _canon(old), _canon(messages[k])
            if a != b:
                if prev_text is not None and text is not None:
                    i = first_difference(prev_text, text)
                    pa, pb = _excerpts(prev_text, text, i)
                    return Divergence("edited", k, _utf8_offset(text, i), pa, pb)
                i = first_difference(a, b)
                pa, pb = _excerpts(a, b, i)
                return Divergence("edited", k, _utf8_offset(b, i), pa, pb)
    if prev_text is not None and text is not None and not text.startswith(prev_text):
        i = first_difference(prev_text, text)
        pa, pb = _excerpts(prev_text, text, i)
        if messages is None:  # text alone: the cause (edit or template) is unknown
            return Divergence("text", -1, _utf8_offset(text, i), pa, pb)
        return Divergence("template", _message_at(messages, text, i), _utf8_offset(text, i),
                          pa, pb)
    return None


def _text_offset(a: str | None, b: str | None) -> int:
    if a is None or b is None:
        return -1
    return _utf8_offset(b, first_difference(a, b))


class SessionPrompts:
    """session id -> its latest (messages, rendered text), LRU-bounded by sessions and by the
    characters held."""

    def __init__(self, max_sessions: int = 1024, max_chars: int = 64 << 20) -> None:
        self.max_sessions = max_sessions
        self.max_chars = max_chars
        self._chars = 0
        self._d: OrderedDict[str, tuple[list | None, str | None]] = OrderedDict()

    def observe(self, session_id: str | None, messages: list | None, text: str | None
                ) -> Divergence | None:
        """Compare with the session's previous prompt, then remember this one."""
        if session_id is None:
            return None
        prev = self._d.pop(session_id, None)
        div = None
        if prev is not None:
            self._chars -= len(prev[1] or "")
            div = find_divergence(prev[0], prev[1], messages, text)
        self._d[session_id] = (messages, text)
        self._chars += len(text or "")
        while len(self._d) > self.max_sessions or (self._chars > self.max_chars
                                                    and len(self._d) > 1):
            _, (_, t) = self._d.popitem(last=False)
            self._chars -= len(t or "")
        return div


def scan(turns: list[dict]) -> list[tuple[int, Divergence]]:
    """A recorded request sequence: per turn {"session": id, "messages": [...], optionally
    "text": rendered prompt}; returns (turn index, divergence) for each turn that diverged."""
    sp = SessionPrompts()
    out = []
    for i, t in enumerate(turns):
        d = sp.observe(t.get("session", ""), t.get("messages"), t.get("text"))
        if d is not None:
            out.append((i, d))
    return out
