"""The engine with KV tiers below its device pool (loomserve.kv.connector), on the tiny Llama
fixture with a device pool of a few blocks and real tiers (host memory, local disk, Mooncake
Store, Redis): evicted prefixes come back from a tier, outputs stay token-for-token equal to a
run without any cache, and faults degrade to recompute. The connector's own behaviours (slow
tiers, aborted loads, sessions) are tested in tests/kv/connector."""

from __future__ import annotations

import pytest

from loomserve.kv.connector import factory
from loomserve.kv.hashing import hash_chain
from tests.execution.conftest import make_llm
from tests.kv.connector.conftest import (
    BS,
    A,
    evict_a,
    reference_outputs,
    run,
    settle,
    small_llm,
    tiny_page_bytes,
)

# Fixtures shared with the tier tests (pytest finds them by name in this module).
from tests.kv.tiers.conftest import mooncake_service, require_mooncake, require_redis  # noqa: F401


@pytest.fixture(scope="module")
def reference():
    return reference_outputs()


@pytest.fixture(scope="module")
def page_bytes(reference):
    return tiny_page_bytes()


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


# -- shared pool ------------------------------------------------------------------------------
def test_mooncake_shared_pool_cross_instance(mooncake_service, page_bytes, reference):  # noqa: F811
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
    monkeypatch.setattr(factory, "TIERED_KINDS", frozenset({"full_attention"}))
    with caplog.at_level("WARNING"):
        llm = LLM(os.path.join(FIXTURES, "tiny-qwen3-next"), kv_cache_memory="8MiB",
                  host_cache_memory="8MiB")
    assert llm.core.tiers is None
    assert "KV tiers disabled" in caplog.text


def test_serve_flags_reach_engine_config(tmp_path):
    from loomserve.cli import build_parser, engine_config_from_args
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
