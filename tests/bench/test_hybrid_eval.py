"""Hybrid retention eval: a skipped FLOP-aware replay (no eviction under LRU) equals a real one."""

from __future__ import annotations

import random

from loomserve.bench.hybrid_eval import POLICIES, Workload, evaluate, replay
from loomserve.bench.trace import Session, TraceRequest

BS = 16


def _session(seed: int, turns: int = 12) -> Session:
    rng = random.Random(seed)
    ids: list[int] = []
    main = []
    t = 0.0
    for _ in range(turns):
        ids = ids + [rng.randrange(10**9) for _ in range(rng.randint(1, 6))]
        n = len(ids) * BS + rng.randrange(BS)
        main.append(TraceRequest(t=t, in_tokens=n, out_tokens=rng.randint(1, 3 * BS),
                                 hash_ids=tuple(ids)))
        t += 1.0
    return Session(id=str(seed), path="", block_size=BS, models=[], main=main, groups=[])


def test_skip_equals_replay():
    w = Workload([_session(s) for s in range(3)], echo_outputs=False)
    rows = evaluate(w, [0.3, 4.0])
    small, big = rows
    assert "same_as_lru_no_eviction" not in small  # evictions at 30%: everything replayed
    assert big["same_as_lru_no_eviction"] == [f"{p}/flop_aware" for p in POLICIES]
    for row in rows:
        cap = row["capacity_tokens"]
        for name, ret in POLICIES.items():
            res = replay(w, cap, True, ret, "flop_aware")
            assert row[f"{name}/flop_aware"] == res["hit_rate"]
            if f"{name}/flop_aware" in row.get("same_as_lru_no_eviction", ()):
                assert res["evictions"] == 0
        assert row["best_over_fa"] > 0
