"""Redis and Mooncake Store tiers against real servers on 127.0.0.1: round trips, misses,
corrupt values, full pools, and killing the server mid-run (misses with bounded latency, then
recovery after a restart)."""

from __future__ import annotations

import time

import pytest
import torch

from loomserve.control.store_launcher import MooncakeService, RedisService
from loomserve.kv.tiers import HostTier, TieredStore

from .conftest import PAGE, block_hashes, pages, require_mooncake, require_redis


def redis_tier(svc, **kw):
    from loomserve.kv.tiers.redis_tier import RedisTier
    return RedisTier(PAGE, url=svc.url, timeout_s=0.5, **kw)


def mooncake_tier(svc, page_bytes=PAGE, **kw):
    from loomserve.kv.tiers.mooncake_tier import MooncakeTier
    return MooncakeTier(svc.master_address, page_bytes, **kw)


def wait_until(fn, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.1)


def check_round_trip(tier, ks, tag):
    keys = ks.keys(block_hashes(6, tag=tag))
    src = pages(6, seed=tag)
    assert tier.put(keys[:5], src, [4, 3, 2, 1, 0]) == [True] * 5
    assert tier.contains(keys) == [True] * 5 + [False]
    out = torch.zeros((8, PAGE), dtype=torch.uint8)
    assert tier.get_into(keys, out, [7, 6, 5, 4, 3, 2]) == [True] * 5 + [False]
    for i in range(5):
        assert torch.equal(out[7 - i], src[4 - i])
    assert tier.stats.hits == 5 and tier.stats.misses == 1
    tier.remove(keys[:1])
    assert tier.contains(keys[:2]) == [False, True]


# -- Redis ------------------------------------------------------------------------------------
def test_redis_round_trip_miss_and_corrupt_value(redis_service, ks):
    tier = redis_tier(redis_service)
    check_round_trip(tier, ks, tag=1)
    keys = ks.keys(block_hashes(3, tag=2))
    src = pages(3, seed=2)
    tier.put(keys, src)
    good = tier.client.get(tier._k(keys[0]))
    tier.client.set(tier._k(keys[0]), good[:-1] + bytes([good[-1] ^ 1]))  # a flipped bit
    tier.client.set(tier._k(keys[1]), good)  # another key's record
    out = torch.zeros((3, PAGE), dtype=torch.uint8)
    assert tier.get_into(keys, out) == [False, False, True]
    assert tier.stats.corrupt == 2 and tier.contains(keys) == [False, False, True]
    assert torch.equal(out[2], src[2])


def test_redis_ttl(redis_service, ks):
    tier = redis_tier(redis_service, ttl_s=0.3)
    keys = ks.keys(block_hashes(1, tag=3))
    tier.put(keys, pages(1))
    assert tier.contains(keys) == [True]
    wait_until(lambda: tier.contains(keys) == [False], 3, "key did not expire")


def test_redis_full_pool_put_is_a_miss(ks):
    require_redis()
    with RedisService(maxmemory=2 << 20, policy="noeviction") as svc:
        tier = redis_tier(svc)
        s = TieredStore([tier])
        try:
            keys = ks.keys(block_hashes(1024, tag=4))
            src = pages(1024, seed=4)
            ok = tier.put(keys, src)  # 4 MiB into 2 MiB
            assert 0 < sum(ok) < len(keys) and tier.stats.store_fails == len(keys) - sum(ok)
            # through the store: refused puts are not faults
            s.store(ks.keys(block_hashes(8, tag=5)), src).result(5)
            assert s.flush()
            assert tier.health.healthy
            r = s.lookup(keys)
            assert r.found == ok
        finally:
            s.close()


def test_redis_killed_mid_run_misses_then_recovers(ks):
    require_redis()
    svc = RedisService().start()
    tier = redis_tier(svc)
    s = TieredStore([HostTier(4 * PAGE, PAGE), tier], op_timeout_s=1.0, backoff_s=(0.2, 0.5))
    try:
        keys = ks.keys(block_hashes(8, tag=6))
        src = pages(8, seed=6)
        s.store(keys, src).result(5)
        assert s.flush()
        assert s.lookup(keys).tiers == ["redis"] * 4 + ["host"] * 4
        svc.kill()
        dst = torch.zeros((8, PAGE), dtype=torch.uint8)
        for _ in range(5):
            t0 = time.perf_counter()
            r = s.load_async(keys, dst).result(5)
            assert time.perf_counter() - t0 < 1.5
            assert r.tiers[:4] == [None] * 4  # only what host memory still holds
            s.store(ks.keys(block_hashes(2, tag=60)), src).result(5)  # stores keep not blocking
        assert not tier.health.healthy and tier.stats.errors >= 1
        svc = RedisService(port=svc.port).start()  # restart, empty
        s.host.clear()

        def served():
            s.store(keys[:4], src, range(4))
            s.flush(2)
            s.host.clear()
            return s.load(keys[:4], dst).tiers == ["redis"] * 4
        wait_until(served, 5, "redis tier did not serve again")
        assert torch.equal(dst[:4], src[:4]) and tier.stats.healthy
    finally:
        s.close()
        svc.stop()


