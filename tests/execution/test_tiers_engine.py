"""The engine with KV tiers below its device pool (loomserve.kv.connector), on the tiny Llama
fixture with a device pool of a few blocks and real tiers (host memory, local disk, Mooncake
Store, Redis): evicted prefixes come back from a tier, outputs stay token-for-token equal to a
run without any cache, faults degrade to recompute, and a slow tier never stalls other work."""

from __future__ import annotations

import random
import threading
import time

import pytest

from loomserve import SamplingParams
from loomserve.execution.request import RequestStatus
from loomserve.kv import connector as tiering
from loomserve.kv.hashing import hash_chain
from loomserve.kv.tiers import DiskTier, TieredStore, codec
from tests.execution.conftest import make_llm
from tests.kv.tiers.conftest import mooncake_service, require_mooncake, require_redis  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BS = 16
POOL_BLOCKS = 16  # the device pool: room for about two of the prompts below


def prompt(seed: int, n: int = 100) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


A = prompt(1)
OTHERS = [prompt(s) for s in range(10, 14)]


@pytest.fixture(scope="module")
def reference():
    """Outputs without any cache: what every tiered run must reproduce."""
    llm = make_llm(enable_prefix_caching=False)
    return {tuple(p): llm.generate(p, GREEDY)[0].token_ids for p in [A, *OTHERS]}


@pytest.fixture(scope="module")
def page_bytes(reference):
    return make_llm(kv_cache_memory="1MiB").core.runner.kv_cache_config.page_bytes


def small_llm(page_bytes, **kw):
    return make_llm(kv_cache_memory=str(page_bytes * POOL_BLOCKS), block_size=BS, **kw)


def run(llm, p):
    return llm.generate(p, GREEDY)[0]


def evict_a(llm, reference):
    """Other traffic pushes A's blocks out of the device pool."""
    for p in OTHERS:
        assert run(llm, p).token_ids == reference[tuple(p)]
    hashes = hash_chain(A, BS)
    assert not any(h in llm.core.kv.pool.cached[0] for h in hashes[:2]), "A still on device"


def settle(llm):
    """Wait for background stores, then release the rows they held."""
    assert llm.core.tiers.store.flush(10)
    llm.core.idle()
    assert llm.core.tiers.num_held_blocks == 0
    assert llm.core.kv.num_free_blocks == llm.core.kv.num_blocks


def test_host_tier_serves_evicted_prefix(page_bytes, reference):
    llm = small_llm(page_bytes, host_cache_memory=str(page_bytes * 64))
    try:
        first = run(llm, A)
        assert first.num_cached_tokens == 0 and first.token_ids == reference[tuple(A)]
        assert llm.core.tiers.counters["lookups"] == 0  # an in-memory index said: no tier has it
        settle(llm)
        evict_a(llm, reference)
        again = run(llm, A)
        assert again.token_ids == reference[tuple(A)]
        assert again.num_cached_tokens == again.num_tier_cached_tokens == 96  # 6 full blocks
        stats = llm.core.stats()
        assert stats.prefix_hit_tokens_by_source["host"] == 96
        assert stats.prefix_hit_tokens_by_source["device"] <= stats.prefix_hit_tokens
        assert stats.tiers["tiers"]["host"]["hits"] >= 6
        # the loaded blocks are ordinary device hits now
        third = run(llm, A)
        assert third.num_cached_tokens == 96 and third.num_tier_cached_tokens == 0
        assert third.token_ids == reference[tuple(A)]
        settle(llm)
    finally:
        llm.close()


def test_write_after_seen_two_stores_on_second_use(page_bytes, reference):
    llm = small_llm(page_bytes, host_cache_memory=str(page_bytes * 64), tier_write_after_seen=2)
    host = llm.core.tiers.store.host
    keys = llm.core.tiers.keyspaces[0].keys(hash_chain(A, BS)[:6])
    try:
        assert run(llm, A).token_ids == reference[tuple(A)]
        settle(llm)
        assert not any(host.contains(keys))  # computed once: not written yet
        assert run(llm, A).num_cached_tokens == 96  # a device hit: seen twice
        settle(llm)
        assert all(host.contains(keys))
        evict_a(llm, reference)
        out = run(llm, A)
        assert out.token_ids == reference[tuple(A)] and out.num_tier_cached_tokens == 96
    finally:
        llm.close()


