"""KV tiers under hybrid models (loomserve.kv.connector): sliding-window blocks and linear/SSM
state checkpoints are written down and loaded back like full-attention blocks.

The tiny hybrid fixtures run with a device pool too small to keep a session between its
turns: the second turn's prefix comes back from the host (or disk) tier, with the hit the
device coordinator would allow (every attention block, the last window, the state checkpoint
at the boundary), and greedy outputs stay token-for-token equal to a run without any cache.
A state page that is missing or corrupt costs only recompute (or an earlier checkpoint)."""

from __future__ import annotations

import functools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loomserve import LLM, SamplingParams
from loomserve.kv.connector import loads
from loomserve.kv.hashing import hash_chain
from loomserve.kv.spec import LinearStateSpec
from loomserve.kv.tiers import codec
from tests.execution.models.conftest import FIXTURES
from tests.kv.tiers.conftest import mooncake_service, redis_service  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BS = 4
# Device pool sizes (pages): room for one turn or one other prompt, not for both.
POOL = {"tiny-qwen3-next": 24, "tiny-nemotron-h": 24, "tiny-gemma3": 60,
        "tiny-mistral-swa": 22, "tiny-gpt-oss": 40, "tiny-qwen3-5": 24, "tiny-qwen3-5-moe": 24,
        "tiny-qwen3-moe": 20, "tiny-glm4-moe": 20, "tiny-minimax-m2": 20}
STATE_MODELS = ["tiny-qwen3-next", "tiny-nemotron-h"]
# the models agents run (issue 44): the main round trip only, the fallbacks are the state
# manager's and are covered by the two above
MODELS = STATE_MODELS + ["tiny-gemma3", "tiny-gpt-oss", "tiny-mistral-swa", "tiny-qwen3-5",
                         "tiny-qwen3-5-moe", "tiny-qwen3-moe", "tiny-glm4-moe", "tiny-minimax-m2"]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(n)]


TURN1 = tokens(40, 1)
OTHERS = [tokens(60, s) for s in (10, 11)]


def make(name: str, pages: int | None = None, **kw) -> LLM:
    if pages is not None:
        probe = LLM(str(FIXTURES / name), dtype="float32", device="cpu", block_size=BS,
                    kv_cache_memory="1MiB")
        kw["kv_cache_memory"] = str(probe.core.runner.kv_cache_config.page_bytes * pages)
    kw.setdefault("kv_cache_memory", "1MiB")
    return LLM(str(FIXTURES / name), dtype="float32", device="cpu", block_size=BS, **kw)


@functools.lru_cache(maxsize=None)
def reference(name: str) -> dict:
    """Outputs without any cache: turn 1, the turn 2 prompt (turn 1 + its answer + a new
    message), turn 2, the other traffic."""
    ref = make(name, enable_prefix_caching=False)
    out1 = ref.generate(TURN1, GREEDY)[0].token_ids
    turn2 = TURN1 + out1 + tokens(6, 2)
    out2 = ref.generate(turn2, GREEDY)[0].token_ids
    others = [ref.generate(p, GREEDY)[0].token_ids for p in OTHERS]
    return {"out1": out1, "turn2": turn2, "out2": out2, "others": others}


@pytest.fixture(params=MODELS)
def model(request):
    return request.param, reference(request.param)


@pytest.fixture(params=STATE_MODELS)
def state_model(request):
    return request.param, reference(request.param)


def run_turn(llm: LLM, rid: str, prompt: list[int]):
    core = llm.core
    req = llm.inputs.make_request(rid, prompt, GREEDY, session_id="sess")
    core.add_request(req)
    deadline = time.monotonic() + 60
    while core.has_work() and time.monotonic() < deadline:
        core.step()
    assert req.status.finished
    return req


def settle(llm: LLM) -> None:
    """Offer what the last frees hashed, wait for every store, release the rows they held."""
    conn = llm.core.tiers
    deadline = time.monotonic() + 10
    while True:
        llm.core.idle()
        assert conn.store.flush(10)
        llm.core.idle()
        if conn.num_held_blocks == 0 or time.monotonic() > deadline:
            break
    assert conn.num_held_blocks == 0
    assert llm.core.kv.num_free_blocks == llm.core.kv.num_blocks - \
        (llm.core.kv.pool.null_block is not None)


