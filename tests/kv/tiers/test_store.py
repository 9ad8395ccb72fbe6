"""TieredStore over host + disk (+ a gated tier standing in for a slow or dead backend):
background handles, promotion, write policy, dropping stores, faults and backoff, prefetch,
think-time prediction, metrics."""

from __future__ import annotations

import time

import pytest
import torch

from loomserve.kv.tiers import (
    DiskTier,
    HostTier,
    SessionPrefetcher,
    ThinkTimePredictor,
    TieredStore,
    codec,
    prometheus_collector,
)

from .conftest import PAGE, GatedTier, block_hashes, pages


def disk(tmp_path, n=64, name=None):
    return DiskTier(tmp_path / (name or "disk"), n * (PAGE + codec.HEADER_BYTES), PAGE,
                    fsync=False, name=name)


@pytest.fixture
def store(tmp_path):
    s = TieredStore([HostTier(8 * PAGE, PAGE), disk(tmp_path)], op_timeout_s=1.0,
                    backoff_s=(0.2, 1.0))
    yield s
    s.close()


def test_store_then_load_through_tiers_with_promotion(store, ks):
    keys = ks.keys(block_hashes(12))
    src = pages(12, seed=5)
    h = store.store(keys, src)
    assert h.result(5).queued == 12 and h.state == "ready"
    assert store.flush()
    host, dk = store.tiers
    # host holds 8 (the last 8 stored), disk holds all 12
    assert sum(host.contains(keys)) == 8 and all(dk.contains(keys))
    res = store.lookup_async(keys).result(5)
    assert res.num_prefix == 12 and res.tiers[:4] == ["disk"] * 4 and res.tiers[4:] == ["host"] * 8
    dst = torch.zeros((16, PAGE), dtype=torch.uint8)
    rows = list(range(15, 3, -1))
    lr = store.load_async(keys[:4], dst, rows[:4]).result(5)
    assert lr.tiers == ["disk"] * 4 and lr.num_prefix == 4
    for i in range(4):
        assert torch.equal(dst[rows[i]], src[i])
    assert all(host.contains(keys[:4]))  # promoted on hit
    lr = store.load(keys[:4], dst, rows[:4])
    assert lr.tiers == ["host"] * 4
    miss = store.lookup(ks.keys(block_hashes(2, tag=3)) + keys[:1])
    assert miss.tiers == [None, None, "host"] and miss.num_prefix == 0


def test_corrupt_host_page_is_served_from_disk_and_promoted_again(store, ks):
    keys = ks.keys(block_hashes(2, tag=9))
    src = pages(2, seed=9)
    store.store(keys, src).result(5)
    assert store.flush()
    host = store.host
    slot = next(s for s in range(host.num_slots) if torch.equal(host.buffer[s], src[0]))
    host.buffer.numpy()[slot, 7] ^= 0xFF
    dst = torch.zeros((2, PAGE), dtype=torch.uint8)
    assert store.load(keys, dst).tiers == ["disk", "host"]
    assert torch.equal(dst, src) and host.stats.corrupt == 1
    assert store.load(keys, dst).tiers == ["host", "host"]  # promoted back, intact
    assert torch.equal(dst, src)


def test_handles_pending_then_ready_and_requests_wait_only_for_their_own(tmp_path, ks):
    gated = GatedTier(disk(tmp_path))
    s = TieredStore([HostTier(4 * PAGE, PAGE), gated], op_timeout_s=5.0)
    try:
        keys = ks.keys(block_hashes(4))
        src = pages(4, seed=6)
        gated.inner.put(keys[2:], src, [2, 3])  # only on the lower tier
        s.host.put(keys[:2], src, [0, 1])
        gated.gate.clear()
        slow = s.load_async(keys[2:], torch.zeros((2, PAGE), dtype=torch.uint8))
        time.sleep(0.05)
        assert slow.state == "pending" and not slow.done()
        # a request whose pages are in host memory does not wait behind it
        dst = torch.zeros((2, PAGE), dtype=torch.uint8)
        fast = s.load_async(keys[:2], dst)
        assert fast.wait(2) and fast.result().tiers == ["host", "host"]
        assert slow.state == "pending"
        gated.gate.set()
        r = slow.result(5)
        assert r.tiers == ["gated", "gated"] and slow.state == "ready"
        lk = s.lookup_async(keys)
        assert lk.result(5).num_prefix == 4
    finally:
        gated.gate.set()
        s.close()


