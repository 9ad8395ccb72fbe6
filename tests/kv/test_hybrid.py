"""Hybrid groups: sliding window, linear-state checkpoints, retention, eviction, pinning."""


from loomserve.kv.cache_manager import KVCacheManager, RetentionConfig
from loomserve.kv.eviction import FlopModel
from tests.kv.conftest import Req, make_config, make_hybrid_config

BS = 4


def run(kv, req, chunk=None):
    """Admit req (prefix hit + first chunk) and compute its whole prompt, chunk by chunk.
    Returns (hit tokens, directives of every step)."""
    hit, n_hit = kv.get_computed_blocks(req)
    n = len(req.all_token_ids) - n_hit
    first = n if chunk is None else min(chunk, n)
    assert kv.allocate_slots(req, first, hit, n_hit)
    req.num_computed_tokens = n_hit + first
    dirs = [kv.state_directives(req)]
    while req.num_computed_tokens < len(req.all_token_ids):
        k = min(chunk, len(req.all_token_ids) - req.num_computed_tokens)
        assert kv.allocate_slots(req, k)
        req.num_computed_tokens += k
        dirs.append(kv.state_directives(req))
    return n_hit, dirs


def test_pure_attention_has_no_directives():
    kv = KVCacheManager(make_config(16))
    a = Req("a", list(range(10)))
    run(kv, a)
    assert kv.state_directives(a) == {} and not kv.has_state_groups
    assert kv.pool.null_block is None


def test_state_end_of_sequence_checkpoint_and_hit():
    kv = KVCacheManager(make_hybrid_config(32))
    g = kv.state_groups[0]
    a = Req("a", list(range(10)))
    _, dirs = run(kv, a)
    d = dirs[0][g]
    assert d.zero_init and d.init_from is None
    assert [n for n, _ in d.saves] == [8]  # tail: the last boundary crossed
    assert kv.get_block_ids("a")[g] == [d.running_block]
    # Nothing hittable in the state group until a's step has run (a is freed after it ran).
    b = Req("b", list(range(10)) + [50])
    assert kv.get_computed_blocks(b)[1] == 0
    kv.free(a)
    hit, n = kv.get_computed_blocks(b)
    assert n == 8
    ckpt = hit.blocks[g][-1]
    assert ckpt.block_id == d.saves[0][1]
    assert kv.allocate_slots(b, 3, hit, n)
    db = kv.state_directives(b)[g]
    assert db.init_from == ckpt.block_id and not db.zero_init and db.running_block != ckpt.block_id
    # The checkpoint is referenced until b's next allocation (the copy has run by then).
    assert ckpt.ref_cnt == 1
    b.num_computed_tokens = 11
    b.all_token_ids.append(7)
    assert kv.allocate_slots(b, 1)
    assert ckpt.ref_cnt == 0 and ckpt.block_hash is not None
    kv.free(b)
    assert kv.pool.num_used_blocks == 0


def test_hit_lowered_to_checkpoint_and_marconi_saves_at_fa_boundary():
    ret = RetentionConfig(marconi=True)
    kv = KVCacheManager(make_hybrid_config(64), retention=ret)
    g = kv.state_groups[0]
    base = list(range(40))
    a = Req("a", base[:22])
    run(kv, a)
    kv.free(a)  # checkpoint at 20 (end of sequence)
    # b shares 30 tokens with nothing... a fork: shares a's first 16 tokens then diverges.
    b = Req("b", base[:16] + [99] * 10)
    hit, n = kv.get_computed_blocks(b)
    assert hit.attn_blocks == 4 and n == 0  # FA hits 16 tokens, no checkpoint at 16
    assert kv.allocate_slots(b, len(b.all_token_ids), hit, n)
    saves = [s for s, _ in kv.state_directives(b)[g].saves]
    assert 16 in saves  # Marconi: keep the state at the FA-hit boundary
    b.num_computed_tokens = len(b.all_token_ids)
    kv.free(b)
    c = Req("c", base[:16] + [77] * 10)
    assert kv.get_computed_blocks(c)[1] == 16


def test_no_marconi_no_save_at_fork():
    kv = KVCacheManager(make_hybrid_config(64))
    base = list(range(40))
    a = Req("a", base[:22])
    run(kv, a)
    kv.free(a)
    b = Req("b", base[:16] + [99] * 10)
    run(kv, b)
    kv.free(b)
    c = Req("c", base[:16] + [77] * 10)
    assert kv.get_computed_blocks(c)[1] == 0


