"""Per-request block tables as int32 arrays, grown incrementally.

The scheduler hands the runner each request's block-id lists every step (ScheduledSeq.block_ids).
Those lists only grow and keep their identity for the request's lifetime (the KV managers'
invariant); a preempted or finished request gets new lists. So the runner copies only the
ids appended since the last step into a per-(request, group) int32 array, O(new blocks) per
step instead of O(context): a decode at 128K context appends one id every block_size tokens.

Sliding-window groups overwrite ids before the window with the null block in place; the copy
keeps the old ids there, which is harmless because attention never reads before the window.
"""

from __future__ import annotations

import numpy as np


class _Row:
    __slots__ = ("source", "array", "filled")

    def __init__(self, source: list[int]) -> None:
        self.source = source  # the scheduler's list itself: compared by identity, kept alive
        self.array = np.empty(max(16, 2 * len(source)), dtype=np.int32)
        self.filled = 0


class BlockTables:
    """(request id, group) -> the request's block table as an int32 array."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[int, _Row]] = {}  # request id -> group -> row

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, request_id: str, group: int, ids: list[int]) -> np.ndarray:
        """The table for `ids` (the scheduler's list), as an int32 view of len(ids)."""
        rows = self._rows.get(request_id)
        if rows is None:
            rows = self._rows[request_id] = {}
        row = rows.get(group)
        if row is None or row.source is not ids or len(ids) < row.filled:
            row = rows[group] = _Row(ids)
        n = len(ids)
        if n > row.filled:
            if n > row.array.shape[0]:
                grown = np.empty(2 * n, dtype=np.int32)
                grown[:row.filled] = row.array[:row.filled]
                row.array = grown
            row.array[row.filled:n] = ids[row.filled:n]
            row.filled = n
        return row.array[:n]

    def drop(self, request_ids) -> None:
        """Forget finished requests (their lists may be garbage now)."""
        for rid in request_ids:
            self._rows.pop(rid, None)

    def keep_only(self, request_ids: set[str]) -> None:
        """Forget every request not in request_ids (a bound on rows left by aborts)."""
        for rid in [r for r in self._rows if r not in request_ids]:
            del self._rows[rid]


def tables_from_lists(lists: list[list[int]]) -> list[np.ndarray]:
    """One-off tables (tests, tools): int32 arrays of plain lists."""
    return [np.asarray(t, dtype=np.int32) for t in lists]