# -- Mooncake Store ---------------------------------------------------------------------------
def test_mooncake_round_trip_and_miss(mooncake_service, ks):
    tier = mooncake_tier(mooncake_service, staging_pages=4)  # chunked batches too
    try:
        check_round_trip(tier, ks, tag=11)
        assert tier.get_into(ks.keys(block_hashes(2, tag=12)),
                             torch.zeros((2, PAGE), dtype=torch.uint8)) == [False, False]
        assert tier.stats.errors == 0
    finally:
        tier.close()


def test_mooncake_through_store_background(mooncake_service, ks):
    tier = mooncake_tier(mooncake_service)
    s = TieredStore([HostTier(2 * PAGE, PAGE), tier])
    try:
        keys = ks.keys(block_hashes(6, tag=13))
        src = pages(6, seed=13)
        assert s.store(keys, src).result(5).queued == 6
        assert s.flush()
        h = s.lookup_async(keys)
        assert h.result(5).tiers == ["mooncake"] * 4 + ["host"] * 2
        dst = torch.zeros((6, PAGE), dtype=torch.uint8)
        r = s.load_async(keys, dst).result(5)
        assert r.num_prefix == 6 and torch.equal(dst, src)
    finally:
        s.close()


def test_mooncake_full_pool_put_is_a_miss(ks):
    require_mooncake()
    page = 256 << 10
    with MooncakeService(segment_bytes=16 << 20) as svc:
        tier = mooncake_tier(svc, page_bytes=page, staging_pages=8)
        try:
            keys = ks.keys(block_hashes(96, tag=14))  # 24 MiB into 16 MiB
            src = torch.randint(0, 256, (8, page), dtype=torch.uint8)
            ok = []
            for lo in range(0, 96, 8):
                ok += tier.put(keys[lo:lo + 8], src)
            assert 0 < sum(ok) < 96 and tier.stats.store_fails == 96 - sum(ok)
            assert tier.health.healthy
        finally:
            tier.close()


@pytest.mark.parametrize("victim", ["master", "client"])
def test_mooncake_killed_mid_run_misses_then_recovers(victim, tmp_path, ks):
    require_mooncake()
    # A short client TTL lets the master drop a dead storage client's segment quickly.
    svc = MooncakeService(segment_bytes=32 << 20, log_dir=tmp_path,
                          master_args=("--client_ttl=2",)).start()
    tier = mooncake_tier(svc)
    s = TieredStore([tier], op_timeout_s=1.0, backoff_s=(0.3, 1.0))
    try:
        keys = ks.keys(block_hashes(4, tag=15))
        src = pages(4, seed=15)
        s.store(keys, src).result(5)
        assert s.flush()
        dst = torch.zeros((4, PAGE), dtype=torch.uint8)
        assert s.load(keys, dst).tiers == ["mooncake"] * 4
        svc.kill_master() if victim == "master" else svc.kill_client()
        worst = 0.0
        for _ in range(4):
            t0 = time.perf_counter()
            r = s.load_async(keys, dst).result(10)
            worst = max(worst, time.perf_counter() - t0)
            assert r.tiers == [None] * 4
            t0 = time.perf_counter()
            s.store(keys, src)  # never blocks
            assert time.perf_counter() - t0 < 0.05
        assert worst < 1.5, f"a load took {worst:.2f}s with the {victim} down"
        assert not tier.health.healthy
        if victim == "master":
            svc.start_master()  # its storage client remounts its segment by itself
        else:
            svc.start_client()
        # the pool restarted empty: stores succeed again, then loads hit
        def served():
            s.store(keys, src)
            s.flush(3)
            return s.load(keys, dst).tiers == ["mooncake"] * 4
        wait_until(served, 20, f"mooncake tier did not recover after the {victim} restart")
        assert torch.equal(dst, src) and tier.health.healthy
    finally:
        s.close()
        svc.stop()


def test_mooncake_tier_created_before_the_pool_connects_later(tmp_path, ks):
    require_mooncake()
    svc = MooncakeService(segment_bytes=16 << 20, log_dir=tmp_path)  # ports picked, not started
    t0 = time.perf_counter()
    tier = mooncake_tier(svc)
    assert time.perf_counter() - t0 < 2.0
    s = TieredStore([tier], op_timeout_s=1.0, backoff_s=(0.2, 0.5))
    try:
        keys = ks.keys(block_hashes(2, tag=16))
        src = pages(2, seed=16)
        t0 = time.perf_counter()
        assert s.lookup(keys).tiers == [None, None] and not tier.health.healthy
        assert time.perf_counter() - t0 < 1.5
        svc.start()
        dst = torch.zeros_like(src)

        def served():
            s.store(keys, src)
            s.flush(3)
            return s.load(keys, dst).tiers == ["mooncake"] * 2
        wait_until(served, 10, "the tier did not connect once the pool was up")
        assert torch.equal(dst, src)
    finally:
        s.close()
        svc.stop()