def test_interval_saves_prompt_end_inside_chunks():
    ret = RetentionConfig(interval=True, every_n_tokens=8)
    kv = KVCacheManager(make_hybrid_config(64), retention=ret)
    g = kv.state_groups[0]
    a = Req("a", list(range(30)), num_prompt_tokens=30)
    _, dirs = run(kv, a, chunk=10)
    saves = [n for d in dirs for n, _ in d[g].saves]
    # every 8 tokens: 8, 16, 24; prompt end: 28; tail boundaries already covered except none.
    assert {8, 16, 24, 28} <= set(saves)
    for d in dirs:
        for n, _ in d[g].saves:
            assert n % BS == 0
    kv.free(a)
    b = Req("b", list(range(17)) + [5, 5, 5])
    assert kv.get_computed_blocks(b)[1] == 16


def test_max_checkpoints_per_path():
    ret = RetentionConfig(interval=True, every_n_tokens=4, max_checkpoints_per_path=2)
    kv = KVCacheManager(make_hybrid_config(64), retention=ret)
    g = kv.state_groups[0]
    a = Req("a", list(range(30)))
    _, dirs = run(kv, a)
    d = dirs[0][g]
    # 2 kept: the prompt end (28, also the last boundary: no separate tail) and the latest
    # every-n boundary before it.
    assert [n for n, _ in d.saves] == [24, 28]


def test_sliding_window_frees_out_of_window_blocks_and_hits_need_window():
    kv = KVCacheManager(make_hybrid_config(64, window=6, state=False))
    null = kv.pool.null_block
    assert null is not None
    a = Req("a", list(range(24)))
    run(kv, a, chunk=4)
    ids = kv.get_block_ids("a")[1]
    # the last chunk started at 20, whose window starts at 15: blocks 0..2 went back
    assert ids[:3] == [null.block_id] * 3 and null.block_id not in ids[3:]
    a.all_token_ids.append(7)
    assert kv.allocate_slots(a, 1)  # token 24 sees 19..24: block 3 goes back too
    assert ids[:4] == [null.block_id] * 4 and null.block_id not in ids[4:]
    a.num_computed_tokens += 1
    assert null.ref_cnt == 0
    kv.free(a)
    b = Req("b", list(range(24)) + [1])
    hit, n = kv.get_computed_blocks(b)
    assert n == 24
    assert hit.blocks[1][:4] == [null] * 4
    # Evict a block inside the window of boundary 24 (block 5): the hit must drop to a boundary
    # whose window is cached. Full attention still has all blocks.
    blk = kv.pool.cached[1][b.block_hashes[4]]
    kv.pool.free_queue.remove(blk)
    kv.pool.free_queue.appendleft(blk)
    kv.pool.allocate(1)
    kv.pool.free([blk])
    hit, n = kv.get_computed_blocks(b)
    assert n == 16  # boundary 16 needs blocks 2,3 (tokens 11..15): still cached


def test_hybrid_all_or_nothing():
    kv = KVCacheManager(make_hybrid_config(8, window=8))
    a = Req("a", list(range(40)))
    hit, n = kv.get_computed_blocks(a)
    free = kv.num_free_blocks
    assert not kv.allocate_slots(a, 40, hit, n)
    assert kv.num_free_blocks == free and kv.get_block_ids("a") == [[], [], []]
    assert not kv.coordinator.state_managers[0].states


def test_pages_for_hashes_and_request_pages():
    kv = KVCacheManager(make_hybrid_config(32))
    a = Req("a", list(range(10)))
    run(kv, a)
    pages = kv.request_pages(a)
    assert {g for g, _ in pages} == {0, 1}
    kv.free(a)
    got = kv.pages_for_hashes(a.block_hashes)
    assert sorted(got) == sorted([(0, kv.pool.cached[0][h].block_id) for h in a.block_hashes]
                                 + [(1, kv.pool.cached[1][a.block_hashes[1]].block_id)])


def test_flop_aware_keeps_long_checkpoint_over_recent_cheap_block():
    fm = FlopModel(linear_flops_per_token=1.0, attn_flops_per_pair=0.0)
    kv = KVCacheManager(make_config(6), eviction="flop_aware", flop_model=fm,
                        eviction_alpha=100.0)
    ev = kv.pool.evictor
    a = Req("a", list(range(12)))
    run(kv, a)
    kv.free(a)
    # blocks 0,1,2 free, hashed; utility grows with position (own tokens same cost): equal
    # flops per block here, so recency decides: tail first.
    order = [ev.pop() for _ in range(3)]
    assert [b.block_hash for b in order] == list(reversed(a.block_hashes))


