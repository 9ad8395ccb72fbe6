"""A subagent request (parent_session_id set) keeps its parent session active: the parent's
session pin outlives its time-to-live while the subagent's requests keep arriving or running,
and expires one TTL after the last of them, like any other pin."""

from __future__ import annotations

from dataclasses import dataclass

from loomserve.kv.cache_manager import KVCacheManager
from loomserve.kv.retention import RetentionConfig
from tests.kv.conftest import Req, make_config, make_hybrid_config

TTL = 10.0


@dataclass
class SubReq(Req):
    parent_session_id: str | None = None


def make_kv(now, config=None):
    ret = RetentionConfig(pin_ttl_s=TTL, pin_budget_bytes=10 ** 9)
    return KVCacheManager(config or make_config(32), retention=ret, clock=lambda: now[0])


def admit(kv, req):
    hit, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(req.all_token_ids) - n, hit, n)
    req.num_computed_tokens = len(req.all_token_ids)


def turn(kv, req):
    admit(kv, req)
    kv.free(req)


def pinned_parent(kv):
    turn(kv, Req("p0", list(range(10)), session_id="P"))
    blocks = kv.pins.blocks("P")
    assert blocks and all(b.ref_cnt == 1 for b in blocks)
    return blocks


def test_pin_survives_while_subagent_requests_keep_arriving():
    now = [0.0]
    kv = make_kv(now)
    blocks = pinned_parent(kv)
    for i, t in enumerate((6.0, 12.0, 18.0, 24.0)):  # every gap < TTL, the total well past it
        now[0] = t
        turn(kv, SubReq(f"c{i}", [100 + i] * 9, session_id="C", parent_session_id="P"))
        assert kv.pins.blocks("P") == blocks, f"parent pin expired at t={t}"
    assert all(b.ref_cnt == 1 for b in blocks)
    now[0] = 24.0 + TTL + 0.5  # one TTL after the last subagent request: released
    admit(kv, Req("t", [1]))
    assert kv.pins.blocks("P") == [] and all(b.ref_cnt == 0 for b in blocks)


def test_pin_survives_a_long_running_subagent():
    now = [0.0]
    kv = make_kv(now)
    blocks = pinned_parent(kv)
    child = SubReq("c", [200] * 5, session_id="C", parent_session_id="P")
    admit(kv, child)
    for step in range(1, 60):  # decoding for 30 s, one token every 0.5 s
        now[0] = step * 0.5
        child.all_token_ids.append(7)
        assert kv.allocate_slots(child, 1)
        child.num_computed_tokens += 1
        admit(kv, Req(f"other{step}", [300 + step] * 3))  # other traffic checks expiry too
        kv.free(Req(f"other{step}", []))
    assert kv.pins.blocks("P") == blocks


def test_pin_expires_without_a_subagent():
    now = [0.0]
    kv = make_kv(now)
    blocks = pinned_parent(kv)
    now[0] = 6.0
    turn(kv, SubReq("c0", [100] * 9, session_id="C"))  # no parent: not a subagent of P
    now[0] = 12.0
    turn(kv, SubReq("c1", [101] * 9, session_id="C", parent_session_id="Q"))  # another's
    assert kv.pins.blocks("P") == [] and all(b.ref_cnt == 0 for b in blocks)
    assert not kv.pins.refresh("P")  # refreshing never pins anything back


def test_refresh_keeps_pins_in_expiry_order():
    now = [0.0]
    kv = make_kv(now, make_hybrid_config(64))
    turn(kv, Req("s", list(range(10)), session_id="S"))
    now[0] = 1.0
    turn(kv, Req("p", list(range(50, 60)), session_id="P"))
    now[0] = 5.0
    assert kv.pins.refresh("S")  # S now expires at 15, after P (11)
    assert list(kv.pins._pins) == ["P", "S"]
    now[0] = 11.5
    admit(kv, Req("t", [1]))
    assert kv.pins.blocks("P") == [] and kv.pins.blocks("S")
