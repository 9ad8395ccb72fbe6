import random

from loomserve.kv.hashing import BlockHasher, hash_block, hash_chain
from tests.kv.conftest import Req


def toks(n, seed=0):
    r = random.Random(seed)
    return [r.randrange(200_000) for _ in range(n)]


def test_chain_matches_blockwise_definition():
    t = toks(40)
    chain = hash_chain(t, 8, "salt")
    assert len(chain) == 5 and all(isinstance(h, bytes) and len(h) == 16 for h in chain)
    parent = None
    for i in range(5):
        h = hash_block(parent, t[i * 8:(i + 1) * 8], b"\x01salt:salt" if i == 0 else b"")
        assert h == chain[i]
        parent = h


def test_salt_separates_every_block():
    t = toks(64)
    a, b, c = hash_chain(t, 16), hash_chain(t, 16, "x"), hash_chain(t, 16, "y")
    assert not set(a) & set(b) and not set(b) & set(c) and not set(a) & set(c)
    assert hash_chain(t, 16, "x") == b


def test_chain_depends_on_prefix():
    t = toks(32)
    u = list(t)
    u[0] += 1
    assert hash_chain(t, 8)[3] != hash_chain(u, 8)[3]


def test_incremental_equals_full():
    t = toks(100)
    h = BlockHasher(8)
    r = Req("r", t[:30], cache_salt="s")
    h.ensure(r)
    assert len(r.block_hashes) == 3
    for n in range(30, 100):  # decode growth
        r.all_token_ids.append(t[n])
        h.ensure(r)
    assert r.block_hashes == hash_chain(t, 8, "s")
    assert h.hashed_blocks == 12
    h2 = BlockHasher(8)
    r2 = Req("r2", list(t))
    h2.ensure(r2, 5)
    assert r2.block_hashes == hash_chain(t, 8)[:5]


def test_session_memo_reuses_unchanged_prefix():
    t = toks(200)
    h = BlockHasher(8)
    r1 = Req("t1", t[:100], session_id="s", cache_salt="k")
    h.ensure(r1)
    h.remember(r1)
    r2 = Req("t2", t[:180], session_id="s", cache_salt="k")
    h.ensure(r2)
    assert r2.block_hashes == hash_chain(t[:180], 8, "k")
    assert h.reused_blocks == 12 and h.hashed_blocks == 12 + 10


def test_session_memo_detects_mismatch():
    t = toks(200)
    h = BlockHasher(8)
    r1 = Req("t1", t[:160], session_id="s")
    h.ensure(r1)
    h.remember(r1)
    u = list(t[:180])
    u[43] = -5  # block 5 changed: blocks 0..4 reusable
    r2 = Req("t2", u, session_id="s")
    h.ensure(r2)
    assert r2.block_hashes == hash_chain(u, 8)
    assert h.reused_blocks == 5
    # A different salt reuses nothing.
    r3 = Req("t3", t[:180], session_id="s", cache_salt="other")
    h.ensure(r3)
    assert r3.block_hashes == hash_chain(t[:180], 8, "other")
    assert h.reused_blocks == 5


def test_session_memo_mismatch_in_late_chunk():
    t = toks(8 * 700)
    h = BlockHasher(8)
    r1 = Req("a", list(t), session_id="s")
    h.ensure(r1)
    h.remember(r1)
    u = list(t)
    u[8 * 600 + 3] += 1
    r2 = Req("b", u, session_id="s")
    h.ensure(r2)
    assert h.reused_blocks == 600 and r2.block_hashes == hash_chain(u, 8)


def test_session_memo_bounded_and_end_session():
    h = BlockHasher(4, max_sessions=2)
    for s in "abc":
        r = Req(s, toks(8), session_id=s)
        h.ensure(r)
        h.remember(r)
    assert h.num_sessions == 2
    h.end_session("b")
    h.end_session("zz")
    assert h.num_sessions == 1


def test_session_memo_bounded_by_tokens():
    h = BlockHasher(4, max_sessions=10, max_memo_tokens=20)
    for s in "abc":
        r = Req(s, toks(8), session_id=s)
        h.ensure(r)
        h.remember(r)
    assert h.num_sessions == 2  # 24 tokens > 20: the oldest session went
    h.end_session("c")
    h.end_session("b")
    assert h.num_sessions == 0 and h._memo_tokens == 0
