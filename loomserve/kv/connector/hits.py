"""Hit accounting: which source served each admitted prefix token, and the connector's counters.

A load records, per request, the first block it loaded and the tier each loaded block came
from; at admission the device hit is split into tokens the loads supplied (by tier) and tokens
that were already on the device. The KV manager's own counters also count probes whose
allocation failed; these count each request once, at its first admission, like
usage.cached_tokens.

Invariants:
- sum(hit_tokens.values()) is the total hit tokens of first admissions (re-admissions of a
  preempted request pass count=False).
- A request's load record lives from its (last) load until it is admitted or finished.
"""

from __future__ import annotations

from collections import defaultdict


class HitAccounting:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # Served prefix tokens by source: "device" or a tier's name.
        self.hit_tokens: dict[str, int] = defaultdict(int)
        self.counters = {"lookups": 0, "loads": 0, "loaded_blocks": 0, "short_loads": 0,
                         "offered_blocks": 0, "session_pauses": 0}
        # request id -> (first loaded block, tier of each loaded block), until admitted
        self._loaded: dict[str, tuple[int, list[str]]] = {}

    def has_load(self, request_id: str) -> bool:
        return request_id in self._loaded

    def record_load(self, request_id: str, start: int, tiers: list[str]) -> None:
        """A load toward blocks [start, start + len(tiers)) ended; tiers[i] served block
        start + i. A later round that continues an earlier round's blocks extends its record."""
        prev = self._loaded.get(request_id)
        if prev is not None and start <= prev[0] + len(prev[1]):
            tiers = prev[1][:max(0, start - prev[0])] + tiers
            self._loaded[request_id] = (min(prev[0], start), tiers)
        else:
            self._loaded[request_id] = (start, tiers)

    def forget(self, request_id: str) -> None:
        self._loaded.pop(request_id, None)

    def on_admit(self, request_id: str, num_hit_tokens: int, count: bool = True) -> int:
        """The request was admitted with a device hit of num_hit_tokens: how many of them its
        tier loads supplied. count=False: a re-admission, left out of the counters."""
        entry = self._loaded.pop(request_id, None)
        tier_tokens = 0
        if entry is not None:
            start, tiers = entry
            bs = self.block_size
            usable = max(0, min(len(tiers), num_hit_tokens // bs - start))
            if count:
                for t in tiers[:usable]:
                    self.hit_tokens[t] += bs
            tier_tokens = usable * bs
        if count:
            self.hit_tokens["device"] += num_hit_tokens - tier_tokens
        return tier_tokens

    def by_source(self) -> dict[str, int]:
        return {"device": 0, **self.hit_tokens}

    def stats(self, store, inflight: int, held_blocks: int) -> dict:
        """Connector counters and each tier's counters and health (cheap: no histograms)."""
        return {"connector": {**self.counters, "inflight": inflight,
                              "held_blocks": held_blocks},
                "store": dict(store.counters),
                "tiers": {t.name: {"healthy": t.stats.healthy, **t.stats.counters}
                          for t in store.tiers}}
