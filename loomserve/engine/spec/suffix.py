"""The `suffix` drafter: SuffixDecoding (Arctic Inference's scoring) over three token sources.

Sources, each a `SuffixTree` (loomserve.engine.spec.suffix_tree):
- the live request: its prompt and output so far, fed incrementally (only the new tail each
  call, at most `suffix_ingest_tokens_per_step` tokens per call so a 30K-token prompt never
  stalls a step);
- its session (`suffix_session_scope`, on by default): one tree per session id holding every
  earlier request of the session, kept across turns until `drop_session` (the engine drops the
  session's retained KV). A new turn's request joins its session's tree as a new sequence that
  starts where it stops repeating the previous turn (less max_depth - 1 tokens, so suffixes
  crossing that point are complete); the resent prefix is neither ingested nor counted twice.
  The live request is then that sequence: a turn costs its new tokens only;
- a bounded global tree of recent outputs (no prompts) of finished requests, in two
  generations: a new generation starts when the current one holds max_cached_requests / 2
  requests or suffix_global_max_tokens / 2 tokens, and the older one is dropped (LRU by
  request at half-cache granularity; Arctic removes single requests, which costs a Python
  tree walk per token instead).

Draft (Arctic's speculate, path mode): for each length L of the current tokens' suffix that
occurs in a tree, walk the most frequent continuation for at most
min(max_tokens, L * suffix_decoding_max_spec_factor, max_depth - L) tokens, stopping where the
running product of branch frequencies drops below suffix_decoding_min_token_prob; the score is
that product summed over the drafted tokens (the expected accepted length when the frequencies
are the acceptance odds). The best score over L and sources wins if it exceeds
suffix_min_score (0: any draft, as Arctic); lengths whose cap cannot beat the best so far are
not walked.

Memory: trees cost ~340 B per ingested token (measured; see suffix_tree). Bounds:
suffix_session_max_tokens over all session trees (least recently used sessions dropped first),
suffix_global_max_tokens for the global tree, and one tree per live request; a dropped or
finished source is freed whole. Drafts never change outputs (the target verifies them), so a
stale or partial tree only costs acceptance.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

from loomserve.engine.spec.drafter import Drafter, DraftRequest
from loomserve.engine.spec.suffix_tree import SuffixTree

DEFAULTS = {
    # vLLM's SpeculativeConfig / Arctic Inference's names and defaults.
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
    # loomserve's: session scope and the memory bounds a Python tree needs.
    "suffix_session_scope": True,
    "suffix_session_max_tokens": 1 << 20,
    "suffix_global_max_tokens": 1 << 18,
    "suffix_ingest_tokens_per_step": 1024,
    "suffix_min_score": 0.0,
}


def option(config: Any, name: str) -> Any:
    """The option from SpeculativeConfig (an attribute, else its `extra` dict of
    method-specific keys; or a plain dict), else its default."""
    if isinstance(config, dict):
        value = config.get(name)
    else:
        value = getattr(config, name, None)
        if value is None:
            value = (getattr(config, "extra", None) or {}).get(name)
    return DEFAULTS[name] if value is None else value


def check_options(config: Any) -> None:
    """Unknown suffix keys are errors: a typo must not silently change the drafter."""
    if isinstance(config, dict):  # tests' and scripts' form: other keys may be anyone's
        unknown = sorted(k for k in config if k.startswith("suffix_") and k not in DEFAULTS)
    else:  # SpeculativeConfig.extra holds only keys its own fields do not know
        unknown = sorted(k for k in (getattr(config, "extra", None) or {}) if k not in DEFAULTS)
    if unknown:
        raise ValueError(f"--speculative-config: unknown suffix key(s) {unknown} "
                         f"(known: {sorted(DEFAULTS)})")


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of a[:limit] and b, comparing slices (C speed):
    gallop to the first differing chunk, then bisect inside it."""
    n = min(len(a), len(b), len(a) if limit is None else limit)
    lo, step = 0, 256
    while lo < n:
        hi = min(n, lo + step)
        if list(a[lo:hi]) != list(b[lo:hi]):
            break
        lo, step = hi, step * 2
    else:
        return n
    while hi - lo > 1:  # a[:lo] == b[:lo], and a[lo:hi] != b[lo:hi]
        mid = (lo + hi) // 2
        if list(a[lo:mid]) == list(b[lo:mid]):
            lo = mid
        else:
            hi = mid
    return lo


