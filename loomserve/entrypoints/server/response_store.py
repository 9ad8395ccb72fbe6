"""The bounded in-memory store behind `previous_response_id` and GET/DELETE /v1/responses/{id}.

Invariants: at most `max_size` entries (the least recently used goes first); an entry older
than `ttl_s` is never returned and is dropped when seen; one event loop owns the store, so no
locking. Each entry keeps the whole conversation as Responses items (the inputs of every turn
of its chain, then its own output), so a follow-up sends only its new items. Entries of one
chain share the item dicts: a turn adds a list of references, not a copy of the history.
Nothing survives a restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_MAX_SIZE = 1024
DEFAULT_TTL_S = 3600.0


@dataclass
class StoredResponse:
    response: dict  # the response object as the client received it
    items: list[dict]  # the conversation: every input item of the chain, then every output item
    session_id: str | None = None  # the chain's prompt_cache_key, inherited by follow-ups
    created: float = field(default=0.0)  # the store's clock at put()


class ResponseStore:
    def __init__(self, max_size: int = DEFAULT_MAX_SIZE, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_size < 1 or ttl_s <= 0:
            raise ValueError("the response store needs max_size >= 1 and ttl_s > 0")
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, entry: StoredResponse) -> None:
        entry.created = self._clock()
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        self._expire()
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The live entry (now the most recently used), or None if unknown or expired."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if self._clock() - entry.created >= self.ttl_s:
            del self._entries[response_id]
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._entries.pop(response_id) is not None

    def _expire(self) -> None:
        # Insertion order is not age order once get() reorders, so scan from the LRU end only
        # while entries there are expired; a stale entry further in dies at its own get().
        now = self._clock()
        while self._entries:
            oldest_id, oldest = next(iter(self._entries.items()))
            if now - oldest.created < self.ttl_s:
                break
            del self._entries[oldest_id]
