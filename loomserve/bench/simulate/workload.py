"""The simulator's request model: traces merged into one request stream, with synthetic prompts.

Replay order. All requests of all traces are merged in time order: a request's replay time is
its session time (`TraceRequest.t`, subagents already normalised by the parser) plus its
session's offset, which is 0 for every trace unless `--stagger S` starts trace i at i*S
seconds. Ties go to the earlier trace on the command line, then to the trace's own order.

Prompt synthesis. Each trace hash id (one per 64-token trace block, chained) becomes a fixed run
of token ids: the trace block with id h is `block_size` copies of a small int interned for
(scope, h), so two prompts share exactly as many leading tokens as their leading hash ids
agree. The tail past the last full trace block is a marker unique to the request (never hits).
The simulator block size B need not match the trace's 64: loomserve's chained hashes over the
synthesized tokens reproduce the recorded sharing at that granularity. Each trace is its own
cache scope (`cache_salt` = trace id; a "global" `hash_id_scope` drops the salt); the hasher's
session memo is keyed by (trace, agent), so a new turn hashes only its suffix.

Semantics:
* `loomserve`: denominator = the request's `in` tokens; hit = whole blocks, capped at `in` - 1
  tokens (the last token is computed); every request counts.
* `kvcache-sim` (KVCache.AI kvcache-simulator's accounting): the prompt is only the trace's full
  blocks (64 * len(hash_ids) tokens) and is the denominator; no "- 1" cap (the synthesized
  prompt gets one extra marker token, so loomserve's cap lands after the last full block; the
  pool gets one extra block for it); only the last 50% of requests are measured
  (`--warmup-fraction`); `filled_before_window` says whether the cache filled (first eviction)
  before the window: kvcache-simulator omits points where it did not.

Invariants: the same sessions and options give the same requests, tokens and block keys; block
keys (for optimal, infinite and the working set) are loomserve's own chained hashes, so every
policy sees the identical blocks. Working set = unique full blocks of all prompts * B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain, count, repeat

from loomserve.bench.belady import next_uses
from loomserve.bench.trace import Session

__all__ = ["SEMANTICS", "SimRequest", "Workload"]

SEMANTICS = ("loomserve", "kvcache-sim")


@dataclass(frozen=True, slots=True)
class SimRequest:
    index: int              # position in the merged replay order
    trace: str              # session id
    agent: str              # "main" or the subagent's agent_id
    t: float                # replay time: session time + the session's offset
    in_tokens: int
    out_tokens: int
    block_tids: tuple[int, ...]  # interned trace blocks (token id of each trace block)
    trace_block_size: int
    salt: str | None        # cache scope
    num_tokens: int         # length of the synthesized prompt
    counted_tokens: int     # hit-rate denominator
    measured: bool


class _KVReq:
    """Satisfies loomserve.kv.cache_manager.KVRequest."""

    __slots__ = ("request_id", "all_token_ids", "num_prompt_tokens", "num_computed_tokens",
                 "cache_salt", "session_id", "block_hashes")

    def __init__(self, request_id: str, tokens: list[int], salt: str | None,
                 session_id: str | None) -> None:
        self.request_id = request_id
        self.all_token_ids = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.cache_salt = salt
        self.session_id = session_id
        self.block_hashes: list[bytes] = []


class Workload:
    """The merged request stream of a set of sessions, with prompt synthesis and block keys."""

    def __init__(self, sessions: list[Session], *, block_size: int | None = None,
                 semantics: str = "loomserve", stagger_s: float = 0.0,
                 append_outputs: bool = False, warmup_fraction: float | None = None) -> None:
        if semantics not in SEMANTICS:
            raise ValueError(f"unknown semantics {semantics!r}")
        if not sessions:
            raise ValueError("no sessions")
        self.semantics = semantics
        self.kvsim = semantics == "kvcache-sim"
        self.block_size = int(block_size or sessions[0].block_size)
        if self.block_size < 1:
            raise ValueError("block size must be >= 1")
        self.stagger_s = float(stagger_s)
        self.append_outputs = append_outputs
        if warmup_fraction is None:
            warmup_fraction = 0.5 if self.kvsim else 0.0
        if not 0.0 <= warmup_fraction < 1.0:
            raise ValueError("warmup fraction must be in [0, 1)")
        self.warmup_fraction = warmup_fraction
        self.num_traces = len(sessions)
        tids: dict[tuple[str | None, int], int] = {}
        raw = []
        for i, s in enumerate(sessions):
            scope = getattr(s, "hash_id_scope", "local")
            salt = None if scope == "global" else s.id
            offset = i * self.stagger_s
            for k, r in enumerate(s.all_requests()):
                bt = tuple(tids.setdefault((salt, h), len(tids) + 1) for h in r.hash_ids)
                raw.append((r.t + offset, i, k, s, r, bt, salt))
        raw.sort(key=lambda x: (x[0], x[1], x[2]))
        self.num_trace_blocks = len(tids)
        n = len(raw)
        self.warmup_requests = math.floor(n * warmup_fraction)
        reqs = []
        for idx, (t, _i, _k, s, r, bt, salt) in enumerate(raw):
            full = len(bt) * s.block_size
            if self.kvsim:
                num_tokens, counted = full + 1, full
            else:
                num_tokens = counted = r.in_tokens
            reqs.append(SimRequest(idx, s.id, r.agent, t, r.in_tokens, r.out_tokens, bt,
                                   s.block_size, salt, num_tokens, counted,
                                   idx >= self.warmup_requests))
        self.requests: list[SimRequest] = reqs
        self.num_agents = len({(r.trace, r.agent) for r in reqs})
        self._keys: list[list[int]] | None = None
        self._last_tokens: dict[tuple[str, str], tuple[tuple[int, ...], list[int]]] = {}
        self._caps: list[int] | None = None
        self._nus: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.requests)

    def tokens(self, r: SimRequest) -> list[int]:
        """The synthesized prompt of a request (a fresh list). The previous prompt of the same
        agent is reused for the leading trace blocks the two share (a slice copy is cheaper
        than rebuilding)."""
        tb = r.trace_block_size
        bt = r.block_tids
        agent = (r.trace, r.agent)
        prev = self._last_tokens.get(agent)
        toks = None
        if prev is not None:
            pbt, ptoks = prev
            m = len(pbt)
            if m <= len(bt) and bt[:m] == pbt and m * tb <= len(ptoks):
                toks = ptoks[:m * tb]
                toks.extend(chain.from_iterable(map(repeat, bt[m:], repeat(tb, len(bt) - m))))
        if toks is None:
            toks = list(chain.from_iterable(map(repeat, bt, repeat(tb, len(bt)))))
        self._last_tokens[agent] = (bt, toks)
        n = r.num_tokens
        if len(toks) > n:
            del toks[n:]
        elif len(toks) < n:
            toks.extend(repeat(-1 - r.index, n - len(toks)))  # unique to the request
        return toks

    def output_tokens(self, r: SimRequest) -> list[int]:
        return [-1 - len(self.requests) - r.index] * r.out_tokens

    # -- block keys (for optimal / infinite / the working set) ------------------------------
    def _compute_keys(self) -> None:
        from loomserve.kv.hashing import BlockHasher
        bs = self.block_size
        hasher = BlockHasher(bs, max_sessions=max(1024, 2 * self.num_agents),
                             max_memo_tokens=1 << 62)
        intern: dict[bytes, int] = {}
        setdefault = intern.setdefault
        fresh = count()  # a new key's id: unique, not dense (only equality matters)
        keys, caps = [], []
        for r in self.requests:
            req = _KVReq("", self.tokens(r), r.salt, f"{r.trace}\x00{r.agent}")
            hashes = hasher.ensure(req)
            hasher.remember(req)
            keys.append(list(map(setdefault, hashes, fresh)))
            caps.append((r.num_tokens - 1) // bs)
        self._keys, self._caps = keys, caps

    @property
    def keys(self) -> list[list[int]]:
        """Per request, interned keys of its full blocks (loomserve's chained hashes)."""
        if self._keys is None:
            self._compute_keys()
        return self._keys  # type: ignore[return-value]

    @property
    def caps(self) -> list[int]:
        """Per request, the most leading blocks a hit may cover."""
        if self._caps is None:
            self._compute_keys()
        return self._caps  # type: ignore[return-value]

    @property
    def next_uses(self) -> list[list[int]]:
        if self._nus is None:
            self._nus = next_uses(self.keys, self.caps)
        return self._nus

    @property
    def unique_blocks(self) -> int:
        return len({k for ks in self.keys for k in ks})

    @property
    def working_set_tokens(self) -> int:
        return self.unique_blocks * self.block_size