class _Session:
    __slots__ = ("tree", "last", "covered")

    def __init__(self, max_depth: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.last: list[int] = []  # the latest finished request's tokens
        self.covered = 0           # how many of `last` the tree holds


class _Live:
    """A running request: the tree its tokens go into, and how far they went in."""

    __slots__ = ("tree", "session", "ingested")

    def __init__(self, tree: SuffixTree, session: _Session | None, ingested: int) -> None:
        self.tree = tree
        self.session = session
        self.ingested = ingested


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, config: Any = None) -> None:
        check_options(config or {})
        self.max_depth = int(option(config, "suffix_decoding_max_tree_depth"))
        self.max_cached_requests = int(option(config, "suffix_decoding_max_cached_requests"))
        self.spec_factor = float(option(config, "suffix_decoding_max_spec_factor"))
        self.min_prob = float(option(config, "suffix_decoding_min_token_prob"))
        self.session_scope = bool(option(config, "suffix_session_scope"))
        self.session_max_tokens = int(option(config, "suffix_session_max_tokens"))
        self.global_max_tokens = int(option(config, "suffix_global_max_tokens"))
        self.ingest_per_step = max(1, int(option(config, "suffix_ingest_tokens_per_step")))
        self.min_score = float(option(config, "suffix_min_score"))
        self._live: dict[str, _Live] = {}
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._global = SuffixTree(self.max_depth)
        self._global_old: SuffixTree | None = None
        self._global_requests = 0

    # -- the contract -------------------------------------------------------------------

    def propose(self, req: DraftRequest, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        live = self._live.get(req.request_id)
        if live is None:
            live = self._live[req.request_id] = self._start(req)
        tokens = req.tokens
        self._ingest(live, tokens)
        pattern = list(tokens[-self.max_depth:])
        # A draft expected to yield little costs a verified row for less than it returns and
        # drags down the acceptance the engine's draft budget measures; 0 (Arctic): any draft.
        best, best_score = self.speculate(live.tree, pattern, max_tokens, self.min_score)
        for tree in (self._global, self._global_old):
            if tree is not None and tree.num_tokens:
                draft, score = self.speculate(tree, pattern, max_tokens,
                                              max(best_score, self.min_score))
                if score > best_score:
                    best, best_score = draft, score
        return best

    def _ingest(self, live: _Live, tokens: Sequence[int]) -> None:
        """Feed the tokens the tree lacks, at most ingest_per_step of them."""
        if live.ingested < len(tokens):
            end = min(len(tokens), live.ingested + self.ingest_per_step)
            live.tree.extend(live, tokens[live.ingested:end])
            live.ingested = end

    def on_finished(self, req: DraftRequest) -> None:
        live = self._live.pop(req.request_id, None)
        if live is None and self.session_scope and req.session_id:
            live = self._start(req)  # never drafted for (budget, batch size): learn it anyway
        if live is not None and live.session is not None:
            self._ingest(live, req.tokens)  # the last tokens, for the session's next turn
            live.session.last = list(req.tokens)
            live.session.covered = live.ingested
            self._bound_sessions()
        output = req.tokens[req.num_prompt_tokens:]
        if self.max_cached_requests > 0 and len(output):
            self._remember_output(req.request_id, output)

    def drop_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    # -- drafting -----------------------------------------------------------------------

    def speculate(self, tree: SuffixTree, pattern: list[int], max_tokens: int,
                  beat: float) -> tuple[list[int], float]:
        """Best (draft, score) from tree for the tokens ending in pattern; ([], 0.0) if no
        draft scores above `beat`."""
        longest = self._longest_match(tree, pattern)
        if longest == 0:
            return [], 0.0
        depth, factor, p = tree.max_depth, self.spec_factor, len(pattern)
        caps = sorted(((min(max_tokens, int(n * factor + 1e-6), depth - n), n)
                       for n in range(1, longest + 1)), reverse=True)
        best: list[int] = []
        best_score = beat
        drafted: set[int] = set()
        for cap, n in caps:
            if cap <= best_score:
                break  # a score never exceeds the number of drafted tokens
            node, idx = tree.match(pattern, p - n)
            # Equal counts for two suffix lengths mean the same occurrences (the shorter one
            # is always preceded by the longer one's extra tokens), hence the same
            # continuation; it was drafted already with a cap at least this one.
            if node.count in drafted:
                continue
            drafted.add(node.count)
            draft, score = tree.draft(node, idx, cap, self.min_prob)
            if score > best_score:
                best, best_score = draft, score
        return (best, best_score) if best else ([], 0.0)

    @staticmethod
    def _longest_match(tree: SuffixTree, pattern: list[int]) -> int:
        """Longest suffix of pattern present in tree. If pattern[s:] occurs, so does every
        shorter suffix, so binary search over the start s."""
        lo, hi = 0, len(pattern)  # pattern[hi:] (empty) occurs
        if tree.match(pattern, 0) is not None:
            return hi
        while hi - lo > 1:  # invariant: pattern[lo:] absent, pattern[hi:] present
            mid = (lo + hi) // 2
            if tree.match(pattern, mid) is None:
                lo = mid
            else:
                hi = mid
        return len(pattern) - hi

    # -- sources ------------------------------------------------------------------------

    def _start(self, req: DraftRequest) -> _Live:
        if not (self.session_scope and req.session_id):
            return _Live(SuffixTree(self.max_depth), None, 0)
        session = self._sessions.get(req.session_id)
        if session is None:
            session = self._sessions[req.session_id] = _Session(self.max_depth)
        self._sessions.move_to_end(req.session_id)
        shared = common_prefix(session.last, req.tokens, session.covered)
        # Suffixes starting before shared - max_depth + 1 lie wholly in the resent prefix,
        # which the tree holds already; later ones cross into the new tokens.
        return _Live(session.tree, session, max(0, shared - self.max_depth + 1))

    def _bound_sessions(self) -> None:
        total = sum(s.tree.num_tokens for s in self._sessions.values())
        while total > self.session_max_tokens and self._sessions:  # the oldest first
            _, dropped = self._sessions.popitem(last=False)
            total -= dropped.tree.num_tokens

    def _remember_output(self, request_id: str, output: Sequence[int]) -> None:
        tree = self._global
        if (self._global_requests >= max(1, self.max_cached_requests // 2)
                or tree.num_tokens >= self.global_max_tokens // 2):
            self._global_old, tree = tree, SuffixTree(self.max_depth)
            self._global, self._global_requests = tree, 0
        self._global_requests += 1
        tree.extend((request_id, self._global_requests), output[:self.global_max_tokens // 2])
