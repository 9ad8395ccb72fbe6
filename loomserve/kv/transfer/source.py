"""The prefill side: a finished prefill leg's pages are copied into a registered staging arena
and described in kv_transfer_params for the decode instance to pull.

Staging copies (rather than holding the pool's blocks until pulled) so the pool is free at once
and the arena is host memory the transfer backend can register whatever device the pool is on.
The pages staged are those a prefix hit of the prompt's last full boundary reads on the decode
side (every group: attention blocks, the sliding window's blocks, the state checkpoint at that
boundary), for the largest boundary b <= (prompt tokens - 1) // block_size at which every group
has its pages cached, which is what the decode side's own admission can hit; and, right after
it, the block holding the prompt's last tokens (the tail, tail.py), when every group has it.

Invariants:
- Staged slots are reused only after the decode side's release notice or the expiry; the
  decode side checks each page's checksum anyway, so a late read of a reused slot is a
  recompute, never a wrong answer.
- No room in the arena (or no pages): params are None and the decode side computes.
"""

from __future__ import annotations

import logging
import time
import uuid

import torch

from loomserve.kv.tiers import codec
from loomserve.kv.transfer.params import GroupPages, TailPages, TransferParams

log = logging.getLogger(__name__)

ARENA_BYTES = 1 << 30  # default staging arena ceiling (--kv-transfer-buffer); at most the pool's size
GRACE_S = 2.0  # an expired transfer's slots wait this much longer (a read may be finishing)


class StagingArena:
    """A registered host buffer of page slots with a free list."""

    def __init__(self, num_pages: int, page_bytes: int) -> None:
        self.page_bytes = page_bytes
        self.buffer = torch.empty((num_pages, page_bytes), dtype=torch.uint8)
        self.base = self.buffer.data_ptr()
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = self._free[-n:][::-1]
        del self._free[-n:]
        return out

    def free(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))  # LIFO: the next alloc takes these, in order

    def addr(self, slot: int) -> int:
        return self.base + slot * self.page_bytes


class TransferSource:
    """Stages finished prefill legs (`stage`) and frees them on notice or expiry (`poll`)."""

    def __init__(self, kv, kv_buffer: torch.Tensor, transfer, keyspaces: list, backend: str,
                 timeout_s: float, arena_bytes: int = ARENA_BYTES) -> None:
        self.kv = kv
        self.kv_buffer = kv_buffer
        self.transfer = transfer
        self.keyspaces = keyspaces
        self.backend = backend
        self.timeout_s = timeout_s
        page_bytes = kv.config.page_bytes
        pages = max(1, min(kv.num_blocks, arena_bytes // page_bytes))
        self.arena = StagingArena(pages, page_bytes)
        transfer.register(self.arena.buffer)
        self.staged: dict[str, tuple[list[int], float]] = {}  # id -> (slots, reuse after)
        self.counters = {"staged": 0, "staged_pages": 0, "staged_tails": 0, "no_room": 0, "released": 0,
                         "expired": 0}

    def _boundary(self, req) -> tuple[int, list[list]]:
        """The largest boundary b whose pages every group has cached, and those blocks per
        group; (0, []) when there is none."""
        kv = self.kv
        hashes = req.block_hashes
        cap = min((req.num_prompt_tokens - 1) // kv.block_size, len(hashes))
        groups = range(len(self.keyspaces))
        for b in range(cap, 0, -1):
            # every group reads its page at b - 1: a cheap filter before the whole ranges
            if any(kv.cached_blocks(g, hashes[b - 1:b])[0] is None for g in groups):
                continue
            ranges = kv.hit_positions(b)
            blocks = [kv.cached_blocks(g, hashes[r.start:r.stop]) for g, r in enumerate(ranges)]
            if all(blk is not None for bs in blocks for blk in bs):
                return b, blocks
        return 0, []

    def stage(self, req, tail=None) -> dict | None:
        """After req (a prefill leg) was freed: copy its pages into the arena; its params, or
        None (nothing cached, or no room). tail: tail.tail_rows(), read before the free (its
        rows are untouched until the next allocation); staged when it follows the boundary."""
        b, blocks = self._boundary(req)
        if b == 0:
            return None
        if tail is not None and tail[0] != b * self.kv.block_size:
            tail = None  # the decode side's hit would not reach it
        ranges = self.kv.hit_positions(b)
        rows = [blk.block_id for bs in blocks for blk in bs]
        slots = self.arena.alloc(len(rows) + (len(tail[2]) if tail else 0))
        if slots is None and tail is not None:  # no room for the tail: the full blocks alone
            tail, slots = None, self.arena.alloc(len(rows))
        rows += tail[2] if tail else []
        if slots is None:
            self.counters["no_room"] += 1
            return None
        src = self.kv_buffer[torch.tensor(rows, dtype=torch.long, device=self.kv_buffer.device)]
        arena = self.arena.buffer
        arena[torch.tensor(slots, dtype=torch.long)] = src.cpu().view(len(rows), -1)
        sums = [codec.checksum(arena[s].numpy()) for s in slots]
        groups, i = [], 0
        for g, r in enumerate(ranges):
            n = len(r)
            groups.append(GroupPages(self.keyspaces[g].fingerprint, r.start,
                                     [self.arena.addr(s) for s in slots[i:i + n]], sums[i:i + n]))
            i += n
        tail_pages = None if tail is None else TailPages(
            tail[0], tail[1], [self.arena.addr(s) for s in slots[i:]], sums[i:])
        lo = min(r.start for r in ranges)
        tid = uuid.uuid4().hex
        expires = time.time() + self.timeout_s
        self.staged[tid] = (slots, time.monotonic() + self.timeout_s + GRACE_S)
        self.counters["staged"] += 1
        self.counters["staged_pages"] += len(slots)
        self.counters["staged_tails"] += tail is not None
        params = TransferParams(self.transfer.session_id, self.backend,
                                self.transfer.notify_address, tid, expires,
                                self.arena.page_bytes, b * self.kv.block_size, lo,
                                list(req.block_hashes[lo:b]), groups, tail_pages)
        return params.to_json()

    def poll(self) -> None:
        """Free the slots of pulled transfers (release notices) and of expired ones."""
        for msg in self.transfer.take_notifies():
            entry = self.staged.pop(msg.decode(errors="replace"), None)
            if entry is not None:
                self.arena.free(entry[0])
                self.counters["released"] += 1
        if not self.staged:
            return
        now = time.monotonic()
        for tid in [t for t, (_, due) in self.staged.items() if due <= now]:
            self.arena.free(self.staged.pop(tid)[0])
            self.counters["expired"] += 1
