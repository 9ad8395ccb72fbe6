"""The linear-attention / SSM-state manager: one recurrent state per request in pool pages.

A request's live state sits in one `running` page (the group's only block-table entry),
updated in place by the runner. A prefix hit claims a kept checkpoint (`init`) that the step's
directive copies into `running`; the retention policy picks checkpoints to save inside a step,
and a reused `tail` page keeps the state at the last crossed boundary, hashed as a checkpoint
when the request is freed. A hit needs a checkpoint exactly at its boundary, so hits are not
prefix-closed. Pages, deferred hashing and hits in detail: docs/design/kv-cache.md.

Speculative decoding: a step verifying d drafts takes d `draft` pages, saves holding the state
after each of its first d rows (after the last row too where that ends a block; the state after
the last row stays in `running`). The next allocation, rolled back to the accepted length,
keeps the draft page at that length as `restore` (its directive copies it into `running`, as a
hit's checkpoint; none when every draft was accepted), makes the page at a block boundary
inside the accepted drafts the `tail` (row 0 of a plain decode step would have saved it there),
and frees the others. Draft pages are hashed only as that tail, after acceptance: a checkpoint
only ever holds the state after accepted tokens (docs/design/speculative.md).

Invariants:
- A request holds one reference on each of running, init, tail, restore and each pending save
  and draft page, and nothing else in this group.
- A hashed checkpoint page holds the state after exactly (its position) tokens of the chain
  whose last block hash it carries; a save is hashed only once its step has run.
"""

from __future__ import annotations

from loomserve.kv.directives import StateDirective
from loomserve.kv.managers.base import SingleTypeKVManager
from loomserve.kv.pool import Block, BlockPool
from loomserve.kv.retention import RetentionConfig


class _ReqState:
    __slots__ = ("running", "init", "pending", "tail", "tail_pos", "end_pos", "kept",
                 "marconi_pos", "directive", "plan", "drafts", "draft_end", "restore",
                 "restoring")

    def __init__(self) -> None:
        self.running: Block | None = None
        self.init: Block | None = None
        self.pending: list[tuple[Block, int]] = []  # (page, boundary in blocks) of last step
        self.tail: Block | None = None
        self.tail_pos = 0  # boundary (blocks) whose state the tail page holds; 0 = none
        self.end_pos = 0  # last boundary the computation crossed
        self.kept = 0  # checkpoints kept by retention policies (bounded per path)
        self.marconi_pos = 0  # full-attention hit boundary without a checkpoint; 0 = none
        self.directive: StateDirective | None = None
        # (saves, tail save, last boundary, drafts)
        self.plan: tuple[list[int], bool, int, int] | None = None
        self.drafts: list[tuple[Block, int]] = []  # (page, tokens consumed) of the verify step
        self.draft_end = 0  # tokens consumed after the verify step's last row
        self.restore: Block | None = None  # the draft page the next directive copies from
        self.restoring: Block | None = None  # ... once that directive is out (freed next step)