def evict(llm: LLM, ref: dict) -> None:
    """Other traffic pushes turn 1 out of the device pool."""
    for p, out in zip(OTHERS, ref["others"]):
        assert llm.generate(p, GREEDY)[0].token_ids == out
    first = hash_chain(TURN1, BS)[0]
    assert not any(first in c for c in llm.core.kv.pool.cached), "turn 1 still on device"


def expected_boundary(ref: dict) -> int:
    """Turn 1 computed its prompt and all outputs but the last: its blocks (and, for state
    models, the end-of-sequence checkpoint) end there."""
    return (len(TURN1) + len(ref["out1"]) - 1) // BS


def state_group(llm: LLM) -> int:
    groups = llm.core.runner.kv_cache_config.groups
    return next(g for g, grp in enumerate(groups) if isinstance(grp.spec, LinearStateSpec))


def test_second_turn_prefix_comes_from_host_tier(model):
    name, ref = model
    llm = make(name, POOL[name], host_cache_memory="4MiB")
    try:
        first = run_turn(llm, "t1", TURN1)
        assert first.output_token_ids == ref["out1"]
        settle(llm)
        evict(llm, ref)
        settle(llm)
        second = run_turn(llm, "t2", ref["turn2"])
        assert second.output_token_ids == ref["out2"]
        hit = expected_boundary(ref) * BS
        assert second.num_cached_tokens == second.num_tier_cached_tokens == hit
        stats = llm.core.stats()
        assert stats.prefix_hit_tokens_by_source["host"] == hit
        conn = llm.core.tiers
        assert conn.counters["loads"] == 1 and conn.counters["short_loads"] == 0
        # exactly the pages the hit reads: every attention block, the last window, the
        # checkpoint at the boundary
        needed = sum(len(r) for r in llm.core.kv.hit_positions(hit // BS))
        assert conn.counters["loaded_blocks"] == needed
        kinds = {type(g.spec) for g in llm.core.runner.kv_cache_config.groups}
        if LinearStateSpec in kinds:  # the boundary checkpoint itself came from the tier
            g = state_group(llm)
            key = conn.keyspaces[g].key(hash_chain(ref["turn2"], BS)[hit // BS - 1])
            assert all(conn.store.host.contains([key]))
        # the loaded pages are ordinary device hits now
        third = run_turn(llm, "t3", ref["turn2"])
        assert third.output_token_ids == ref["out2"]
        assert third.num_cached_tokens >= hit and third.num_tier_cached_tokens == 0
        settle(llm)
    finally:
        llm.close()


def test_missing_boundary_checkpoint_falls_back_to_an_earlier_one(state_model):
    name, ref = state_model
    llm = make(name, POOL[name], host_cache_memory="4MiB")
    try:
        run_turn(llm, "t1", TURN1)
        settle(llm)
        evict(llm, ref)
        settle(llm)
        conn = llm.core.tiers
        g = state_group(llm)
        hashes = hash_chain(ref["turn2"], BS)
        end = expected_boundary(ref)
        conn.store.host.remove([conn.keyspaces[g].key(hashes[end - 1])])
        second = run_turn(llm, "t2", ref["turn2"])
        assert second.output_token_ids == ref["out2"]
        # interval retention kept a checkpoint at the end of turn 1's prompt
        assert second.num_tier_cached_tokens == second.num_cached_tokens == len(TURN1)
        settle(llm)
    finally:
        llm.close()


def test_corrupt_state_page_falls_back_to_an_earlier_checkpoint(tmp_path, state_model):
    name, ref = state_model
    llm = make(name, POOL[name], disk_cache_dir=str(tmp_path / "kv"), disk_cache_size="8MiB")
    try:
        run_turn(llm, "t1", TURN1)
        settle(llm)
        evict(llm, ref)
        settle(llm)
        conn = llm.core.tiers
        disk = conn.store.tier("disk")
        g = state_group(llm)
        end = expected_boundary(ref)
        path = disk.path_of(conn.keyspaces[g].key(hash_chain(ref["turn2"], BS)[end - 1]))
        data = bytearray(path.read_bytes())
        data[codec.HEADER_BYTES + 100] ^= 0xFF  # one flipped byte inside the state
        path.write_bytes(bytes(data))
        second = run_turn(llm, "t2", ref["turn2"])
        assert second.output_token_ids == ref["out2"]
        # The load toward the end checkpoint came up short (the attention blocks alone serve
        # no hit); the disk dropped the corrupt page, so a second round found the checkpoint
        # at the end of turn 1's prompt.
        assert conn.counters["short_loads"] == 1 and conn.counters["loads"] == 2
        assert disk.stats.corrupt >= 1
        assert second.num_tier_cached_tokens == second.num_cached_tokens == len(TURN1)
        settle(llm)
    finally:
        llm.close()


def test_corrupt_state_page_without_another_round_is_recomputed(tmp_path, state_model,
                                                               monkeypatch):
    name, ref = state_model
    monkeypatch.setattr(loads, "MAX_ROUNDS", 1)
    llm = make(name, POOL[name], disk_cache_dir=str(tmp_path / "kv"), disk_cache_size="8MiB")
    try:
        run_turn(llm, "t1", TURN1)
        settle(llm)
        evict(llm, ref)
        settle(llm)
        conn = llm.core.tiers
        disk = conn.store.tier("disk")
        end = expected_boundary(ref)
        g = state_group(llm)
        path = disk.path_of(conn.keyspaces[g].key(hash_chain(ref["turn2"], BS)[end - 1]))
        data = bytearray(path.read_bytes())
        data[codec.HEADER_BYTES + 100] ^= 0xFF
        path.write_bytes(bytes(data))
        second = run_turn(llm, "t2", ref["turn2"])
        assert second.output_token_ids == ref["out2"]
        assert second.num_cached_tokens == 0  # the attention blocks alone serve no hit
        assert conn.counters["short_loads"] == 1 and conn.counters["loads"] == 1
        settle(llm)
    finally:
        llm.close()


def test_disk_tier_serves_a_restarted_hybrid_engine(tmp_path, model):
    name, ref = model
    kw = dict(disk_cache_dir=str(tmp_path / "kv"), disk_cache_size="8MiB")
    llm = make(name, POOL[name], **kw)
    try:
        assert run_turn(llm, "t1", TURN1).output_token_ids == ref["out1"]
        settle(llm)
    finally:
        llm.close()
    fresh = make(name, POOL[name], **kw)
    try:
        second = run_turn(fresh, "t2", ref["turn2"])
        assert second.output_token_ids == ref["out2"]
        assert second.num_tier_cached_tokens == expected_boundary(ref) * BS
        assert fresh.core.stats().prefix_hit_tokens_by_source["disk"] == \
            expected_boundary(ref) * BS
    finally:
        fresh.close()


def test_device_attention_blocks_plus_tier_checkpoint(tmp_path, state_model, monkeypatch):
    """The device holds the prefix's attention blocks but no checkpoint on them (a request
    computed them and diverged): only the missing pages come from the tier, the device blocks
    complete the hit, they are not loaded again."""
    name, ref = state_model
    kw = dict(disk_cache_dir=str(tmp_path / "kv"), disk_cache_size="8MiB")
    llm = make(name, POOL[name], **kw)
    try:
        run_turn(llm, "t1", TURN1)
        settle(llm)
    finally:
        llm.close()
    fresh = make(name, POOL[name], **kw)
    try:
        fork = TURN1 + tokens(10, 5)  # shares turn 1's 10 prompt blocks, then diverges
        monkeypatch.setattr(loads, "MAX_ROUNDS", 0)  # computed, not loaded from the disk
        assert fresh.generate(fork, GREEDY)[0].num_cached_tokens == 0
        monkeypatch.setattr(loads, "MAX_ROUNDS", 2)
        settle(fresh)
        conn = fresh.core.tiers
        loaded = conn.counters["loaded_blocks"]
        fa = next(g for g, grp in enumerate(fresh.core.runner.kv_cache_config.groups)
                  if not isinstance(grp.spec, LinearStateSpec))
        prompt_blocks = hash_chain(TURN1, BS)
        assert all(h in fresh.core.kv.pool.cached[fa] for h in prompt_blocks)
        second = run_turn(fresh, "t2", ref["turn2"])
        assert second.output_token_ids == ref["out2"]
        end = expected_boundary(ref)
        assert second.num_tier_cached_tokens == end * BS
        # the attention blocks past turn 1's prompt and the state checkpoint at the end
        assert conn.counters["loaded_blocks"] - loaded == end - len(prompt_blocks) + 1
        settle(fresh)
    finally:
        fresh.close()


def test_session_pause_writes_the_end_checkpoint_before_it_is_seen_twice(state_model):
    """With write_after_seen=2 a page is not written on its first computation, but a pausing
    session writes what its next turn reads, including the state checkpoint that is hashed
    only when the turn's request is freed."""
    name, ref = state_model
    llm = make(name, POOL[name], host_cache_memory="4MiB", tier_write_after_seen=2)
    try:
        run_turn(llm, "t1", TURN1)
        settle(llm)
        conn = llm.core.tiers
        end = expected_boundary(ref)
        key = conn.keyspaces[state_group(llm)].key(hash_chain(ref["turn2"], BS)[end - 1])
        assert all(conn.store.host.contains([key]))
        evict(llm, ref)
        settle(llm)
        second = run_turn(llm, "t2", ref["turn2"])
        assert second.output_token_ids == ref["out2"]
        assert second.num_tier_cached_tokens == end * BS
        settle(llm)
    finally:
        llm.close()


@pytest.mark.parametrize("backend", ["mooncake", "redis"])
def test_shared_pool_serves_another_instance(backend, request):
    """One instance computes a Qwen3-Next turn; another (same weights) loads its attention
    blocks and state checkpoint from the shared pool."""
    name = "tiny-qwen3-next"
    ref = reference(name)
    if backend == "mooncake":
        svc = request.getfixturevalue("mooncake_service")
        remote = f"mooncake://{svc.master_address}"
    else:
        remote = request.getfixturevalue("redis_service").url
    one = make(name, POOL[name], remote_cache=remote)
    two = make(name, POOL[name], remote_cache=remote)
    try:
        assert run_turn(one, "t1", TURN1).output_token_ids == ref["out1"]
        settle(one)
        second = run_turn(two, "t2", ref["turn2"])
        assert second.output_token_ids == ref["out2"]
        assert second.num_tier_cached_tokens == expected_boundary(ref) * BS
        assert two.core.stats().prefix_hit_tokens_by_source[backend] == \
            expected_boundary(ref) * BS
        settle(two)
    finally:
        one.close()
        two.close()


# -- the boundary a tier can serve ------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.data())
def test_tier_boundary_is_the_coordinators_fixed_point(data):
    """Whatever pages the device and the tiers hold, the boundary the connector loads toward
    is the hit the device coordinator finds once those tier pages are cached on the device."""
    import torch

    from loomserve.kv.cache_manager import KVCacheManager
    from loomserve.kv.connector import TierConnector
    from loomserve.kv.tiers import HostTier, TieredStore
    from tests.kv.conftest import make_hybrid_config

    window = data.draw(st.sampled_from([0, 5, 8, 13]), label="window")
    state = data.draw(st.booleans(), label="state")
    full = data.draw(st.booleans(), label="full") or not (window or state)
    num_pos = data.draw(st.integers(1, 12), label="blocks")
    config = make_hybrid_config(200, window=window, state=state, full=full)
    kv = KVCacheManager(config)
    store = TieredStore([HostTier(1 << 20, config.page_bytes)])
    conn = TierConnector(kv, store, torch.zeros(1, config.page_bytes, dtype=torch.uint8), "m")
    try:
        hashes = [bytes([i]) * 16 for i in range(num_pos)]
        groups = range(len(config.groups))
        pages = st.sets(st.tuples(st.sampled_from(list(groups)), st.integers(0, num_pos - 1)))
        device = data.draw(pages, label="device")
        tier = data.draw(pages, label="tier")
        for g, p in sorted(device):
            (b,) = kv.pool.allocate(1)
            kv.pool.cache_blocks(g, [b], [hashes[p]])
        cap = num_pos
        n = kv.coordinator.find_longest_hit(hashes, cap).num_blocks
        b = conn.loads.best_boundary(hashes, n, cap, tier)
        wanted = set(conn.loads.wanted(hashes, n, cap))
        for g, p in sorted(tier - device):
            (blk,) = kv.pool.allocate(1)
            kv.pool.cache_blocks(g, [blk], [hashes[p]])
        assert b == kv.coordinator.find_longest_hit(hashes, cap).num_blocks
        if b > n:  # every page the load reads past the device was looked up
            need = {(g, p) for g, r in enumerate(kv.hit_positions(b)) for p in r}
            assert need - device <= wanted
    finally:
        store.close()
