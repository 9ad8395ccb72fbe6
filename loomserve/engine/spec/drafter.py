"""The drafter contract: what a speculative-decoding method sees and returns.

A drafter runs in the engine core on token ids only. Each step, for each running decode request
the scheduler chose to speculate on, it proposes up to `max_tokens` ids continuing the request's
tokens (prompt + output so far); the target model then verifies them in one step
(loomserve.engine.spec.verify). Proposing nothing is always allowed and costs nothing.

Lifecycle calls let a drafter keep state across requests (the suffix drafter's per-session
trees): `on_finished` when a request ends (any status), `drop_session` when the engine drops a
session's retained KV (DELETE /v1/sessions/{id}, pin TTL or budget), so drafts live exactly as
long as the session's cache does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass
class DraftRequest:
    """One request as a drafter sees it. `tokens` = prompt then output so far (a live view)."""

    request_id: str
    session_id: str | None
    tokens: Sequence[int]
    num_prompt_tokens: int


class Drafter:
    """Base: proposes nothing. Subclasses override `propose` and, if they keep state, the hooks."""

    name = "none"

    def propose(self, req: DraftRequest, max_tokens: int) -> list[int]:
        """Up to max_tokens draft ids that would follow req.tokens; [] when nothing matches."""
        return []

    def receive(self, drafts: dict[str, tuple[int, list[int]]]) -> None:
        """Drafts the execution plane made after a step (MTP: engine/spec/mtp.py), per request
        (its token count they follow, ids); drafters of their own ignore them."""

    def on_finished(self, req: DraftRequest) -> None:
        """The request ended; its prompt and output may feed later drafts."""

    def drop_session(self, session_id: str) -> None:
        """The session's retained KV is gone: forget what was kept for it."""
