import pytest

from loomserve.kv.cache_manager import KVCacheManager, StaleHitError
from loomserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from loomserve.kv.hashing import hash_chain
from tests.kv.conftest import Req, make_config


def run_prompt(kv, req):
    hit, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(req.all_token_ids) - n, hit, n)
    req.num_computed_tokens = len(req.all_token_ids)
    return n


def test_prefix_hit_capped_and_aligned():
    kv = KVCacheManager(make_config(16, 4))
    a = Req("a", list(range(10)))
    assert run_prompt(kv, a) == 0
    ids_a = kv.get_block_ids("a")
    assert len(ids_a[0]) == 3
    # Same prompt: 10 tokens, capped at 9 -> 2 full blocks.
    b = Req("b", list(range(10)))
    hit, n = kv.get_computed_blocks(b)
    assert n == 8 and hit.block_ids()[0] == ids_a[0][:2]
    # Exactly block-aligned prompt: the last block is not a hit (last token must be computed).
    c = Req("c", list(range(8)))
    assert kv.get_computed_blocks(c)[1] == 4
    assert kv.stats.prefix_queried_tokens == 28 and kv.stats.prefix_hit_tokens == 12


def test_allocate_shares_blocks_and_refcounts():
    kv = KVCacheManager(make_config(8, 4))
    a = Req("a", list(range(12)))
    run_prompt(kv, a)
    b = Req("b", list(range(8)) + [99, 98, 97])
    assert run_prompt(kv, b) == 8
    ba, bb = kv.get_block_ids("a")[0], kv.get_block_ids("b")[0]
    assert ba[:2] == bb[:2] and ba[2] != bb[2]
    blocks = kv.pool.blocks
    assert [blocks[i].ref_cnt for i in bb] == [2, 2, 1]
    assert kv.num_free_blocks == 4
    kv.free(a)
    assert [blocks[i].ref_cnt for i in ba] == [1, 1, 0]
    kv.free(b)
    kv.free(b)  # no-op
    assert kv.num_free_blocks == 8 and kv.usage == 0


def test_block_ids_same_objects_and_decode_growth():
    kv = KVCacheManager(make_config(8, 4))
    a = Req("a", list(range(6)))
    run_prompt(kv, a)
    ids = kv.get_block_ids("a")
    assert ids is kv.get_block_ids("a") and ids[0] is kv.get_block_ids("a")[0]
    for t in range(6, 13):
        a.all_token_ids.append(t)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert len(ids[0]) == 4 and ids[0] is kv.get_block_ids("a")[0]
    # Blocks filled by generated tokens are cached under the right hashes.
    assert a.block_hashes == hash_chain(list(range(13)), 4)
    b = Req("b", list(range(13)))
    assert kv.get_computed_blocks(b)[1] == 12
    assert kv.get_block_ids("nobody") == [[]]


def test_all_or_nothing():
    kv = KVCacheManager(make_config(4, 4))
    a = Req("a", list(range(8)))
    run_prompt(kv, a)
    kv.free(a)  # 2 cached free blocks
    b = Req("b", list(range(8)) + list(range(100, 112)))  # hit 2 blocks, needs 3 more
    hit, n = kv.get_computed_blocks(b)
    assert n == 8
    assert not kv.allocate_slots(b, 12, hit, n)  # 2 free-cached hits + 3 new > 4
    assert kv.num_free_blocks == 4 and kv.get_block_ids("b") == [[]]
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert kv.allocate_slots(b, 8, hit, n)  # 2 hits + 2 new fits
    assert kv.num_free_blocks == 0


def test_preempt_and_resume_keeps_hashes():
    kv = KVCacheManager(make_config(8, 4))
    a = Req("a", list(range(10)))
    run_prompt(kv, a)
    hashes = a.block_hashes
    before = list(hashes)
    kv.free(a)
    a.num_computed_tokens = 0
    hashed = kv.hasher.hashed_blocks
    assert run_prompt(kv, a) == 8
    assert a.block_hashes is hashes and hashes == before and kv.hasher.hashed_blocks == hashed


def test_freed_blocks_hittable_until_reused_and_tail_first():
    kv = KVCacheManager(make_config(4, 4))
    a = Req("a", list(range(16)))
    run_prompt(kv, a)
    kv.free(a)
    # Tail first: the last block is evicted first.
    b = Req("b", list(range(500, 505)))
    run_prompt(kv, b)
    assert kv.get_block_ids("b")[0] == [3, 2]
    c = Req("c", list(range(16)))
    assert kv.get_computed_blocks(c)[1] == 8


def test_salt_and_session():
    kv = KVCacheManager(make_config(32, 4))
    a = Req("a", list(range(20)), cache_salt="alice", session_id="s1")
    run_prompt(kv, a)
    kv.free(a)
    assert kv.get_computed_blocks(Req("x", list(range(20))))[1] == 0
    assert kv.get_computed_blocks(Req("y", list(range(20)), cache_salt="bob"))[1] == 0
    nxt = Req("a2", list(range(30)), cache_salt="alice", session_id="s1")
    hashed = kv.hasher.hashed_blocks
    assert kv.get_computed_blocks(nxt)[1] == 20
    assert kv.hasher.hashed_blocks == hashed + 2 and kv.hasher.reused_blocks == 5
    kv.end_session("s1")
    assert kv.hasher.num_sessions == 0