def test_flop_aware_eviction_prefers_cheap_blocks():
    fm = FlopModel(linear_flops_per_token=1.0, attn_flops_per_pair=0.0)
    kv = KVCacheManager(make_hybrid_config(40), eviction="flop_aware", flop_model=fm,
                        eviction_alpha=1000.0)
    g = kv.state_groups[0]
    a = Req("a", list(range(34)))
    run(kv, a)
    kv.free(a)  # checkpoint at 32 tokens, worth far more than a 4-token KV block
    ckpt = kv.pool.cached[g][a.block_hashes[7]]
    ckpt.saved_flops > 0
    # Fill the pool with fresh requests: the checkpoint must outlive the cheap KV blocks.
    for i in range(3):
        r = Req(f"x{i}", [1000 + 100 * i + t for t in range(8)])
        run(kv, r)
        kv.free(r)
    assert kv.pool.cached[g].get(a.block_hashes[7]) is ckpt


def test_session_pinning_ttl_budget_and_end():
    now = [0.0]
    ret = RetentionConfig(pin_ttl_s=10.0, pin_budget_bytes=10 ** 9)
    kv = KVCacheManager(make_hybrid_config(16), retention=ret, clock=lambda: now[0])
    g = kv.state_groups[0]
    a = Req("a", list(range(10)), session_id="S")
    run(kv, a)
    kv.free(a)
    pinned = kv.pins.blocks("S")
    assert len(pinned) == 3 and all(b.ref_cnt == 1 for b in pinned)  # FA 0,1 + ckpt at 8
    # Pinned blocks survive a pool-filling request.
    big = Req("big", [500 + t for t in range(48)])
    hit, n = kv.get_computed_blocks(big)
    assert not kv.allocate_slots(big, 48, hit, n)
    filler = Req("f", [900 + t for t in range(44)])
    assert kv.allocate_slots(filler, 44)  # 11 FA + running + tail = 13 of 16 - 3 pinned
    kv.free(filler)
    b = Req("b", list(range(10)) + [3], session_id="S")
    assert kv.get_computed_blocks(b)[1] == 8
    now[0] = 11.0
    kv.allocate_slots(Req("t", [1]), 1)  # lazy expiry on allocation
    assert len(kv.pins) == 0 and all(blk.ref_cnt == 0 for blk in pinned)
    kv.free(Req("t", [1]))
    a2 = Req("a2", list(range(10)), session_id="S")
    run(kv, a2)
    kv.free(a2)
    assert len(kv.pins) == 1
    kv.end_session("S")
    assert len(kv.pins) == 0 and kv.pool.num_used_blocks == 0
    assert kv.pool.cached[g]  # released, not dropped: still hittable


def test_pin_budget_drops_oldest_session():
    ret = RetentionConfig(pin_ttl_s=100.0, pin_budget_bytes=1)  # < one page: pins nothing
    kv = KVCacheManager(make_hybrid_config(16), retention=ret)
    a = Req("a", list(range(10)), session_id="S")
    run(kv, a)
    kv.free(a)
    assert len(kv.pins) == 0
    page = kv.config.page_bytes
    kv = KVCacheManager(make_hybrid_config(32), retention=RetentionConfig(
        pin_ttl_s=100.0, pin_budget_bytes=4 * page))
    for s, base in (("S", 0), ("T", 100)):
        r = Req(s, [base + t for t in range(10)], session_id=s)
        run(kv, r)
        kv.free(r)
    assert list(kv.pins._pins) == ["T"] and kv.pins.num_pinned == 3


def test_scheduler_passes_state_directives():
    from loomserve.engine.sched.request import Request
    from loomserve.engine.sched.scheduler import Scheduler
    from loomserve.sampling_params import SamplingParams
    kv = KVCacheManager(make_hybrid_config(64))
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4)
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    sched.add(Request("r", list(range(10)), p, 3))
    out = sched.schedule()
    seq = out.model_input.seqs[0]
    d = seq.states[kv.state_groups[0]]
    assert d.zero_init and seq.block_ids[kv.state_groups[0]] == [d.running_block]


def test_refresh_prefix_on_hybrid_groups_keeps_counts_and_hits():
    """Sliding (null blocks before the window) and state groups (None before the checkpoint):
    refreshing an arrived turn's prefix takes no reference and changes no hit."""
    kv = KVCacheManager(make_hybrid_config(48, window=8))
    a = Req("a", list(range(30)))
    run(kv, a)
    kv.free(a)
    nxt = Req("a2", list(range(30)) + [99, 98])
    free, hit = kv.num_free_blocks, kv.get_computed_blocks(nxt, record_stats=False)[1]
    assert hit > 0 and kv.refresh_prefix(nxt) > 0
    assert kv.num_free_blocks == free
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks if b is not kv.pool.null_block)
    assert kv.get_computed_blocks(nxt, record_stats=False)[1] == hit