def test_write_policy_seen_n_times_and_session_pause(tmp_path, ks):
    s = TieredStore([HostTier(16 * PAGE, PAGE), disk(tmp_path)], write_after_seen=2)
    try:
        keys = ks.keys(block_hashes(4))
        src = pages(4, seed=7)
        assert s.offer(keys[:2], src, [0, 1]).result(5).queued == 0  # seen once
        assert s.offer(keys[:2], src, [0, 1]).result(5).queued == 2  # seen twice: stored
        assert s.offer(keys[:2], src, [0, 1]).result(5).queued == 0  # already written
        h = s.on_session_pause(keys[2:], src, [2, 3], session_id="s1")
        assert h.result(5).queued == 2  # a pause writes regardless of the count
        assert s.flush()
        assert s.lookup(keys).tiers == ["host"] * 4
        assert all(s.tier("disk").contains(keys))
    finally:
        s.close()


def test_full_queue_drops_without_blocking(tmp_path, ks):
    gated = GatedTier(disk(tmp_path))
    s = TieredStore([HostTier(64 * PAGE, PAGE), gated], queue_depth=2)
    try:
        gated.gate.clear()  # the lower tier's writer hangs on its first put
        src = pages(4, seed=8)
        handles = []
        t0 = time.perf_counter()
        for i in range(40):
            handles.append(s.store(ks.keys(block_hashes(4, tag=i)), src))
        elapsed = time.perf_counter() - t0
        assert elapsed < 0.5, f"store() blocked for {elapsed:.3f}s"
        results = [h.result(5) for h in handles]
        dropped_at_ingest = sum(r.dropped for r in results)
        time.sleep(0.1)
        lower_drops = gated.stats.store_drops
        assert dropped_at_ingest + lower_drops > 0
        assert s.counters["ingest_drops"] == dropped_at_ingest
        gated.gate.set()
        assert s.flush(10)
        # whatever was accepted reached the host tier
        accepted = [i for i, r in enumerate(results) if r.queued]
        assert accepted and all(s.host.contains(ks.keys(block_hashes(4, tag=accepted[0]))))
    finally:
        gated.gate.set()
        s.close()


def test_slow_and_dead_tier_degrade_to_misses_then_recover(tmp_path, ks):
    gated = GatedTier(disk(tmp_path))
    s = TieredStore([HostTier(4 * PAGE, PAGE), gated], op_timeout_s=0.3, backoff_s=(0.3, 0.6))
    try:
        keys = ks.keys(block_hashes(2))
        src = pages(2, seed=9)
        gated.inner.put(keys, src)
        dst = torch.zeros((2, PAGE), dtype=torch.uint8)
        gated.gate.clear()  # slow: hangs past the timeout
        t0 = time.perf_counter()
        r = s.load_async(keys, dst).result(5)
        assert r.tiers == [None, None] and time.perf_counter() - t0 < 1.0
        assert not gated.health.healthy and gated.stats.timeouts == 1
        assert not gated.stats.healthy
        # while backing off, the tier is skipped at once
        calls = gated.calls
        t0 = time.perf_counter()
        assert s.lookup(keys).tiers == [None, None]
        assert time.perf_counter() - t0 < 0.05 and gated.calls == calls
        gated.down = True  # now dead: fails fast
        gated.gate.set()
        time.sleep(0.35)
        assert s.load(keys, dst).tiers == [None, None]  # the probe fails: longer backoff
        assert gated.health.failures >= 2
        gated.down = False  # back
        deadline = time.monotonic() + 3
        while s.load(keys, dst).tiers != ["gated", "gated"]:
            assert time.monotonic() < deadline, "tier did not recover"
            time.sleep(0.05)
        assert torch.equal(dst, src) and gated.health.healthy and gated.stats.healthy
    finally:
        gated.gate.set()
        s.close()


def test_prefetch_brings_pages_up_to_host(store, ks):
    keys = ks.keys(block_hashes(6))
    src = pages(6, seed=10)
    store.tier("disk").put(keys[:5], src)
    store.host.put(keys[:1], src)
    h = store.prefetch("sess", keys)
    r = h.result(5)
    assert (r.promoted, r.resident, r.missing) == (4, 1, 1)
    assert store.host.contains(keys) == [True] * 5 + [False]


