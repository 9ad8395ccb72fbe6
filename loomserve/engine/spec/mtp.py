"""MTP drafts on the core's side (`"method": "mtp"`): proposes what the execution plane drafted.

The model's own multi-token-prediction modules draft in the runner after each step, from the
step's hidden states (loomserve.execution.spec_mtp); the step's ModelOutput carries them as
(the request's token count they follow, ids). `receive` keeps the latest per request and
`propose` returns them while the request still has that many tokens, so drafts made for a state
the request has left (a preemption, a step whose output came later) are never proposed. The
SpecDecoder then cuts and verifies them as any drafter's.
"""

from __future__ import annotations

from loomserve.engine.spec.drafter import Drafter, DraftRequest


class MtpDrafter(Drafter):
    name = "mtp"

    def __init__(self) -> None:
        self._drafts: dict[str, tuple[int, list[int]]] = {}

    def receive(self, drafts: dict[str, tuple[int, list[int]]]) -> None:
        self._drafts.update(drafts)

    def propose(self, req: DraftRequest, max_tokens: int) -> list[int]:
        got = self._drafts.get(req.request_id)
        if got is None or got[0] != len(req.tokens):
            return []
        return list(got[1][:max_tokens])

    def on_finished(self, req: DraftRequest) -> None:
        self._drafts.pop(req.request_id, None)