def test_disk_tier_hits_after_restart(tmp_path, page_bytes, reference):
    kw = dict(disk_cache_dir=str(tmp_path / "kv"), disk_cache_size=str(page_bytes * 256))
    llm = small_llm(page_bytes, **kw)
    try:
        assert run(llm, A).token_ids == reference[tuple(A)]
        settle(llm)
    finally:
        llm.close()
    fresh = small_llm(page_bytes, **kw)
    try:
        out = run(fresh, A)
        assert out.token_ids == reference[tuple(A)]
        assert out.num_tier_cached_tokens == 96
        assert fresh.core.stats().prefix_hit_tokens_by_source["disk"] == 96
    finally:
        fresh.close()


def test_corrupt_disk_page_is_a_miss(tmp_path, page_bytes, reference, monkeypatch):
    monkeypatch.setattr(tiering, "LOAD_CHUNK_BLOCKS", 2)  # loads of [0,2) [2,4) [4,6)
    kw = dict(disk_cache_dir=str(tmp_path / "kv"), disk_cache_size=str(page_bytes * 256))
    llm = small_llm(page_bytes, **kw)
    try:
        assert run(llm, A).token_ids == reference[tuple(A)]
        settle(llm)
        disk = llm.core.tiers.store.tier("disk")
        key = llm.core.tiers.keyspaces[0].key(hash_chain(A, BS)[2])
        path = disk.path_of(key)
        data = bytearray(path.read_bytes())
        data[codec.HEADER_BYTES + 100] ^= 0xFF  # one flipped byte inside block 2's page
        path.write_bytes(bytes(data))
        evict_a(llm, reference)
        out = run(llm, A)
        assert out.token_ids == reference[tuple(A)]
        # blocks 0-1 loaded; 2 is corrupt, so 3-5 (loaded by their own chunks) are not a
        # prefix: recomputed
        assert out.num_tier_cached_tokens == 2 * BS
        assert llm.core.tiers.counters["short_loads"] == 1
        assert disk.stats.corrupt >= 1  # dropped, then written again from the recompute
        settle(llm)
    finally:
        llm.close()


class SlowDisk(DiskTier):
    """A real disk tier whose lookups wait for `lookup_gate` and reads for `read_gate` (a slow
    backend)."""

    index_in_memory = False  # its contains() may block: the engine must not ask inline

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.lookup_gate = threading.Event()
        self.read_gate = threading.Event()
        self.open()

    def open(self) -> None:
        self.lookup_gate.set()
        self.read_gate.set()

    def contains(self, keys):
        self.lookup_gate.wait(30)
        return super().contains(keys)

    def get_into(self, keys, out, rows=None):
        self.read_gate.wait(30)
        return super().get_into(keys, out, rows)


def slow_store(tmp_path, page_bytes):
    disk = SlowDisk(tmp_path / "slow", page_bytes * 256, page_bytes, fsync=False)
    return disk, TieredStore([disk], op_timeout_s=30.0)


def drain(core, timeout=30.0):
    deadline = time.monotonic() + timeout
    while core.has_work() and time.monotonic() < deadline:
        core.step()
    assert not core.has_work()


