"""Property test for hybrid pools: full attention + sliding window + linear-state checkpoints.

Random traffic (chunked prefills, decode, forks of earlier prompts, preemption, sessions) under
both eviction policies, with retention policies and session pinning. Invariants:
- no leak, no double free: every block's reference count equals its live holders (requests'
  attention blocks, state pages: running, claimed checkpoint, tail, pending saves; pins); the
  null block is never referenced nor free;
- hits are exact: attention hit blocks hold the tokens of their positions; the state hit is a
  checkpoint holding the state after exactly the hit tokens (shadowed from the save directives);
- the FLOP-aware heap holds a live entry for every hashed free block.
"""

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from loomserve.kv.cache_manager import KVCacheManager, RetentionConfig
from loomserve.kv.eviction import FlopModel
from tests.kv.conftest import make_hybrid_config
from tests.kv.test_stateful import BS, KVMachine


class HybridMachine(KVMachine):
    num_groups = 3
    num_blocks = 48
    eviction = "lru"
    retention = RetentionConfig(interval=True, every_n_tokens=12, marconi=True,
                                max_checkpoints_per_path=2)

    def __init__(self):
        super().__init__()
        self.now = [0.0]
        self.kv = KVCacheManager(make_hybrid_config(self.num_blocks, BS, window=7),
                                 retention=self.retention, eviction=self.eviction,
                                 flop_model=FlopModel(1.0, 0.5), eviction_alpha=2.0,
                                 clock=lambda: self.now[0])
        self.sg = self.kv.state_groups[0]
        self.null = self.kv.pool.null_block.block_id

    def _check_hit(self, req, hit, n_hit):
        assert n_hit % BS == 0 and n_hit <= max(0, len(req.all_token_ids) - 1)
        if n_hit == 0:
            return
        for g, group in enumerate(hit.blocks):
            assert len(group) == n_hit // BS
            if g == self.sg:
                event("state checkpoint hit")
                if any(b.block_id == self.null for b in hit.blocks[1]):
                    event("sliding hit with nulls")
                want = ("state", req.cache_salt, tuple(req.all_token_ids[:n_hit]))
                assert self.shadow.get(group[-1].block_id) == want
                continue
            for i, b in enumerate(group):
                if b.block_id == self.null:
                    assert g == 1
                    continue
                assert self.shadow.get(b.block_id) == (req.cache_salt,
                                                      tuple(req.all_token_ids[:(i + 1) * BS]))

    def _record(self, req, old_lens, num_hit_blocks):
        total = min(req.num_computed_tokens, len(req.all_token_ids))
        ids = self.kv.get_block_ids(req.request_id)
        for g in (0, 1):
            for i in range(max(old_lens[g], num_hit_blocks), len(ids[g])):
                if ids[g][i] != self.null:
                    self.shadow.pop(ids[g][i], None)
            for i, bid in enumerate(ids[g]):
                if bid != self.null and (i + 1) * BS <= total:
                    want = (req.cache_salt, tuple(req.all_token_ids[:(i + 1) * BS]))
                    assert self.shadow.setdefault(bid, want) == want
        d = self.kv.state_directives(req)[self.sg]
        assert ids[self.sg] == [d.running_block]
        if d.saves:
            event("state saves")
        if self.kv.pins is not None and len(self.kv.pins):
            event("pins held")
        for n, dst in d.saves:  # the step runs now: the saved pages hold these states
            assert n % BS == 0 and n <= total
            self.shadow[dst] = ("state", req.cache_salt, tuple(req.all_token_ids[:n]))

    @rule(dt=st.floats(0, 4))
    def tick(self, dt):
        self.now[0] += dt

    @rule(session=st.sampled_from(["A", "B"]))
    def end_session(self, session):
        self.kv.end_session(session)

    @invariant()
    def blocks_accounted(self):
        kv = self.kv
        pool = kv.pool
        holders = {}
        for rid, req in self.running.items():
            for g, bid in kv.request_pages(req):
                holders[bid] = holders.get(bid, 0) + 1
            ids = kv.get_block_ids(rid)
            for g in (0, 1):
                assert len(ids[g]) * BS >= req.num_computed_tokens
        for rid, req in self.waiting.items():
            assert kv.get_block_ids(rid) == [[]] * self.num_groups
            assert not kv.request_pages(req)
        if kv.pins is not None:
            for bid, c in kv.pins.holders().items():
                holders[bid] = holders.get(bid, 0) + c
        queue = {b.block_id for b in pool.free_queue}
        assert len(queue) == pool.num_free_blocks
        assert self.null not in queue and pool.null_block.ref_cnt == 0
        assert self.null not in holders
        for b in pool.blocks[1:]:
            assert b.ref_cnt == holders.get(b.block_id, 0), b
            assert (b.ref_cnt == 0) == (b.block_id in queue)
        assert pool.num_free_blocks + len(holders) == self.num_blocks - 1
        for g, cached in enumerate(pool.cached):
            for h, b in cached.items():
                assert b.block_hash is h and b.group_id == g
        ev = pool.evictor
        if ev is not None:
            live = {e[3].block_id for e in ev._heap
                    if e[2] == e[3].evict_ver and e[3].ref_cnt == 0 and e[3].block_hash}
            assert live == {b.block_id for b in pool.free_queue if b.block_hash is not None}


class HybridFlopMachine(HybridMachine):
    eviction = "flop_aware"


class HybridPinnedMachine(HybridMachine):
    eviction = "flop_aware"
    retention = RetentionConfig(interval=True, marconi=True, pin_ttl_s=5.0,
                                pin_budget_bytes=192 * 8)  # 8 pages


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                     suppress_health_check=list(HealthCheck))
TestHybrid = HybridMachine.TestCase
TestHybrid.settings = _settings
TestHybridFlop = HybridFlopMachine.TestCase
TestHybridFlop.settings = _settings
TestHybridPinned = HybridPinnedMachine.TestCase
TestHybridPinned.settings = _settings
