"""Property test: random traffic never leaks, double-frees or serves a wrong block.

A shadow model records, per block id, the (salt, token prefix) whose KV the block holds once
its positions are computed; every prefix hit must return blocks whose shadow equals the
requesting prompt's prefix, block by block.
"""

import random

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loomserve.kv.cache_manager import KVCacheManager
from loomserve.kv.hashing import hash_chain
from tests.kv.conftest import Req, make_config

BS = 4
_r = random.Random(1234)
BASES = [[_r.randrange(12) for _ in range(40)] for _ in range(3)]


class KVMachine(RuleBasedStateMachine):
    num_groups = 1
    num_blocks = 24

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(make_config(self.num_blocks, BS, self.num_groups))
        self.running: dict[str, Req] = {}
        self.waiting: dict[str, Req] = {}
        self.finished: list[Req] = []
        self.shadow: dict[int, tuple] = {}
        self.n = 0

    # -- helpers --------------------------------------------------------------------------
    def _new_id(self):
        self.n += 1
        return f"r{self.n}"

    def _check_hit(self, req, hit, n_hit):
        assert n_hit % BS == 0 and n_hit <= max(0, len(req.all_token_ids) - 1)
        for group in hit.blocks[:1] if n_hit == 0 else hit.blocks:
            assert len(group) == n_hit // BS
            for i, b in enumerate(group):
                assert self.shadow.get(b.block_id) == (req.cache_salt,
                                                      tuple(req.all_token_ids[:(i + 1) * BS]))

    def _record(self, req, old_lens, num_hit_blocks):
        total = min(req.num_computed_tokens, len(req.all_token_ids))
        for g, ids in enumerate(self.kv.get_block_ids(req.request_id)):
            for i in range(max(old_lens[g], num_hit_blocks), len(ids)):
                self.shadow.pop(ids[i], None)  # fresh block: content unknown until computed
            for i, bid in enumerate(ids):
                if (i + 1) * BS <= total:
                    want = (req.cache_salt, tuple(req.all_token_ids[:(i + 1) * BS]))
                    got = self.shadow.setdefault(bid, want)
                    assert got == want

    def _schedule(self, req, chunk):
        """Prefix lookup + allocation for a request holding no blocks."""
        hit, n_hit = self.kv.get_computed_blocks(req)
        self._check_hit(req, hit, n_hit)
        event("prefix hit" if n_hit else "no prefix hit")
        if getattr(self.kv, "pins", None) is not None:
            # Pins past their time-to-live are released by any allocation, refused or not:
            # housekeeping, outside the all-or-nothing of the allocation itself.
            self.kv.pins.expire()
        free_before = self.kv.num_free_blocks
        n_new = min(chunk, len(req.all_token_ids) - n_hit)
        if not self.kv.allocate_slots(req, n_new, hit, n_hit):
            event("allocation refused")
            assert self.kv.num_free_blocks == free_before
            assert self.kv.get_block_ids(req.request_id) == [[]] * self.num_groups
            return False
        old = [0] * self.num_groups
        req.num_computed_tokens = n_hit + n_new
        self._record(req, old, n_hit // BS)
        return True

    # -- rules ----------------------------------------------------------------------------
    @rule(base=st.integers(0, 2), k=st.integers(0, 40),
          suffix=st.lists(st.integers(0, 11), max_size=8),
          salt=st.sampled_from([None, "s"]), session=st.sampled_from([None, "A", "B"]),
          chunk=st.integers(1, 48))
    def add_request(self, base, k, suffix, salt, session, chunk):
        toks = BASES[base][:k] + suffix
        if not toks:
            toks = [0]
        req = Req(self._new_id(), toks, cache_salt=salt, session_id=session)
        (self.running if self._schedule(req, chunk) else self.waiting)[req.request_id] = req

    @precondition(lambda self: self.finished)
    @rule(idx=st.integers(0, 10**6), extra=st.lists(st.integers(0, 11), min_size=1, max_size=10),
          edit=st.one_of(st.none(), st.integers(0, 10**6)), chunk=st.integers(1, 64))
    def next_turn(self, idx, extra, edit, chunk):
        prev = self.finished[idx % len(self.finished)]
        toks = list(prev.all_token_ids) + extra
        if edit is not None:
            toks[edit % len(toks)] = 99  # history rewritten: memo must notice
        req = Req(self._new_id(), toks, cache_salt=prev.cache_salt, session_id=prev.session_id)
        (self.running if self._schedule(req, chunk) else self.waiting)[req.request_id] = req

    @precondition(lambda self: self.waiting)
    @rule(idx=st.integers(0, 10**6), chunk=st.integers(1, 64))
    def resume(self, idx, chunk):
        rid = sorted(self.waiting)[idx % len(self.waiting)]
        req = self.waiting[rid]
        if self._schedule(req, chunk):
            self.running[rid] = self.waiting.pop(rid)

    @precondition(lambda self: self.running)
    @rule(idx=st.integers(0, 10**6), chunk=st.integers(1, 16), tok=st.integers(0, 11))
    def step(self, idx, chunk, tok):
        rid = sorted(self.running)[idx % len(self.running)]
        req = self.running[rid]
        old = [len(x) for x in self.kv.get_block_ids(rid)]
        remaining = len(req.all_token_ids) - req.num_computed_tokens
        if remaining > 0:
            n = min(chunk, remaining)
        else:
            req.all_token_ids.append(tok)  # decode: the sampled token is computed next step
            n = 1
        if self.kv.allocate_slots(req, n):
            req.num_computed_tokens += n
            self._record(req, old, 0)
        else:  # preempt by recompute
            event("preempted on full pool")
            self.kv.free(req)
            req.num_computed_tokens = 0
            self.waiting[rid] = self.running.pop(rid)

    @precondition(lambda self: self.running)
    @rule(idx=st.integers(0, 10**6))
    def finish(self, idx):
        rid = sorted(self.running)[idx % len(self.running)]
        req = self.running.pop(rid)
        self.kv.free(req)
        self.finished.append(req)

    @precondition(lambda self: self.running)
    @rule(idx=st.integers(0, 10**6))
    def preempt(self, idx):
        rid = sorted(self.running)[idx % len(self.running)]
        req = self.running.pop(rid)
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.waiting[rid] = req

    @precondition(lambda self: self.waiting)
    @rule(idx=st.integers(0, 10**6))
    def abort(self, idx):
        rid = sorted(self.waiting)[idx % len(self.waiting)]
        self.kv.free(self.waiting.pop(rid))  # holds nothing: a no-op

    @rule()
    def reset(self):
        ok = self.kv.reset_prefix_cache()
        assert ok == (not self.running)

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def blocks_accounted(self):
        pool = self.kv.pool
        holders = {}
        for rid, req in self.running.items():
            ids = self.kv.get_block_ids(rid)
            assert len(ids) == self.num_groups
            for g in ids:
                assert len(g) * BS >= req.num_computed_tokens
                assert len(set(g)) == len(g)
                for bid in g:
                    holders[bid] = holders.get(bid, 0) + 1
        for rid in self.waiting:
            assert self.kv.get_block_ids(rid) == [[]] * self.num_groups
        queue = {b.block_id for b in pool.free_queue}
        assert len(queue) == pool.num_free_blocks
        for b in pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0)
            assert (b.ref_cnt == 0) == (b.block_id in queue)
        assert pool.num_free_blocks + len(holders) == self.num_blocks
        for g, cached in enumerate(pool.cached):
            for h, b in cached.items():
                assert b.block_hash is h and b.group_id == g

    @invariant()
    def hashes_exact(self):
        for req in list(self.running.values()) + list(self.waiting.values()):
            full = hash_chain(req.all_token_ids, BS, req.cache_salt)
            assert req.block_hashes == full[:len(req.block_hashes)]


class TwoGroupKVMachine(KVMachine):
    num_groups = 2
    num_blocks = 40


_settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                     suppress_health_check=list(HealthCheck))
TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = _settings
TestTwoGroupKVMachine = TwoGroupKVMachine.TestCase
TestTwoGroupKVMachine.settings = _settings
