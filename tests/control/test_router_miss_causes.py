"""The router's miss causes (loomserve.control.router.miss_causes): from the KV index's view
at decision time, tokens move from the instance's causes to index_stale, session_moved and
placed_elsewhere; totals never change."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from loomserve.control.router.app import RouterService
from loomserve.control.router.instances import InstanceSet
from loomserve.control.router.kv_index import KVIndex
from loomserve.control.router.metrics import RouterMetrics
from loomserve.control.router.miss_causes import (
    PrefillLeg,
    RouteView,
    find_causes,
    prefill_leg_of,
    reattribute,
    rewrite_sse,
    rewrite_usage,
    view_of,
)
from loomserve.control.router.policies import make_policy
from loomserve.control.router.routing import Router

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
    # 96 prompt tokens, none cached on the chosen instance, another held 5 blocks: positions
    # [0, 32) were evicted on the chosen one, [32, 92) never seen there, [0, 80) held there
    causes = {"first_sight": 60, "evicted": 32, "partial_block": 4}
    out = reattribute(causes, 96, 0, RouteView(0, 5, -1), BS)
    assert out == {"placed_elsewhere": 80, "first_sight": 12, "partial_block": 4}


def test_index_stale_and_session_moved():
    causes = {"evicted": 48, "first_sight": 36, "partial_block": 4}  # cached 16 of 104
    # the index said 3 blocks on the chosen one (it had 1), the home held 4, another 6
    out = reattribute(causes, 104, 16, RouteView(3, 6, 4), BS)
    assert out == {"index_stale": 32, "session_moved": 16, "placed_elsewhere": 32,
                   "first_sight": 4, "partial_block": 4}


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


def _chat_usage(prompt: int, cached: int, causes: dict) -> dict:
    return {"usage": {"prompt_tokens": prompt, "completion_tokens": 2,
                      "prompt_tokens_details": {"cached_tokens": cached,
                                                "miss_causes": causes}}}


def test_stream_usage_line_rewritten_split_or_not():
    """A stream's usage line gets the router's causes (the client's report sees them), the
    other lines are passed byte for byte, and a line cut across chunks is whole again."""
    first = b'data: {"choices":[{"text":"a"}]}\n\n'
    usage = b"data: " + json.dumps(_chat_usage(40, 0, {"first_sight": 32,
                                                        "partial_block": 8})).encode()
    stream = first + usage + b"\n\ndata: [DONE]\n\n"
    out, found = rewrite_sse(stream, RouteView(0, 2, -1), BS)
    assert found == [{"placed_elsewhere": 32, "partial_block": 8}]
    lines = out.split(b"\n")
    assert out.startswith(first) and out.endswith(b"\n\ndata: [DONE]\n\n")
    assert json.loads(lines[2][6:])["usage"]["prompt_tokens_details"]["miss_causes"] == \
        found[0]
    assert rewrite_sse(first, RouteView(0, 2, -1), BS) == (first, [])
    # a Responses completed event carries its usage under response
    event = {"type": "response.completed", "response": {"usage": {
        "input_tokens": 40, "input_tokens_details": {"cached_tokens": 16,
                                                     "miss_causes": {"evicted": 24}}}}}
    assert rewrite_usage(event, RouteView(1, 0, 3), BS) == {"session_moved": 24}


def test_prefill_leg_causes_replace_the_decode_legs():
    """The decode leg counted the imported prompt as cached; the prefill leg computed it: the
    client's usage gets the prefill leg's cached tokens and causes (summing to prompt -
    cached), judged by the view of the prefill choice."""
    leg = prefill_leg_of(_chat_usage(100, 16, {"first_sight": 80, "partial_block": 4}))
    assert leg == PrefillLeg(100, 16, {"first_sight": 80, "partial_block": 4})
    decode = _chat_usage(100, 96, {"partial_block": 4})
    assert rewrite_usage(decode, RouteView(6, 0, -1), BS, leg) == {
        "first_sight": 80, "partial_block": 4}
    assert decode["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    # with the prefill choice's view: another instance held 4 blocks
    decode = _chat_usage(100, 96, {"partial_block": 4})
    assert rewrite_usage(decode, None, BS, replace(leg, view=RouteView(1, 4, -1))) == {
        "placed_elsewhere": 48, "first_sight": 32, "partial_block": 4}
    # Anthropic: input_tokens excludes the cached ones
    msg = {"usage": {"input_tokens": 4, "cache_read_input_tokens": 96, "output_tokens": 2,
                     "miss_causes": {"partial_block": 4}}}
    rewrite_usage(msg, None, BS, leg)
    assert (msg["usage"]["input_tokens"], msg["usage"]["cache_read_input_tokens"]) == (84, 16)
    # a leg of another prompt (or one that found more cached) changes nothing
    decode = _chat_usage(90, 86, {"partial_block": 4})
    assert rewrite_usage(decode, None, BS, leg) == {"partial_block": 4}


def test_relay_cut_mid_line_gives_whole_lines_with_the_usage_rewritten():
    """The router's stream relay (RouterService._attribute_stream): chunks cut anywhere (as
    TCP may) come out as whole lines, the usage line rewritten and counted once."""
    index = KVIndex()
    instances = InstanceSet(["http://127.0.0.1:9"], index, events=False)
    router = Router(instances, index, make_policy("round_robin", index, instances.block_size),
                    RouterMetrics())
    svc = RouterService(router, None, 5.0)
    usage = _chat_usage(40, 0, {"first_sight": 32, "partial_block": 8})
    stream = (b'data: {"choices":[{"text":"a"}]}\n\ndata: ' + json.dumps(usage).encode()
              + b"\n\ndata: [DONE]\n\n")

    async def chunks():
        for i in range(0, len(stream), 7):
            yield stream[i:i + 7]

    async def relay():
        try:
            return [c async for c in svc._attribute_stream(chunks(), RouteView(0, 2, -1),
                                                             None, None)]
        finally:
            await svc.upstream.aclose()
    out = asyncio.run(relay())
    assert all(c.endswith(b"\n") for c in out)
    assert b"".join(out) == rewrite_sse(stream, RouteView(0, 2, -1), BS)[0]
    assert b'"placed_elsewhere":32' in b"".join(out)
    count = router.metrics.registry.get_sample_value
    assert count("loomserve_prefix_cache_miss_tokens_total", {"cause": "placed_elsewhere"}) == 32
    assert count("loomserve_prefix_cache_miss_tokens_total", {"cause": "first_sight"}) == 0