def test_think_time_predictor_and_session_prefetcher(store, ks):
    p = ThinkTimePredictor(alpha=0.5, quantile=0.25)
    assert p.predicted_gap() is None and p.prefetch_at(0.0, 1.0) is None
    for g in (10.0, 12.0, 8.0, 30.0):
        p.observe(g)
    assert p.percentile(0.0) == 8.0 and p.percentile(1.0) == 30.0
    gap = p.predicted_gap()
    assert gap == min(p.ewma, p.percentile(0.25)) and gap < 12
    assert p.prefetch_at(100.0, 2.0) == pytest.approx(100.0 + gap - 2.0)
    assert not p.should_prefetch(100.0 + gap - 2.5, 100.0, 2.0)
    assert p.should_prefetch(100.0 + gap - 1.5, 100.0, 2.0)

    now = [0.0]
    sp = SessionPrefetcher(PAGE, default_bandwidth=PAGE * 10, margin_s=0.0, clock=lambda: now[0])
    keys = ks.keys(block_hashes(10))
    for start in (0.0, 100.0):  # two turns with 20 s of think time each
        now[0] = start
        sp.on_pause("a", keys)
        now[0] = start + 20.0
        sp.on_resume("a")
    now[0] = 200.0
    sp.on_pause("a", keys)
    sp.on_pause("b", keys)  # no history: never due
    # 10 pages at 10 pages/s -> 1 s lead: due at 219 s
    assert sp.prefetch_at("a") == pytest.approx(219.0)
    now[0] = 218.0
    assert sp.due() == []
    now[0] = 219.5
    assert sp.due() == [("a", keys)]
    assert sp.due() == []  # once per pause

    # wired into the store: pause -> due -> prefetch from disk into host
    clock = [0.0]
    store.sessions = SessionPrefetcher(PAGE, clock=lambda: clock[0], margin_s=0.0)
    src = pages(10, seed=11)
    store.tier("disk").put(keys[:4], src)
    store.sessions.predictor("s").observe(5.0)
    store.on_session_pause(keys[:4], session_id="s")
    clock[0] = 4.0
    assert store.poll_prefetch() == []
    clock[0] = 5.0
    (h,) = store.poll_prefetch()
    assert h.result(5).promoted == 4 and all(store.host.contains(keys[:4]))
    store.on_session_resume("s")
    assert len(store.sessions.predictor("s").gaps) == 2


def test_events_evict_and_metrics(store, ks):
    events = []
    store.subscribe(events.append)
    keys = ks.keys(block_hashes(3))
    store.store(keys, pages(3)).result(5)
    assert store.flush()
    assert {(e.tier, len(e.keys)) for e in events} == {("host", 3), ("disk", 3)}
    store.load(keys, torch.empty((3, PAGE), dtype=torch.uint8))
    store.evict(keys[:1]).result(5)
    assert store.lookup(keys).tiers == [None, "host", "host"]
    snap = store.stats_snapshot()
    assert snap["tiers"]["host"]["hits"] == 3 and snap["tiers"]["disk"]["stores"] == 3
    assert snap["tiers"]["host"]["latency"]["get"].count == 1  # one load: one batched get

    from prometheus_client import CollectorRegistry, generate_latest
    reg = CollectorRegistry()
    reg.register(prometheus_collector(store.stats))
    text = generate_latest(reg).decode()
    assert 'loomserve_tier_hits_total{tier="host"} 3.0' in text
    assert 'loomserve_tier_healthy{tier="disk"} 1.0' in text
    assert 'loomserve_tier_get_seconds_bucket{le="+Inf",tier="host"} 1.0' in text
    assert 'loomserve_tier_get_seconds_count{tier="disk"} 0.0' in text  # served from host


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_round_trip(tmp_path, ks):
    s = TieredStore([HostTier(4 * PAGE, PAGE), disk(tmp_path)])
    try:
        assert s.host.pinned
        keys = ks.keys(block_hashes(6))
        pool = pages(8, seed=12).cuda()
        s.store(keys, pool, [1, 2, 3, 4, 5, 6]).result(5)
        assert s.flush()
        dst = torch.zeros((8, PAGE), dtype=torch.uint8, device="cuda")
        r = s.load(keys, dst, range(6))
        assert r.num_loaded == 6 and torch.equal(dst[:6], pool[1:7])
    finally:
        s.close()
