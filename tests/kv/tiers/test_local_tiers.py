"""Host and disk tiers: bit-exact round trips, capacity and LRU, corrupt and torn files,
fingerprint separation, restart, events; keys and the record codec."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

from loomserve.kv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from loomserve.kv.tiers import (
    DiskTier,
    HostTier,
    KeySpace,
    PagesRemoved,
    PagesStored,
    codec,
    fingerprint_for,
    layout_fingerprint,
)

from .conftest import PAGE, block_hashes, keyspace, pages


def make(kind, tmp_path, capacity_pages, page_bytes=PAGE):
    if kind == "host":
        return HostTier(capacity_pages * page_bytes, page_bytes)
    return DiskTier(tmp_path / "disk", capacity_pages * (page_bytes + codec.HEADER_BYTES),
                    page_bytes)


# -- keys and codec ---------------------------------------------------------------------------
def test_fingerprint_separates_every_layout_field():
    base = dict(model_id="m", dtype="bf16", block_size=16, page_bytes=PAGE, group_id=0,
                layout="")
    fps = {layout_fingerprint(**base)}
    for field, other in [("model_id", "m2"), ("dtype", "fp16"), ("block_size", 32),
                         ("page_bytes", 2 * PAGE), ("group_id", 1), ("layout", "x")]:
        fps.add(layout_fingerprint(**{**base, field: other}))
    assert len(fps) == 7 and all(len(f) == 16 for f in fps)
    assert layout_fingerprint(**base) == layout_fingerprint(**base)


def test_fingerprint_for_kv_config():
    def cfg(heads):
        spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_dim=8,
                                 dtype=torch.bfloat16)
        return KVCacheConfig(num_blocks=8, groups=(KVCacheGroup(spec, (0, 1)),))
    assert fingerprint_for(cfg(2), "m") == fingerprint_for(cfg(2), "m")
    assert fingerprint_for(cfg(2), "m") != fingerprint_for(cfg(4), "m")
    assert fingerprint_for(cfg(2), "m") != fingerprint_for(cfg(2), "other-weights")
    ks = KeySpace(fingerprint_for(cfg(2), "m"))
    h = b"\x07" * 16
    assert ks.owns(ks.key(h)) and ks.block_hash(ks.key(h)) == h and len(ks.key(h)) == 32


def test_codec_detects_every_corruption():
    key, page = b"k" * 32, bytes(range(256)) * 4
    rec = codec.encode(key, page)
    assert bytes(codec.decode(key, rec, len(page))) == page
    flipped = bytearray(rec)
    flipped[100] ^= 1
    for bad, k in [(flipped, key), (rec[:-1], key), (rec + b"x", key), (rec, b"j" * 32),
                   (b"XXXX" + rec[4:], key)]:
        with pytest.raises(codec.CorruptRecord):
            codec.decode(k, bad, len(page))


# -- host and disk ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_round_trip_bit_exact(kind, tmp_path, ks):
    tier = make(kind, tmp_path, 16)
    src = pages(12, seed=1)
    keys = ks.keys(block_hashes(12))
    src_rows = list(range(11, -1, -1))  # scattered rows both ways
    assert tier.put(keys, src, src_rows) == [True] * 12
    out = torch.zeros((24, PAGE), dtype=torch.uint8)
    dst_rows = [2 * i + 1 for i in range(12)] if kind == "host" else list(range(12))
    assert tier.get_into(keys, out, dst_rows) == [True] * 12
    for i in range(12):
        assert torch.equal(out[dst_rows[i]], src[src_rows[i]])
    assert tier.stats.hits == 12 and tier.stats.bytes_read == 12 * PAGE
    unknown = ks.keys(block_hashes(2, tag=9))
    assert tier.get_into(unknown, out) == [False, False]
    assert tier.contains(keys[:1] + unknown) == [True, False, False]
    assert tier.stats.misses == 2


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_capacity_and_lru_eviction(kind, tmp_path, ks):
    tier = make(kind, tmp_path, 4)
    events = []
    tier.subscribe(events.append)
    keys = ks.keys(block_hashes(6))
    src = pages(6, seed=2)
    tier.put(keys[:4], src, range(4))
    out = torch.empty((1, PAGE), dtype=torch.uint8)
    assert tier.get_into([keys[0]], out) == [True]  # 0 becomes most recent
    tier.touch([keys[1]])  # then 1
    tier.put(keys[4:6], src, [4, 5])  # evicts 2 and 3, the least recently used
    assert tier.contains(keys) == [True, True, False, False, True, True]
    assert len(tier) == 4
    removed = [k for e in events if isinstance(e, PagesRemoved) for k in e.keys]
    stored = [k for e in events if isinstance(e, PagesStored) for k in e.keys]
    assert removed == [keys[2], keys[3]] and stored == keys
    assert tier.stats.evictions == 2
    if kind == "disk":
        assert not tier.path_of(keys[2]).exists() and tier.path_of(keys[4]).exists()
        files = [p for p in (tmp_path / "disk").rglob("*") if p.is_file()]
        assert len(files) == 4 and tier.used_bytes <= 4 * (PAGE + codec.HEADER_BYTES)
    # a re-put of a held key is not a new store
    tier.put(keys[4:5], src, [4])
    assert tier.stats.stores == 6


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_fingerprint_separation(kind, tmp_path):
    tier = make(kind, tmp_path, 8)
    hashes = block_hashes(3)
    a, b = keyspace(model="a"), keyspace(model="b")
    tier.put(a.keys(hashes), pages(3))
    out = torch.empty((3, PAGE), dtype=torch.uint8)
    assert tier.get_into(b.keys(hashes), out) == [False] * 3
    other_layout = KeySpace(layout_fingerprint("test-model", "torch.bfloat16", 16, 2 * PAGE))
    assert tier.contains(other_layout.keys(hashes)) == [False] * 3
    assert tier.contains(a.keys(hashes)) == [True] * 3


def test_disk_corrupt_and_torn_files_are_misses(tmp_path, ks):
    tier = make("disk", tmp_path, 8)
    keys = ks.keys(block_hashes(5))
    src = pages(5, seed=3)
    tier.put(keys, src)
    # flip one byte of the payload, truncate one, cut one inside its header, swap one for
    # another key's file
    p0, p1, p2, p3 = (tier.path_of(k) for k in keys[:4])
    data = bytearray(p0.read_bytes())
    data[codec.HEADER_BYTES + 17] ^= 0x40
    p0.write_bytes(data)
    with open(p1, "r+b") as f:
        f.truncate(codec.HEADER_BYTES + PAGE // 2)
    with open(p2, "r+b") as f:
        f.truncate(10)
    p3.write_bytes(tier.path_of(keys[4]).read_bytes())
    out = torch.full((5, PAGE), 7, dtype=torch.uint8)
    ok = tier.get_into(keys, out)
    assert ok == [False, False, False, False, True]
    assert torch.equal(out[4], src[4])
    assert tier.stats.corrupt == 4
    assert not any(p.exists() for p in (p0, p1, p2, p3))  # deleted, never read again
    assert tier.contains(keys) == [False] * 4 + [True]
    # the pages can be stored again
    tier.put(keys[:4], src, range(4))
    assert tier.get_into(keys[:4], out) == [True] * 4 and torch.equal(out[:4], src[:4])


def test_disk_survives_restart_and_cleans_leftovers(tmp_path, ks):
    tier = make("disk", tmp_path, 8)
    keys = ks.keys(block_hashes(3))
    src = pages(3, seed=4)
    tier.put(keys, src)
    sub = tier.path_of(keys[0]).parent
    (sub / "junk.page.123.tmp").write_bytes(b"half a page")  # an interrupted write
    tier.path_of(keys[1]).write_bytes(b"short")  # a torn file of the wrong size
    again = make("disk", tmp_path, 8)
    assert not (sub / "junk.page.123.tmp").exists()
    assert again.contains(keys) == [True, False, True]
    out = torch.empty((3, PAGE), dtype=torch.uint8)
    assert again.get_into(keys, out) == [True, False, True]
    assert torch.equal(out[0], src[0]) and torch.equal(out[2], src[2])
    # smaller capacity on restart evicts the oldest down to the bound
    small = make("disk", tmp_path, 1)
    assert len(small) == 1


def test_disk_writes_are_atomic(tmp_path, ks, monkeypatch):
    tier = make("disk", tmp_path, 8)
    keys = ks.keys(block_hashes(2))
    calls = {"n": 0}
    real_fsync = os.fsync

    def failing_fsync(fd):
        calls["n"] += 1
        raise OSError("disk on fire")
    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(Exception):
        tier.put(keys, pages(2))  # every write failed: the tier reports itself unavailable
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert calls["n"] == 2
    assert tier.contains(keys) == [False, False]
    assert not [p for p in (tmp_path / "disk").rglob("*") if p.is_file()]  # no temp left


def test_disk_shards_by_the_last_key_byte(tmp_path, ks):
    """Keys of one layout share their first bytes (the fingerprint); the last byte comes from
    the block hash, so it is the one that spreads files over the 256 directories."""
    tier = make("disk", tmp_path, 4)
    keys = ks.keys(xxhash.xxh3_128_digest(i.to_bytes(4, "little")) for i in range(64))
    assert len({k[0] for k in keys}) == 1
    assert all(tier.path_of(k).parent.name == k.hex()[-2:] for k in keys)
    assert len({tier.path_of(k).parent for k in keys}) > 32


def test_host_corrupt_page_is_a_miss_and_dropped(ks):
    tier = make("host", None, 4)
    keys = ks.keys(block_hashes(3))
    src = pages(3, seed=6)
    tier.put(keys, src)
    events = []
    tier.subscribe(events.append)
    slot = next(s for s in range(tier.num_slots) if torch.equal(tier.buffer[s], src[1]))
    tier.buffer.numpy()[slot, 123] ^= 0x08  # a bit flips in host memory
    out = torch.full((3, PAGE), 7, dtype=torch.uint8)
    assert tier.get_into(keys, out) == [True, False, True]
    assert torch.equal(out[0], src[0]) and torch.equal(out[2], src[2])
    assert bool((out[1] == 7).all())  # checked before the copy: not a byte served
    assert tier.stats.corrupt == 1 and tier.stats.misses == 1
    assert tier.contains(keys) == [True, False, True] and len(tier) == 2
    assert events == [PagesRemoved("host", [keys[1]], "corrupt")]
    # its slot is free again and the page can be stored anew
    tier.put(keys[1:2], src, [1])
    assert tier.get_into(keys, out) == [True] * 3 and torch.equal(out, src)


def test_host_tier_rejects_bad_pages(ks):
    tier = HostTier(4 * PAGE, PAGE)
    with pytest.raises(ValueError):
        tier.put(ks.keys(block_hashes(1)), torch.zeros((1, PAGE), dtype=torch.float32))
    with pytest.raises(ValueError):
        HostTier(PAGE - 1, PAGE)
    assert tier.pinned == torch.cuda.is_available()