def test_slow_tier_lookup_does_not_block_other_requests(tmp_path, page_bytes, reference):
    llm = small_llm(page_bytes)
    disk, store = slow_store(tmp_path, page_bytes)
    conn = llm.core.attach_tiers(store)
    core = llm.core
    try:
        assert run(llm, A).token_ids == reference[tuple(A)]
        settle(llm)
        evict_a(llm, reference)
        disk.lookup_gate.clear()
        a = llm.inputs.make_request("a", A, GREEDY)
        b = llm.inputs.make_request("b", OTHERS[-1], GREEDY)  # a full device hit: no lookup
        core.add_request(a)  # queue head, its lookup hangs
        core.add_request(b)
        for _ in range(20):
            core.step()
            if b.status.finished:
                break
        assert b.status == RequestStatus.FINISHED_LENGTH, "b waited behind a's tier lookup"
        assert b.output_token_ids == reference[tuple(OTHERS[-1])]
        assert a.status == RequestStatus.WAITING and conn.num_inflight == 1
        disk.open()
        drain(core)
        assert a.status == RequestStatus.FINISHED_LENGTH
        assert a.output_token_ids == reference[tuple(A)]
        assert a.num_tier_cached_tokens == 96
        settle(llm)
    finally:
        disk.open()
        llm.close()


def test_same_prefix_is_loaded_once(tmp_path, page_bytes, reference):
    llm = small_llm(page_bytes)
    disk, store = slow_store(tmp_path, page_bytes)
    conn = llm.core.attach_tiers(store)
    core = llm.core
    try:
        run(llm, A)
        settle(llm)
        evict_a(llm, reference)
        loads = conn.counters["loads"]
        disk.read_gate.clear()
        reqs = [llm.inputs.make_request(f"a{i}", A, GREEDY) for i in range(2)]
        for r in reqs:
            core.add_request(r)
        for _ in range(10):
            core.step()
        assert conn.counters["loads"] == loads + 1  # the second waits for the first's load
        assert all(r.status == RequestStatus.WAITING for r in reqs)
        disk.open()
        drain(core)
        for r in reqs:
            assert r.output_token_ids == reference[tuple(A)]
        # whichever lookup came back first loaded; the other hit what it loaded on the device
        assert sorted(r.num_tier_cached_tokens for r in reqs) == [0, 96]
        assert [r.num_cached_tokens for r in reqs] == [96, 96]
        assert conn.counters["loads"] == loads + 1
        settle(llm)
    finally:
        disk.open()
        llm.close()


def test_finished_load_releases_rows_though_the_queue_head_is_stuck(tmp_path, page_bytes,
                                                                    reference, monkeypatch):
    llm = small_llm(page_bytes)
    disk, store = slow_store(tmp_path, page_bytes)
    conn = llm.core.attach_tiers(store)
    core = llm.core
    try:
        run(llm, A)
        settle(llm)
        evict_a(llm, reference)
        disk.read_gate.clear()
        a = llm.inputs.make_request("a", A, GREEDY)
        core.add_request(a)
        deadline = time.monotonic() + 10
        while ("a" not in conn._reqs or conn._reqs["a"].phase != "load") and \
                time.monotonic() < deadline:
            core.step()
        # a holds 6 of the 16 blocks; a long request jumps to the head and cannot fit beside it
        monkeypatch.setattr(tiering, "MAX_ROUNDS", 0)  # it asks no tier: the head just waits
        big = prompt(7, 200)
        b = llm.inputs.make_request("b", big, GREEDY)
        core.add_request(b)
        core.scheduler.waiting.remove(b)
        core.scheduler.waiting.appendleft(b)
        core.step()
        assert b.status == RequestStatus.WAITING
        disk.open()
        deadline = time.monotonic() + 10
        while b.status == RequestStatus.WAITING and time.monotonic() < deadline:
            core.step()
        assert b.status != RequestStatus.WAITING, "a's finished load kept its rows"
        drain(core)
        assert a.output_token_ids == reference[tuple(A)]
        ref_big = make_llm(enable_prefix_caching=False).generate(big, GREEDY)[0].token_ids
        assert b.output_token_ids == ref_big
        settle(llm)
    finally:
        disk.open()
        llm.close()