class LinearStateManager(SingleTypeKVManager):
    kind = "linear_state"
    token_blocks = False
    stepped = True

    def __init__(self, spec, group_id: int, pool: BlockPool) -> None:
        super().__init__(spec, group_id, pool)
        self.retention = RetentionConfig()
        self.states: dict[str, _ReqState] = {}

    # -- hits -----------------------------------------------------------------------------
    def find_longest_hit(self, block_hashes: list[bytes], max_blocks: int) -> list[Block]:
        n = min(max_blocks, len(block_hashes))
        if n <= 0:
            return []
        get = self.pool.cached[self.group_id].get
        i = n
        for b in map(get, reversed(block_hashes[:n])):
            if b is not None:
                return [None] * (i - 1) + [b]
            i -= 1
        return []

    def validate_hit(self, hit_blocks, block_hashes) -> bool:
        if not hit_blocks:
            return True
        n = len(hit_blocks)
        return self.pool.cached[self.group_id].get(block_hashes[n - 1]) is hit_blocks[-1]

    def hit_positions(self, num_blocks: int) -> range:
        """Only the checkpoint at the boundary: the page keyed by the hash of block
        num_blocks - 1."""
        return range(num_blocks - 1, num_blocks) if num_blocks > 0 else range(0)

    def cache_loaded(self, blocks, positions, block_hashes, token_ids) -> None:
        """Loaded checkpoint pages: blocks[j] holds the state after positions[j] + 1 blocks."""
        for blk, pos in zip(blocks, positions):
            if block_hashes[pos] not in self.pool.cached[self.group_id]:
                self._cache_checkpoint(blk, pos + 1, block_hashes)

    def blocks_for_hit_at(self, block_hashes, num_blocks):
        if num_blocks <= 0:
            return []
        b = self.pool.cached[self.group_id].get(block_hashes[num_blocks - 1])
        return None if b is None else [b]

    # -- per-step plan --------------------------------------------------------------------
    def begin_step(self, request_id: str, block_hashes: list[bytes]) -> None:
        """The previous step has run: release the claimed checkpoint, hash its saves."""
        st = self.states.get(request_id)
        if st is None:
            return
        pool = self.pool
        if st.init is not None:
            pool.free((st.init,))
            st.init = None
        if st.restoring is not None:
            if st.restoring is not st.tail:  # a boundary's draft page stays, as the tail
                pool.free((st.restoring,))
            st.restoring = None
        if st.pending:
            pending = st.pending
            st.pending = []
            for blk, pos in pending:
                self._cache_checkpoint(blk, pos, block_hashes)
            pool.free([b for b, _ in reversed(pending)])

    def _cache_checkpoint(self, blk: Block, pos: int, block_hashes: list[bytes]) -> None:
        if pos > len(block_hashes) or not self.pool.enable_caching:
            return
        if self.flop_model is not None:
            blk.saved_flops = self.flop_model.checkpoint_flops(pos * self.block_size)
        self.pool.cache_blocks(self.group_id, [blk], [block_hashes[pos - 1]])

    def prepare(self, request_id: str, start: int, total: int, num_prompt_tokens: int,
                block_hashes: list[bytes], marconi_pos: int, num_draft: int = 0) -> None:
        """Decide this step's saves for the chunk [start, total), whose last num_draft tokens
        are drafts (no side effect on the pool but settling the previous step's drafts).
        Checkpoints stay within accepted tokens: block_hashes, plus under async scheduling
        the boundary a placeholder (the token the step in flight samples) ends."""
        st = self.states.get(request_id)
        if st is None:
            st = _ReqState()
            st.marconi_pos = marconi_pos
            self.states[request_id] = st
        if st.drafts:
            self._settle_drafts(request_id, st, start, block_hashes)
        bs = self.block_size
        lo = start // bs + 1
        # Hashes cover known tokens. Under async scheduling a decode's token is a placeholder
        # until the step before it is updated: its boundary is planned anyway and hashed once
        # known (begin_step / finish). Drafts are never known: no boundary past them.
        known = len(block_hashes)
        hi = min(total // bs, max(known, (total - num_draft) // bs))
        if hi < lo or not self.pool.enable_caching:
            st.plan = ([], False, 0, num_draft)
            return
        ret = self.retention
        cached = self.pool.cached[self.group_id]
        want: list[int] = []
        if ret.marconi and lo <= st.marconi_pos <= hi:
            want.append(st.marconi_pos)
        if ret.interval:
            p = num_prompt_tokens // bs
            if lo <= p <= hi:
                want.append(p)
            if ret.every_n_tokens > 0:
                nb = max(1, ret.every_n_tokens // bs)
                k = hi // nb * nb
                while k >= lo and len(want) < ret.max_checkpoints_per_path + 2:
                    want.append(k)
                    k -= nb
        saves: list[int] = []
        room = ret.max_checkpoints_per_path - st.kept
        for p in want:
            if room <= 0:
                break
            if p > 0 and p not in saves and (p > known or block_hashes[p - 1] not in cached):
                saves.append(p)
                room -= 1
        tail = hi not in saves and (hi > known or block_hashes[hi - 1] not in cached)
        st.plan = (saves, tail, hi, num_draft)

    def _draft_pages(self, num_draft: int, total: int) -> int:
        """Pages for the states after rows 0..d-1 of a verify step, and after row d where it
        ends a block (the tail checkpoint, should every draft be accepted)."""
        return num_draft + (num_draft > 0 and total % self.block_size == 0
                            and self.pool.enable_caching)

    def _settle_drafts(self, request_id: str, st: _ReqState, start: int,
                       block_hashes: list[bytes]) -> None:
        """The verify step has run and the scheduler rolled the request back to `start` tokens:
        restore the draft page holding the state after exactly start tokens (none when every
        draft was accepted: running holds it), make the latest block boundary inside the
        accepted tokens the tail checkpoint, free the other pages."""
        keep = None
        if start != st.draft_end:
            keep = next((b for b, n in st.drafts if n == start), None)
            if keep is None:
                raise ValueError(f"request {request_id} resumes at {start} tokens, which no "
                                 f"draft state of its verify step ({st.draft_end}) holds")
        self._promote_tail(st, start, block_hashes)
        self.pool.free([b for b, _ in reversed(st.drafts) if b is not keep])
        st.drafts = []
        st.restore = keep

    def _promote_tail(self, st: _ReqState, accepted: int, block_hashes: list[bytes]) -> None:
        """The draft page at the latest block boundary within the first `accepted` tokens (the
        verify step's accepted length) becomes the tail checkpoint, replacing the older one;
        it leaves st.drafts."""
        bs, cached = self.block_size, self.pool.cached[self.group_id]
        for i in range(len(st.drafts) - 1, -1, -1):
            blk, n = st.drafts[i]
            if n <= accepted and n % bs == 0 and st.tail_pos < n // bs <= len(block_hashes) \
                    and block_hashes[n // bs - 1] not in cached:
                if st.tail is not None and st.tail is not st.restoring:
                    self.pool.free((st.tail,))
                st.tail, st.tail_pos = blk, n // bs
                st.end_pos = max(st.end_pos, st.tail_pos)
                del st.drafts[i]
                return

    def num_blocks_to_allocate(self, request_id, num_tokens, hit_blocks, exact=True) -> int:
        st = self.states[request_id]
        saves, tail, _, drafts = st.plan
        need = len(saves) + (st.running is None) + (tail and st.tail is None) + \
            self._draft_pages(drafts, num_tokens)
        if hit_blocks:
            ckpt = hit_blocks[-1]
            need += 1 if (ckpt.ref_cnt == 0 or not exact) else 0
        return need

    def claim_hit(self, request_id, hit_blocks) -> None:
        self.req_blocks.setdefault(request_id, [])
        self.req_block_ids.setdefault(request_id, [])
        self.num_cached.setdefault(request_id, 0)
        if not hit_blocks:
            return
        st = self.states[request_id]
        if st.running is not None:
            raise ValueError(f"prefix hit for request {request_id} that already holds blocks")
        ckpt = hit_blocks[-1]
        self.pool.touch([ckpt])
        st.init = ckpt
        st.end_pos = len(hit_blocks)

    def allocate_new(self, request_id: str, num_tokens: int) -> None:
        st = self.states[request_id]
        saves, tail, hi, num_draft = st.plan
        st.plan = None
        blocks = self.req_blocks.setdefault(request_id, [])
        ids = self.req_block_ids.setdefault(request_id, [])
        self.num_cached.setdefault(request_id, 0)
        pages = self._draft_pages(num_draft, num_tokens)
        n = len(saves) + (st.running is None) + (tail and st.tail is None) + pages
        new = self.pool.allocate(n) if n else []
        drafts = [new.pop() for _ in range(pages)]
        zero = False
        if st.running is None:
            st.running = new.pop()
            blocks.append(st.running)
            ids.append(st.running.block_id)
            zero = st.init is None
        if tail and st.tail is None:
            st.tail = new.pop()
        bs = self.block_size
        out = [(p * bs, b.block_id) for p, b in zip(saves, new)]
        st.pending = list(zip(new, saves))
        st.kept += len(saves)
        if hi > st.end_pos:
            st.end_pos = hi
        if tail:
            out.append((hi * bs, st.tail.block_id))
            st.tail_pos = hi
        if drafts:  # the state after row j: n = start + 1 + j (num_tokens: start + 1 + d)
            start = num_tokens - 1 - num_draft
            st.drafts = [(b, start + 1 + j) for j, b in enumerate(drafts)]
            st.draft_end = num_tokens
            out += [(n, b.block_id) for b, n in st.drafts]
        out.sort()
        src = st.init if st.init is not None else st.restore
        st.restoring, st.restore = st.restore, None
        st.directive = StateDirective(
            running_block=st.running.block_id,
            init_from=src.block_id if src is not None else None,
            zero_init=zero, saves=out)

    def directive(self, request_id: str) -> StateDirective | None:
        st = self.states.get(request_id)
        return None if st is None else st.directive

    def cache_full_blocks(self, request_id, num_full_blocks, block_hashes, token_ids) -> None:
        pass  # checkpoints are hashed when their step has run (begin_step / finish)

    # -- release --------------------------------------------------------------------------
    def finish(self, request_id: str, block_hashes: list[bytes], num_computed: int = 0) -> None:
        """The request is being freed after its last step ran, num_computed tokens accepted:
        hash pending saves and the tail checkpoint at the last crossed boundary, a verify
        step's draft page there included (references still held; free() drops them)."""
        st = self.states.get(request_id)
        if st is None:
            return
        if st.drafts:
            self._promote_tail(st, num_computed, block_hashes)
        for blk, pos in st.pending:
            self._cache_checkpoint(blk, pos, block_hashes)
        if st.tail is not None and st.tail_pos and st.tail_pos == st.end_pos:
            if st.tail_pos <= len(block_hashes) and \
                    block_hashes[st.tail_pos - 1] not in self.pool.cached[self.group_id]:
                self._cache_checkpoint(st.tail, st.tail_pos, block_hashes)

    def abort_prepare(self, request_id: str) -> None:
        """The allocation failed: forget a state that never got a page."""
        st = self.states.get(request_id)
        if st is not None and st.running is None:
            del self.states[request_id]
        elif st is not None:
            st.plan = None

    def end_position(self, request_id: str) -> int:
        st = self.states.get(request_id)
        return 0 if st is None else st.end_pos

    def held_blocks(self, request_id: str) -> list[Block]:
        st = self.states.get(request_id)
        if st is None:
            return []
        out = [b for b in (st.running, st.init, st.tail) if b is not None]
        out.extend(b for b in (st.restore, st.restoring) if b is not None and b is not st.tail)
        out.extend(b for b, _ in st.pending)
        out.extend(b for b, _ in st.drafts)
        return out

    def free(self, request_id: str) -> None:
        st = self.states.pop(request_id, None)
        self.req_blocks.pop(request_id, None)
        self.req_block_ids.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if st is None:
            return
        # Running and unhashed pages go to the front; checkpoints to the back, latest last.
        out = [b for b, _ in st.pending]
        out.extend(b for b in (st.restore, st.restoring) if b is not None and b is not st.tail)
        out.extend(b for b, _ in st.drafts)
        if st.init is not None:
            out.append(st.init)
        if st.tail is not None:
            out.append(st.tail)
        if st.running is not None:
            out.append(st.running)
        self.pool.free(out)
