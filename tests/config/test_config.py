"""EngineConfig: flat option names route to their part; sizes and policies are parsed once."""

import pytest

from loomserve.config import EngineConfig, MemoryBudget, flat_fields, parse_memory


def test_flat_names_route_to_parts_and_parse_once():
    cfg = EngineConfig.from_kwargs(block_size=32, kv_cache_memory="2GiB", max_num_seqs=4,
                                   retention="marconi", session_pin_budget="1MiB",
                                   host_cache_memory="8MiB", dtype="bfloat16")
    assert cfg.cache.block_size == 32 and cfg.scheduler.max_num_seqs == 4
    assert cfg.cache.kv_cache_memory == MemoryBudget(bytes=2 << 30)
    assert cfg.cache.retention == ("marconi",) and cfg.cache.session_pin_budget == 1 << 20
    assert cfg.tier.host_cache_memory == 8 << 20 and cfg.model.dtype == "bfloat16"
    assert EngineConfig.from_kwargs(retention="none").cache.retention == ()
    assert cfg.replace(block_size=8).cache.block_size == 8 and cfg.cache.block_size == 32


def test_every_flat_name_has_one_owner():
    owners = flat_fields()
    assert owners["block_size"] == "cache" and owners["remote_cache"] == "tier"
    assert owners["max_waiting_requests"] == "scheduler" and owners["dtype"] == "model"


@pytest.mark.parametrize("kwargs", [
    {"block_size": 12}, {"kv_cache_memory": "lots"}, {"retention": "sometimes"},
    {"eviction": "random"}, {"session_pin_budget": "0.5"}, {"remote_cache": "http://x"},
    {"dtype": "int3"},
    {"data_parallel_size": 2, "tensor_parallel_size": 2, "enable_expert_parallel": True},
    {"prefill_context_parallel_size": 2, "decode_context_parallel_size": 2},
    {"tensor_parallel_size": 0},
    {"node_rank": 1}, {"max_num_seqs": 0}])
def test_bad_values_fail_at_construction(kwargs):
    with pytest.raises(ValueError):
        EngineConfig.from_kwargs(**kwargs)


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="unknown engine option 'blok_size'"):
        EngineConfig.from_kwargs(blok_size=16)


def test_memory_budget_units():
    assert parse_memory("0.3").fraction == 0.3
    assert parse_memory("500MB").bytes == 500_000_000
    assert parse_memory("1.5GiB").resolve(0) == 3 << 29
    assert parse_memory("0.5").resolve(1000) == 500