def test_caching_disabled():
    kv = KVCacheManager(make_config(8, 4), enable_caching=False)
    a = Req("a", list(range(10)))
    assert run_prompt(kv, a) == 0
    kv.free(a)
    b = Req("b", list(range(10)))
    assert kv.get_computed_blocks(b) == (kv.get_computed_blocks(b)[0], 0)
    assert not a.block_hashes and not kv.pool.cached[0]


def test_stale_hit_detected():
    kv = KVCacheManager(make_config(3, 4))
    a = Req("a", list(range(9)))
    run_prompt(kv, a)
    kv.free(a)
    b = Req("b", list(range(9)))
    hit, n = kv.get_computed_blocks(b)
    assert n == 8
    other = Req("o", list(range(100, 112)))
    run_prompt(kv, other)  # takes all 3 blocks, evicting b's hit
    kv.free(other)
    with pytest.raises(StaleHitError):
        kv.allocate_slots(b, 1, hit, n)


def test_events_and_reset():
    events = []
    kv = KVCacheManager(make_config(3, 4), event_hook=events.append)
    a = Req("a", list(range(9)))
    run_prompt(kv, a)
    assert events == [BlockStored(a.block_hashes[:2], None, list(range(8)), 4, 0)]
    a.all_token_ids += [9, 10, 11]
    assert kv.allocate_slots(a, 3)
    assert events[-1] == BlockStored([a.block_hashes[2]], a.block_hashes[1], [8, 9, 10, 11], 4, 0)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    b = Req("b", list(range(100, 105)))
    run_prompt(kv, b)  # reuses the tail blocks first: 2, then 1
    assert events[-2] == BlockRemoved([a.block_hashes[2], a.block_hashes[1]], 0, "device")
    assert events[-1] == BlockStored(b.block_hashes, None, [100, 101, 102, 103], 4, 0)
    kv.free(b)
    assert kv.reset_prefix_cache()
    assert isinstance(events[-1], AllBlocksCleared)
    assert kv.get_computed_blocks(Req("c", list(range(9))))[1] == 0


def test_two_groups_coordinator():
    kv = KVCacheManager(make_config(12, 4, num_groups=2))
    a = Req("a", list(range(10)))
    run_prompt(kv, a)
    ga, gb = kv.get_block_ids("a")
    assert len(ga) == len(gb) == 3 and not set(ga) & set(gb)
    assert kv.num_free_blocks == 6
    kv.free(a)
    # Evict group 1's copy of block 1 only: the hit must fall to 1 block for both groups.
    blk = kv.pool.cached[1][a.block_hashes[1]]
    kv.pool.free_queue.remove(blk)
    kv.pool.free_queue.appendleft(blk)
    b = Req("b", list(range(200, 203)))
    run_prompt(kv, b)  # 1 block per group, taken from the queue front: the moved block first
    c = Req("c", list(range(10)))
    hit, n = kv.get_computed_blocks(c)
    assert n == 4 and [len(h) for h in hit.blocks] == [1, 1]
    assert kv.allocate_slots(c, 6, hit, n)
    gc0, gc1 = kv.get_block_ids("c")
    assert gc0[0] == ga[0] and gc1[0] == gb[0]


def test_two_groups_all_or_nothing():
    kv = KVCacheManager(make_config(4, 4, num_groups=2))
    a = Req("a", list(range(12)))
    hit, n = kv.get_computed_blocks(a)
    assert not kv.allocate_slots(a, 12)  # needs 3 per group = 6 > 4
    assert kv.num_free_blocks == 4
    assert kv.allocate_slots(a, 8)
    assert kv.num_free_blocks == 0


def test_hit_for_request_holding_blocks_rejected_without_change():
    kv = KVCacheManager(make_config(12, 4, num_groups=2))
    a = Req("a", list(range(9)))
    run_prompt(kv, a)
    b = Req("b", list(range(9)))
    hit, n = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 1)  # b now holds blocks without using the hit
    free = kv.num_free_blocks
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 1, hit, n)
    assert kv.num_free_blocks == free and all(
        blk.ref_cnt == 1 for blk in kv.pool.blocks if blk.block_id in kv.get_block_ids("a")[0])


@pytest.mark.parametrize("eviction", ["lru", "flop_aware"])
@pytest.mark.parametrize("refresh", [False, True])
def test_refresh_prefix_keeps_an_arrived_requests_prefix_past_older_blocks(eviction, refresh):
    """A session back from a long tool call has the oldest blocks; once its next turn has
    arrived (refresh_prefix), blocks freed after its last use are evicted before its prefix."""
    kv = KVCacheManager(make_config(8, 4), eviction=eviction)
    a, b = Req("a", list(range(12))), Req("b", list(range(100, 112)))
    run_prompt(kv, a)
    kv.free(a)  # a's three blocks are the oldest hashed ones
    run_prompt(kv, b)
    kv.free(b)
    a2 = Req("a2", list(range(16)), session_id="a")
    if refresh:
        assert kv.refresh_prefix(a2) == 3
    assert kv.stats.prefix_queried_tokens == 24  # the refresh probe is not counted
    cold = Req("c", list(range(500, 520)))  # 5 blocks: the 2 never used + 3 hashed
    run_prompt(kv, cold)
    assert kv.get_computed_blocks(a2)[1] == (12 if refresh else 0)
    assert kv.get_computed_blocks(Req("b2", list(range(100, 116))))[1] == (0 if refresh else 12)
