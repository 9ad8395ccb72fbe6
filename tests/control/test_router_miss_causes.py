"""The router's miss causes (loomserve.control.router.miss_causes): from the KV index's view
at decision time, tokens move from the instance's causes to index_stale, session_moved and
placed_elsewhere; totals never change."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from loomserve.control.router.kv_index import KVIndex
from loomserve.control.router.miss_causes import (
    RouteView,
    find_causes,
    reattribute,
    rewrite_usage,
    view_of,
)

BS = 16


def test_view_from_the_index():
    index = KVIndex()
    chain = [f"h{i}" for i in range(10)]
    index.store("a", chain[:6])
    index.store("b", chain[:3])
    index.store("c", chain[:8])
    assert view_of(index, chain, "b", "a") == RouteView(3, 8, 6)
    assert view_of(index, chain, "c", None) == RouteView(8, 6, -1)


def test_placed_elsewhere():
    # 100 prompt tokens, 4 cached on the chosen instance (0 blocks predicted), another held 5
    causes = {"first_sight": 60, "evicted": 32, "partial_block": 4}
    out = reattribute(causes, 100, 4 * 0, RouteView(0, 5, -1), BS)
    assert out == {"placed_elsewhere": 80, "evicted": 12, "partial_block": 4}


def test_index_stale_and_session_moved():
    causes = {"evicted": 48, "first_sight": 36, "partial_block": 4}  # cached 16 of 104
    # the index said 3 blocks on the chosen one (it had 1), the home held 4, another 6
    out = reattribute(causes, 104, 16, RouteView(3, 6, 4), BS)
    assert out == {"index_stale": 32, "session_moved": 16, "placed_elsewhere": 32,
                   "evicted": 4, "partial_block": 4}


@given(st.dictionaries(st.sampled_from(["first_sight", "evicted", "diverged", "salt",
                                        "partial_block"]), st.integers(1, 200), min_size=1),
       st.integers(0, 20), st.integers(0, 20), st.integers(-1, 20), st.integers(0, 10))
def test_totals_are_kept(causes, chosen, other, home, cached_blocks):
    cached = cached_blocks * BS
    total = sum(causes.values())
    out = reattribute(causes, cached + total, cached, RouteView(chosen, other, home), BS)
    assert sum(out.values()) == total and all(v > 0 for v in out.values())
    assert out.get("partial_block") == causes.get("partial_block")


def test_usage_bodies_rewritten_and_found():
    openai = {"usage": {"prompt_tokens": 40, "prompt_tokens_details": {
        "cached_tokens": 0, "miss_causes": {"first_sight": 32, "partial_block": 8}}}}
    assert rewrite_usage(openai, RouteView(0, 2, -1), BS) == {"placed_elsewhere": 32,
                                                              "partial_block": 8}
    anthropic = {"usage": {"input_tokens": 40, "cache_read_input_tokens": 16,
                           "miss_causes": {"first_sight": 32, "partial_block": 8}}}
    assert rewrite_usage(anthropic, RouteView(2, 0, -1), BS) == {
        "index_stale": 16, "first_sight": 16, "partial_block": 8}
    assert rewrite_usage({"usage": {"prompt_tokens": 3}}, RouteView(0, 0), BS) is None
    line = b'data: ' + json.dumps(openai).encode()
    assert find_causes(line) == {"placed_elsewhere": 32, "partial_block": 8}
    assert find_causes(b'{"usage": {}}') is None
