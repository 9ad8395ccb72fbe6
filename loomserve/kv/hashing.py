"""Chained block hashes, incremental per request and per session.

A block's key is H(parent key, its token ids, extra keys) with xxh3-128, a 16-byte digest; the
only extra key is the request's `cache_salt`, mixed into block 0, so requests with different
salts never share a block. `BlockHasher` extends `req.block_hashes` only as far as asked, and a
new turn of a session takes the previous request's chain for the blocks it left unchanged.
The encoding and the session memo: docs/design/kv-cache.md.

Invariants:
- Only BlockHasher appends to req.block_hashes; all_token_ids and block_hashes are
  append-only (the KVRequest contract), since the memo holds references to them, not copies.
- A reused prefix is verified token by token before reuse, never assumed.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

_digest = xxhash.xxh3_128_digest
ROOT_HASH = b"\x00" * 16  # parent of block 0
_SALT_TAG = b"\x01salt:"
_VERIFY_CHUNK_BLOCKS = 256


def salt_bytes(cache_salt: str | None) -> bytes:
    return b"" if cache_salt is None else _SALT_TAG + cache_salt.encode()


def pack_tokens(token_ids) -> bytes:
    return array("i", token_ids).tobytes()


def hash_block(parent: bytes | None, token_ids, extra: bytes = b"") -> bytes:
    """Key of one block: H(parent or ROOT, int32 tokens, extra)."""
    return _digest((parent or ROOT_HASH) + pack_tokens(token_ids) + extra)


def hash_chain(token_ids, block_size: int, cache_salt: str | None = None,
               parent: bytes | None = None, start_block: int = 0,
               end_block: int | None = None, out: list[bytes] | None = None) -> list[bytes]:
    """Keys of full blocks start_block..end_block-1 of token_ids, chained from `parent`
    (the key of block start_block-1, None when start_block == 0). Appends to and returns `out`."""
    if out is None:
        out = []
    if end_block is None:
        end_block = len(token_ids) // block_size
    if end_block <= start_block:
        return out
    buf = pack_tokens(token_ids[start_block * block_size:end_block * block_size])
    nb = 4 * block_size
    digest = _digest
    append = out.append
    off = 0
    i = start_block
    if i == 0:
        parent = _digest(ROOT_HASH + buf[:nb] + salt_bytes(cache_salt))
        append(parent)
        off = nb
        i = 1
    end = (end_block - start_block) * nb
    while off < end:
        parent = digest(parent + buf[off:off + nb])
        append(parent)
        off += nb
    return out


def _common_full_blocks(a: list[int], b: list[int], num_blocks: int, block_size: int) -> int:
    """Number of leading full blocks (at most num_blocks) where lists a and b hold the same
    tokens. Every token of the blocks counted is compared."""
    n = num_blocks * block_size
    # Fast path, one slice: b is the previous request's whole token list (often a prefix of a).
    lb = len(b)
    if lb <= len(a) and lb - n < block_size and a[:lb] == b:
        return num_blocks
    # Next likeliest: only b's partial last block differs (e.g. a turn ending mid-block).
    if a[:n] == b[:n]:
        return num_blocks
    # Find the first differing block: chunks first, then blocks inside the first bad chunk.
    step = _VERIFY_CHUNK_BLOCKS * block_size
    lo = 0
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            break
        lo = hi
    hi = min(n, lo + step)
    while lo < hi:
        if a[lo:lo + block_size] != b[lo:lo + block_size]:
            break
        lo += block_size
    return lo // block_size


class BlockHasher:
    def __init__(self, block_size: int, max_sessions: int = 1024,
                 max_memo_tokens: int = 4_000_000) -> None:
        self.block_size = block_size
        self.max_sessions = max_sessions
        # The memo keeps finished requests' token lists alive (~36 bytes per token as Python
        # ints), so it is bounded by total tokens as well as by sessions (LRU on both).
        self.max_memo_tokens = max_memo_tokens
        self._memo_tokens = 0
        self._sessions: OrderedDict[str, tuple[str | None, list[int], list[bytes], int]] = (
            OrderedDict())
        # session -> the entry a newer request of it replaced, until that request is freed
        # (its miss is attributed before: kv.miss_causes); a few, LRU.
        self._before: OrderedDict[str, tuple] = OrderedDict()
        # Counters for tests and benchmarks.
        self.hashed_blocks = 0
        self.reused_blocks = 0

    def ensure(self, req, num_blocks: int | None = None) -> list[bytes]:
        """Extend req.block_hashes to cover min(num_blocks, full blocks of all_token_ids)."""
        tokens = req.all_token_ids
        bs = self.block_size
        full = len(tokens) // bs
        if num_blocks is None or num_blocks > full:
            num_blocks = full
        hashes = req.block_hashes
        have = len(hashes)
        if have >= num_blocks:
            return hashes
        if have == 0 and req.session_id is not None:
            have = self._reuse_session(req, num_blocks)
            if have >= num_blocks:
                return hashes
        hash_chain(tokens, bs, req.cache_salt, hashes[-1] if have else None, have, num_blocks,
                   hashes)
        self.hashed_blocks += num_blocks - have
        return hashes

    def _reuse_session(self, req, num_blocks: int) -> int:
        entry = self._sessions.get(req.session_id)
        if entry is None:
            return 0
        salt, old_tokens, old_hashes, _ = entry
        if salt != req.cache_salt:
            return 0
        m = min(len(old_hashes), num_blocks)
        if m == 0:
            return 0
        m = _common_full_blocks(req.all_token_ids, old_tokens, m, self.block_size)
        if m:
            req.block_hashes.extend(old_hashes[:m])
            self.reused_blocks += m
        return m

    def remember(self, req) -> None:
        """Make req the session's latest request (no-op without a session_id)."""
        sid = req.session_id
        if sid is None or not req.block_hashes:
            return
        sessions = self._sessions
        old = sessions.get(sid)
        if old is not None:
            self._memo_tokens -= old[3]
            if old[1] is not req.all_token_ids:
                before = self._before
                before[sid] = old
                before.move_to_end(sid)
                if len(before) > 64:
                    before.popitem(last=False)
        n = len(req.all_token_ids)
        sessions[sid] = (req.cache_salt, req.all_token_ids, req.block_hashes, n)
        self._memo_tokens += n
        sessions.move_to_end(sid)
        while len(sessions) > self.max_sessions or (
                self._memo_tokens > self.max_memo_tokens and len(sessions) > 1):
            self._memo_tokens -= sessions.popitem(last=False)[1][3]

    def previous(self, req) -> tuple | None:
        """The session's request before req, (cache_salt, all_token_ids, block_hashes, n), or
        None."""
        sid = req.session_id
        if sid is None:
            return None
        entry = self._sessions.get(sid)
        if entry is not None and entry[1] is req.all_token_ids:
            return self._before.get(sid)
        return entry

    def drop_previous(self, req) -> None:
        """req is freed: the entry of its predecessor, kept for previous(), goes (freeing its
        tokens here, where remember() would have without it)."""
        sid = req.session_id
        entry = self._sessions.get(sid) if sid is not None else None
        if entry is not None and entry[1] is req.all_token_ids:
            self._before.pop(sid, None)

    def end_session(self, session_id: str) -> None:
        old = self._sessions.pop(session_id, None)
        if old is not None:
            self._memo_tokens -= old[3]

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)
