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
from hypothesis.stateful import invariant, precondition, rule

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
        self.spec_running: dict[str, tuple] = {}  # rid -> (its state, start, running)

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
        self._record_attention(req, [max(n, num_hit_blocks) for n in old_lens])
        d = self.kv.state_directives(req)[self.sg]
        assert ids[self.sg] == [d.running_block]
        if d.saves:
            event("state saves")
        if self.kv.pins is not None and len(self.kv.pins):
            event("pins held")
        for n, dst in d.saves:  # the step runs now: the saved pages hold these states
            assert n % BS == 0 and n <= total
            self.shadow[dst] = ("state", req.cache_salt, tuple(req.all_token_ids[:n]))

    @precondition(lambda self: self.running)
    @rule(idx=st.integers(0, 10**6), tok=st.integers(0, 11),
          drafts=st.lists(st.integers(0, 11), min_size=1, max_size=5), accept=st.integers(0, 5))
    def spec_step(self, idx, tok, drafts, accept):
        """A decode verifying drafts (speculative decoding), as the scheduler runs it: the
        last sampled token then the drafts; `accept` drafts accepted, then a token other than
        the first rejected draft appended (uncomputed), the rest rolled back. The state the
        step starts from (a restored draft page, else the running page) must be the state
        after exactly its computed tokens; a checkpoint hit (_check_hit) must never hold a
        rejected draft's state."""
        rid = sorted(self.running)[idx % len(self.running)]
        req = self.running[rid]
        if len(req.all_token_ids) - req.num_computed_tokens > 1:
            return  # still prefilling
        if len(req.all_token_ids) == req.num_computed_tokens:
            req.all_token_ids.append(tok)  # sampled by a plain step
        old = [len(x) for x in self.kv.get_block_ids(rid)]
        start = req.num_computed_tokens
        mgr = self.kv.coordinator.state_managers[0]
        if not self.kv.allocate_slots(req, 1 + len(drafts), num_draft=len(drafts)):
            event("drafts refused")
            self.spec_running.pop(rid, None)
            return self._decode_without_drafts(req, old)
        view = req.all_token_ids + drafts
        d = self.kv.state_directives(req)[self.sg]
        st_obj, at, running = self.spec_running.pop(rid, (None, -1, None))
        if st_obj is mgr.states[rid] and at == start:  # verified last step: its state now
            event("state restored" if d.init_from is not None else "all drafts accepted")
            state = self.shadow.get(d.init_from) if d.init_from is not None else running
            assert state == ("state", req.cache_salt, tuple(view[:start]))
        for n, dst in d.saves:
            assert start < n <= len(view)
            self.shadow[dst] = ("state", req.cache_salt, tuple(view[:n]))
        a = min(accept, len(drafts))
        bonus = tok if a == len(drafts) else (drafts[a] + 1 + tok % 11) % 12
        req.all_token_ids.extend(drafts[:a] + [bonus])
        req.num_computed_tokens = start + 1 + a
        self.spec_running[rid] = (mgr.states[rid], start + 1 + a,
                                  ("state", req.cache_salt, tuple(view)))
        self._record_attention(req, old)

    @invariant()
    def tail_holds_an_accepted_state(self):
        """A running request's tail page (hashed as a checkpoint when it is freed) holds the
        state after its tail boundary of the request's own tokens, never a rejected draft's."""
        mgr = self.kv.coordinator.state_managers[0]
        for rid, req in self.running.items():
            st_ = mgr.states.get(rid)
            if st_ is not None and st_.tail is not None and st_.tail_pos:
                want = ("state", req.cache_salt, tuple(req.all_token_ids[:st_.tail_pos * BS]))
                assert self.shadow.get(st_.tail.block_id) == want

    def _decode_without_drafts(self, req, old):
        if self.kv.allocate_slots(req, 1):
            req.num_computed_tokens += 1
            self._record(req, old, 0)
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
            self.waiting[req.request_id] = self.running.pop(req.request_id)

    def _record_attention(self, req, old_lens):
        """_record's shadow of the attention groups' blocks (computed, accepted tokens)."""
        total = min(req.num_computed_tokens, len(req.all_token_ids))
        ids = self.kv.get_block_ids(req.request_id)
        for g in (0, 1):
            for i in range(old_lens[g], len(ids[g])):
                if ids[g][i] != self.null:
                    self.shadow.pop(ids[g][i], None)
            for i, bid in enumerate(ids[g]):
                if bid != self.null and (i + 1) * BS <= total:
                    want = (req.cache_salt, tuple(req.all_token_ids[:(i + 1) * BS]))
                    assert self.shadow.setdefault(bid, want) == want

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
