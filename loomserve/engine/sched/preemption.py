"""Which running request to preempt when one cannot get KV blocks: the cheapest to recompute.

Preemption is by recompute: the victim frees its blocks and later prefills again, hitting
whatever of its prefix is still cached. Its full hashed blocks go back to the free queue still
hashed, tail first, so the allocation that needed room evicts about `deficit` of them (the
pool's other free blocks are evicted first, then the victim's tail); the rest stay hittable.
So the victim's recompute is the tail it loses plus its unhashed part, costed by the step cost
model (loomserve.engine.sched.step_cost) or, without one, in tokens.

Choice, over the candidates (running requests not yet given blocks this step):
1. lowest priority first (highest `priority` number, as vLLM);
2. never a pinned session's request (its session's last turn, which the pin protects) while
   the unprotected candidates can free enough between them;
3. among those whose blocks alone cover the deficit, the cheapest recompute; else the one that
   frees the most blocks (fewer preemptions);
4. ties: the most recently admitted (the order before this module).
The requester itself is the victim only when there is no candidate.
"""

from __future__ import annotations

from typing import Callable, Sequence

from loomserve.engine.sched.step_cost import StepFeatures


def held_blocks(kv, request_id: str) -> int:
    """Blocks the request holds (the largest group: attention groups grow with tokens)."""
    return max((len(ids) for ids in kv.get_block_ids(request_id)), default=0)


def recompute_tokens(kv, req, deficit: int) -> tuple[int, int]:
    """(tokens kept hittable, tokens to recompute) if req is preempted to free `deficit`
    blocks: its hittable prefix minus the tail the allocation is expected to evict."""
    bs = kv.block_size
    held = held_blocks(kv, req.request_id)
    hit = getattr(kv, "hit_boundary", None)
    boundary = (hit(req.request_id) or 0) if hit is not None else 0
    kept = max(0, min(boundary, held - max(0, deficit))) * bs
    kept = min(kept, req.num_computed_tokens)
    return kept, req.num_computed_tokens - kept


def choose_victim(requester, candidates: Sequence, kv, deficit: int,
                  cost: Callable[[int, int], float] | None = None,
                  protected: Callable | None = None):
    """The request to preempt so that `requester` gets `deficit` more blocks (see the module
    doc). cost(context, new_tokens) -> seconds; None: the token count. candidates in
    admission order; the requester when there are none."""
    if not candidates:
        return requester
    info = []
    for pos, r in enumerate(candidates):
        kept, redo = recompute_tokens(kv, r, deficit)
        c = float(redo) if cost is None else cost(kept, redo)
        prot = bool(protected is not None and protected(r))
        info.append((r, held_blocks(kv, r.request_id), c, prot, pos))
    free_unprotected = sum(h for _, h, _, p, _ in info if not p)
    spare_protected = free_unprotected >= deficit

    def key(item):
        r, held, c, prot, pos = item
        suffices = held >= deficit
        return (-getattr(r, "priority", 0), prot and spare_protected, not suffices,
                c if suffices else -held, -pos)

    return min(info, key=key)[0]


def victim_for(requester, num_new: int, running: Sequence, done: set[str], kv,
               cost_model=None, layout=None):
    """choose_victim for `requester` needing blocks for `num_new` more tokens, among the
    running requests not given blocks this step (ids in `done`), costs from the step cost
    model (token counts without one), a session holding a KV pin protected."""
    bs = kv.block_size
    need = -(-(requester.num_computed_tokens + num_new) // bs) - held_blocks(
        kv, requester.request_id)
    deficit = max(1, need - getattr(kv, "num_free_blocks", 0))
    candidates = [r for r in running if r is not requester and r.request_id not in done]
    cost = None
    if cost_model is not None:
        cost = lambda ctx, new: cost_model.predict(  # noqa: E731
            StepFeatures(layout).chunk(ctx, new))
    pins = getattr(kv, "pins", None)
    protected = lambda r: (pins is not None and r.session_id is not None  # noqa: E731
                           and bool(pins.blocks(r.session_id)))
    return choose_victim(requester, candidates, kv, deficit, cost, protected)
