"""The bounded in-memory store behind `previous_response_id` and GET/DELETE /v1/responses/{id}.

Invariants: at most `max_size` entries, and the text the entries added (their `size`) sums to
at most `max_chars`: the least recently used go first; an entry older than `ttl_s` is never
returned and is dropped when seen; one event loop owns the store, so no locking. Each entry
keeps the whole conversation as Responses items (the inputs of every turn of its chain, then
its own output), so a follow-up sends only its new items. Entries of one chain share the item
dicts: a turn adds a list of references, and only its own new items count towards its size
(a stateless client that re-sends its history is charged for all of it). Nothing survives a
restart.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_SIZE = 1024
DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_CHARS = 256 * 1024 * 1024  # of JSON text: a few hundred MB of Python strings


@dataclass
class StoredResponse:
    response: dict  # the response object as the client received it
    items: list[dict]  # the conversation: every input item of the chain, then every output item
    session_id: str | None = None  # the chain's prompt_cache_key, inherited by follow-ups
    new_from: int = 0  # items[new_from:] are this turn's own (the rest its chain's, shared)
    size: int = 0  # set by put(): JSON characters of this turn's own items
    created: float = 0.0  # set by put(): the store's clock


class ResponseStore:
    def __init__(self, max_size: int = DEFAULT_MAX_SIZE, ttl_s: float = DEFAULT_TTL_S,
                 max_chars: int = DEFAULT_MAX_CHARS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_size < 1 or ttl_s <= 0 or max_chars < 1:
            raise ValueError("the response store needs max_size >= 1, ttl_s > 0, max_chars >= 1")
        self.max_size = max_size
        self.ttl_s = ttl_s
        self.max_chars = max_chars
        self.chars = 0  # the sizes of the entries held
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Keep `entry`; one larger than max_chars on its own is not kept (and evicts none)."""
        self._drop(response_id)
        entry.created = self._clock()
        entry.size = len(json.dumps(entry.items[entry.new_from:], ensure_ascii=False))
        if entry.size > self.max_chars:
            return
        self._entries[response_id] = entry
        self.chars += entry.size
        self._expire()
        while self._entries and (len(self._entries) > self.max_size
                                 or self.chars > self.max_chars):
            self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        """The live entry (now the most recently used), or None if unknown or expired."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if self._clock() - entry.created >= self.ttl_s:
            self._drop(response_id)
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.chars -= entry.size
        return entry is not None

    def _expire(self) -> None:
        # LRU order is not age order once get() reorders, so only the expired entries at the
        # LRU end go here; a stale entry further in dies at its own get() or by eviction.
        now = self._clock()
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if now - oldest.created < self.ttl_s:
                break
            self._drop(oldest_id)