def test_abort_during_load_keeps_rows_until_the_load_ends(tmp_path, page_bytes, reference):
    llm = small_llm(page_bytes)
    disk, store = slow_store(tmp_path, page_bytes)
    conn = llm.core.attach_tiers(store)
    core = llm.core
    try:
        run(llm, A)
        settle(llm)
        evict_a(llm, reference)
        disk.read_gate.clear()  # lookups answer, loads hang
        a = llm.inputs.make_request("a", A, GREEDY)
        core.add_request(a)
        deadline = time.monotonic() + 10
        while (a.request_id not in conn._reqs or conn._reqs["a"].phase != "load") and \
                time.monotonic() < deadline:
            core.step()
        assert conn._reqs["a"].phase == "load" and not conn._reqs["a"].handle.done()
        assert core.kv.num_free_blocks == core.kv.num_blocks - 6  # a holds the rows
        core.abort("a")
        assert conn.num_inflight == 0 and conn.num_held_blocks == 6
        assert core.kv.num_free_blocks == core.kv.num_blocks - 6  # still held: being written
        disk.open()
        deadline = time.monotonic() + 10
        while conn.num_held_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
            core.idle()
        assert core.kv.num_free_blocks == core.kv.num_blocks
        # the aborted load cached nothing: A's blocks are not hittable on the device
        assert not any(h in core.kv.pool.cached[0] for h in hash_chain(A, BS)[:6])
        assert run(llm, A).token_ids == reference[tuple(A)]
    finally:
        disk.open()
        llm.close()


def test_session_pause_registers_prefetch(page_bytes, reference):
    llm = small_llm(page_bytes, host_cache_memory=str(page_bytes * 64))
    core = llm.core
    try:
        r = llm.inputs.make_request("s1", A, GREEDY, session_id="sess")
        core.add_request(r)
        while core.has_work():
            core.step()
        assert r.output_token_ids == reference[tuple(A)]
        assert core.tiers.counters["session_pauses"] == 1
        assert "sess" in core.tiers.store.sessions.paused
        settle(llm)
    finally:
        llm.close()


def test_paused_session_is_prefetched_into_host_before_its_return(tmp_path, page_bytes,
                                                                   reference):
    llm = small_llm(page_bytes, host_cache_memory=str(page_bytes * 64),
                    disk_cache_dir=str(tmp_path / "kv"), disk_cache_size=str(page_bytes * 256))
    core = llm.core
    conn = core.tiers
    host = conn.store.host
    keys = conn.keyspaces[0].keys(hash_chain(A, BS)[:6])

    def turn(i):
        r = llm.inputs.make_request(f"t{i}", A, GREEDY, session_id="sess")
        core.add_request(r)
        drain(core)
        assert r.output_token_ids == reference[tuple(A)]

    try:
        turn(0)
        time.sleep(0.3)  # think time, learned when the next turn arrives
        turn(1)
        settle(llm)
        host.clear()  # the pause pushed the session's pages out of host memory
        assert not any(host.contains(keys))
        deadline = time.monotonic() + 5
        while not all(host.contains(keys)) and time.monotonic() < deadline:
            time.sleep(0.02)
            core.idle()  # the engine polls prefetches every step and while idle
        assert all(host.contains(keys)), "the session's pages were not prefetched"
        assert conn.store.counters["prefetches"] >= 1
    finally:
        llm.close()


# -- shared pool ------------------------------------------------------------------------------
def test_mooncake_shared_pool_cross_instance(mooncake_service, page_bytes, reference):
    remote = f"mooncake://{mooncake_service.master_address}"
    one = small_llm(page_bytes, remote_cache=remote)
    two = small_llm(page_bytes, remote_cache=remote)
    try:
        assert run(one, A).token_ids == reference[tuple(A)]
        settle(one)
        out = run(two, A)
        assert out.token_ids == reference[tuple(A)]
        assert out.num_tier_cached_tokens == 96
        assert two.core.stats().prefix_hit_tokens_by_source["mooncake"] == 96
        settle(two)
    finally:
        one.close()
        two.close()


