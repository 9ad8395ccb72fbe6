import pytest

from loomserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from loomserve.kv.pool import Block, BlockPool, FreeBlockQueue


def ids(q):
    return [b.block_id for b in q]


def test_free_queue_ops():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and ids(q) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.appendleft(blocks[2])
    q.append(blocks[0])
    assert ids(q) == [2, 1, 3, 4, 0]
    with pytest.raises(ValueError):
        q.remove(Block(9))
    for _ in range(5):
        q.popleft()
    assert len(q) == 0
    with pytest.raises(IndexError):
        q.popleft()


def test_allocate_free_and_order():
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 3
    pool.cache_blocks(0, a[:2], [b"h0", b"h1"])
    pool.free(reversed(a))  # tail first: 2 (unhashed) to the front, 1 then 0 to the back
    assert ids(pool.free_queue) == [2, 3, 4, 5, 1, 0]
    assert pool.get_cached_block(0, b"h0") is a[0]  # still hittable while free
    with pytest.raises(AssertionError):
        pool.free([a[0]])
    with pytest.raises(ValueError):
        pool.allocate(7)
    assert pool.num_free_blocks == 6


def test_touch_removes_from_middle_and_eviction_drops_hash():
    events = []
    pool = BlockPool(4, event_hooks=[events.append])
    a = pool.allocate(2)
    pool.cache_blocks(0, a, [b"x", b"y"], None, [1, 2, 3, 4], 2)
    assert events == [BlockStored([b"x", b"y"], None, [1, 2, 3, 4], 2, 0)]
    pool.free(reversed(a))
    pool.touch([a[0]])
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 3
    assert ids(pool.free_queue) == [2, 3, 1]
    epoch = pool.eviction_epoch
    got = pool.allocate(3)
    assert got[-1] is a[1] and a[1].block_hash is None
    assert pool.get_cached_block(0, b"y") is None
    assert pool.eviction_epoch > epoch
    assert events[-1] == BlockRemoved([b"y"], 0, "device")


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_blocks(0, [a], [b"h"])
    pool.cache_blocks(0, [b], [b"h"])
    assert pool.get_cached_block(0, b"h") is a and b.block_hash is None


def test_groups_do_not_share_hashes():
    pool = BlockPool(4, num_groups=2)
    a, b = pool.allocate(2)
    pool.cache_blocks(0, [a], [b"h"])
    pool.cache_blocks(1, [b], [b"h"])
    assert pool.get_cached_block(0, b"h") is a and pool.get_cached_block(1, b"h") is b
    assert pool.lookup_prefix(1, [b"h", b"z"], 5) == [b]


def test_reset_prefix_cache():
    events = []
    pool = BlockPool(3)
    pool.subscribe(events.append)
    a = pool.allocate(1)
    pool.cache_blocks(0, a, [b"h"])
    assert not pool.reset_prefix_cache()
    pool.free(a)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(0, b"h") is None and a[0].block_hash is None
    assert isinstance(events[-1], AllBlocksCleared)


def test_null_block_reserved():
    pool = BlockPool(4, reserve_null_block=True)
    assert pool.num_free_blocks == 3 and pool.null_block.block_id == 0
    assert 0 not in [b.block_id for b in pool.allocate(3)]
