"""The prompt's tail block in a prefill/decode handover.

Full blocks travel as prefix-cache pages keyed by their hashes. The block holding the prompt's
last tokens (1 to block_size of them: a partial block, or the last full one, which no hit may
cover since the last token must be computed for its logits) has no key a hit could use, so
without it the decode instance recomputes up to a block of tokens over the whole context, in
one step with its running decodes: the stall its warm streams feel. With it, the prefill side
stages that block's page per group beside the others; the decode side reads it while the
request waits, copies it into the fresh block its admission allocates, and computes only the
prompt's last token (as vLLM's decode side does).

Invariants:
- A tail is copied only into a block the request has just been given (never a cached one, and
  before any step runs on it), only when its hit ends exactly where the tail starts, its prompt
  from there equals the tail's tokens, and every page passed its checksum; otherwise the tail's
  tokens are computed, as without a tail.
- Models with state groups send no tail (their state at the last token is not checkpointed).
- A host slot a read may still write into is reused only after that read has ended.
- A request waits for its tail's read at most max_wait_s past the fetch, then computes it.
"""

from __future__ import annotations

import threading
import time

import torch

from loomserve.kv.tiers import codec
from loomserve.kv.transfer.params import TailPages

TAIL_SLOTS = 16  # decode legs whose tails can be read ahead at once (a slot = a page per group)


def tail_rows(kv, req) -> tuple[int, list[int], list[int]] | None:
    """Prefill side, before req's blocks are freed: (start position, the prompt's tokens from
    there, the tail block's row per group), or None (state groups, or a group without it)."""
    if kv.has_state_groups:
        return None
    bs = kv.block_size
    n = req.num_prompt_tokens
    t = (n - 1) // bs
    ids = kv.coordinator.block_ids(req.request_id)
    if n < 1 or ids is None or any(len(g) <= t or g[t] < 0 for g in ids):
        return None
    return t * bs, list(req.all_token_ids[t * bs:n]), [g[t] for g in ids]


class TailReads:
    """Decode side: each decode leg's tail pages, read ahead into a registered host buffer."""

    def __init__(self, peer, num_groups: int, page_bytes: int, slots: int = TAIL_SLOTS,
                 max_wait_s: float = 1.0) -> None:
        self.peer = peer  # the PeerTier: its reader threads and transfer backend
        self.num_groups = num_groups
        self.page_bytes = page_bytes
        self.slots = slots
        self.max_wait_s = max_wait_s
        self._buf: torch.Tensor | None = None  # [slots, groups, page_bytes], registered once
        self._free = list(range(slots))
        # rid -> (tail, slot, future, wait deadline)
        self._pending: dict[str, tuple[TailPages, int, object, float]] = {}
        self._ready: dict[str, tuple[TailPages, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.counters = {"tails_read": 0, "tails_bad": 0, "tails_late": 0, "tail_no_slot": 0}

    def fetch(self, request_id: str, remote: str, tail: TailPages) -> None:
        """Start reading tail's pages from remote (engine thread); no free slot: no tail."""
        with self._lock:
            if not self._free:
                self.counters["tail_no_slot"] += 1
                return
            slot = self._free.pop()
        try:
            if self._buf is None:
                buf = torch.empty((self.slots, self.num_groups, self.page_bytes),
                                  dtype=torch.uint8)
                self.peer.transfer.register(buf)
                self._buf = buf
            base = self._buf[slot].data_ptr()
            ops = [(a, base + g * self.page_bytes, self.page_bytes)
                   for g, a in enumerate(tail.addrs)]
            fut = self.peer.submit_read(remote, ops)
        except Exception:  # no backend here: the tail is computed
            self._release(slot)
            return
        self._pending[request_id] = (tail, slot, fut, time.monotonic() + self.max_wait_s)
        self.counters["tails_read"] += 1

    def holding(self) -> bool:
        """Some decode leg's tail is being read or waits for its admission."""
        return bool(self._pending or self._ready)

    def waiting(self, request_id: str) -> bool:
        """The request's tail is still being read, within max_wait_s of the fetch (the
        scheduler holds it back meanwhile); past that the tail is dropped (computed)."""
        entry = self._pending.get(request_id)
        if entry is None or entry[2].done():
            return False
        if time.monotonic() < entry[3]:
            return True
        self.counters["tails_late"] += 1
        self.drop(request_id)
        return False

    def get(self, request_id: str) -> tuple[TailPages, torch.Tensor] | None:
        """The tail and a copy of its pages [groups, page_bytes] once its read has finished and
        every checksum passed (kept until drop); None while it reads, or if it failed."""
        got = self._ready.get(request_id)
        if got is not None:
            return got
        entry = self._pending.get(request_id)
        if entry is None or not entry[2].done():
            return None
        del self._pending[request_id]
        tail, slot, fut, _ = entry
        pages = self._buf[slot].clone()
        self._release(slot)
        if fut.cancelled() or fut.exception() is not None or any(
                codec.checksum(pages[g].numpy()) != c for g, c in enumerate(tail.checksums)):
            self.counters["tails_bad"] += 1
            return None
        self._ready[request_id] = (tail, pages)
        return tail, pages

    def drop(self, request_id: str) -> None:
        """The request is admitted or gone: forget its tail (a read in flight frees its slot
        when it ends)."""
        self._ready.pop(request_id, None)
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            entry[2].add_done_callback(lambda _f: self._release(entry[1]))

    def _release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


def usable(tail: TailPages, req, num_hit: int) -> bool:
    """The tail continues req's hit exactly and holds req's own prompt tokens."""
    end = tail.start + len(tail.tokens)
    return (req.num_computed_tokens == 0 and num_hit == tail.start
            and req.num_tokens == end and list(req.all_token_ids[tail.start:end]) == tail.tokens)