def test_mooncake_master_killed_mid_run(tmp_path, page_bytes, reference):
    require_mooncake()
    from loomserve.control.store_launcher import MooncakeService
    svc = MooncakeService(segment_bytes=64 << 20, log_dir=tmp_path).start()
    llm = small_llm(page_bytes, remote_cache=f"mooncake://{svc.master_address}")
    try:
        assert run(llm, A).token_ids == reference[tuple(A)]
        settle(llm)
        svc.kill_master()
        svc.kill_client()
        evict_a(llm, reference)
        out = run(llm, A)
        assert out.token_ids == reference[tuple(A)]
        assert out.num_tier_cached_tokens == 0
        tier = llm.core.tiers.store.tier("mooncake")
        assert not tier.stats.healthy
        assert llm.core.stats().tiers["tiers"]["mooncake"]["healthy"] is False
    finally:
        llm.close()
        svc.stop()


def test_redis_killed_mid_run(page_bytes, reference):
    require_redis()
    from loomserve.control.store_launcher import RedisService
    svc = RedisService().start()
    llm = small_llm(page_bytes, remote_cache=svc.url)
    try:
        assert run(llm, A).token_ids == reference[tuple(A)]
        settle(llm)
        evict_a(llm, reference)
        hit = run(llm, A)
        assert hit.token_ids == reference[tuple(A)] and hit.num_tier_cached_tokens == 96
        svc.kill()
        evict_a(llm, reference)
        out = run(llm, A)
        assert out.token_ids == reference[tuple(A)] and out.num_tier_cached_tokens == 0
        assert not llm.core.tiers.store.tier("redis").stats.healthy
    finally:
        llm.close()
        svc.stop()


# -- config -----------------------------------------------------------------------------------
def test_tiers_off_by_default():
    llm = make_llm()
    assert llm.core.tiers is None and llm.core.scheduler.tiers is None
    assert llm.core.stats().prefix_hit_tokens_by_source == {"device": 0}


def test_hybrid_model_gets_tiers():
    import os

    from loomserve import LLM
    from tests.execution.conftest import FIXTURES
    llm = LLM(os.path.join(FIXTURES, "tiny-qwen3-next"), kv_cache_memory="8MiB",
              host_cache_memory="8MiB")
    try:
        assert llm.core.tiers is not None  # end to end: tests/kv/tiers/test_hybrid_tiers.py
    finally:
        llm.close()


def test_untiered_layer_kind_disables_tiers(caplog, monkeypatch):
    import os

    from loomserve import LLM
    from tests.execution.conftest import FIXTURES
    monkeypatch.setattr(tiering, "TIERED_KINDS", frozenset({"full_attention"}))
    with caplog.at_level("WARNING"):
        llm = LLM(os.path.join(FIXTURES, "tiny-qwen3-next"), kv_cache_memory="8MiB",
                  host_cache_memory="8MiB")
    assert llm.core.tiers is None
    assert "KV tiers disabled" in caplog.text


def test_serve_flags_reach_engine_config(tmp_path):
    from loomserve.entrypoints.cli import build_parser, engine_config_from_args
    args = build_parser().parse_args([
        "serve", "--host-cache-memory", "1GiB", "--disk-cache-dir", str(tmp_path),
        "--disk-cache-size", "2GiB", "--remote-cache", "mooncake://127.0.0.1:50051",
        "--tier-write-after-seen", "2", "--tier-max-inflight", "4"])
    cfg = engine_config_from_args(args).tier
    assert (cfg.host_cache_memory, cfg.disk_cache_dir, cfg.disk_cache_size, cfg.remote_cache,
            cfg.tier_write_after_seen, cfg.tier_max_inflight) == (
        1 << 30, str(tmp_path), 2 << 30, "mooncake://127.0.0.1:50051", 2, 4)
    assert cfg.enabled and cfg.remote_scheme == "mooncake"
    assert cfg.remote_address == "127.0.0.1:50051"
    defaults = engine_config_from_args(build_parser().parse_args(["serve"]))
    assert not defaults.tier.enabled
    with pytest.raises(ValueError):
        type(cfg)(remote_cache="http://x")
    with pytest.raises(ValueError):
        type(cfg)(host_cache_memory="0.5")
