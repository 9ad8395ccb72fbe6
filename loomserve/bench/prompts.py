"""Prompt synthesis for trace replay: hash ids -> token ids (or stable text).

Each trace block id maps to a fixed block of token ids, a seeded function of the id and the
trace's id scope (the same id always gives the same tokens), so a server's prefix cache sees
exactly the sharing the trace recorded. A prompt is

    marker (per session replay) + block(h_0) + block(h_1) + ...   cut to the request's length

where each block is `block_tokens` (the scale K) tokens long and the request's length is its
recorded `in` tokens scaled by K / block_size. The marker makes two replays of the same trace
(and two runs against the same server) share nothing.

Context cap. When a scaled prompt does not fit `max_prompt_tokens` (the model's context minus
room for max_tokens), it is truncated to its LEADING tokens. Leading blocks carry the prefix-
sharing structure (two prompts that shared their first j blocks still do), so the rule never
invents or breaks sharing; its cost is that turns past the cap stop adding new prefill. The
theoretical hit rate is computed from what was actually sent, so it reflects the cap too.

Text mode (servers that do not take token-id prompts): each id becomes a word from a fixed
vocabulary, words joined by single spaces; common English words are single tokens in the usual
BPE / SentencePiece vocabularies, so the text tokenizes to (about) one token per id. The replay
checks that once against the server's usage.prompt_tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PromptBuilder", "Prompt", "PrefixTracker", "ids_to_text", "token_id_range", "WORDS"]


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """Ids to draw from: [lo, vocab_size), skipping the low ids where special tokens live."""
    if vocab_size < 16:
        raise ValueError(f"vocab size {vocab_size} is too small to synthesize prompts")
    lo = 1000 if vocab_size >= 4000 else max(8, vocab_size // 8)
    return lo, vocab_size


def _seed(*parts) -> int:
    h = hashlib.blake2b("\x00".join(str(p) for p in parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


@dataclass
class Prompt:
    tokens: list[int]
    # (prefix key, tokens of that segment actually sent), marker first; keys are chained, so a
    # key stands for the whole prefix up to and including its segment.
    segments: list[tuple[int, int]]
    scaled_tokens: int        # the request's `in` scaled (before the context cap)
    truncated: bool

    def __len__(self) -> int:
        return len(self.tokens)


class PromptBuilder:
    """Build prompts for trace requests. `block_tokens` is the scale K (tokens per trace block)."""

    def __init__(self, vocab_size: int, block_tokens: int, marker_tokens: int | None = None,
                 cache_limit: int = 500_000) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.vocab_size = vocab_size
        self.lo, self.hi = token_id_range(vocab_size)
        self.block_tokens = block_tokens
        self.marker_tokens = marker_tokens if marker_tokens is not None else max(4, min(16, block_tokens))
        self._cache: dict[tuple, np.ndarray] = {}
        self._cache_limit = cache_limit

    def _draw(self, key: tuple, n: int) -> np.ndarray:
        arr = self._cache.get(key)
        if arr is None:
            if len(self._cache) >= self._cache_limit:
                self._cache.clear()
            rng = np.random.Generator(np.random.PCG64(_seed(*key)))
            arr = rng.integers(self.lo, self.hi, size=n, dtype=np.int64)
            self._cache[key] = arr
        return arr

    def block(self, scope: str, hash_id: int) -> np.ndarray:
        """The fixed token block of one trace block id (same scope and id -> same tokens)."""
        return self._draw(("b", scope, int(hash_id), self.block_tokens), self.block_tokens)

    def marker(self, marker_key: str) -> np.ndarray:
        return self._draw(("m", marker_key, self.marker_tokens), self.marker_tokens)

    def scaled_length(self, in_tokens: int, block_size: int) -> int:
        return max(1, round(in_tokens * self.block_tokens / block_size))

    def build(self, scope: str, marker_key: str, hash_ids, in_tokens: int, block_size: int,
              max_prompt_tokens: int | None = None, pad_key: str = "") -> Prompt:
        """The prompt of one request: marker + blocks, cut to the scaled length (>= marker + 1),
        then to `max_prompt_tokens` keeping the leading tokens. Blocks missing from a short
        hash-id list are padded with tokens unique to `pad_key` (never shared)."""
        scaled = max(self.scaled_length(in_tokens, block_size), self.marker_tokens + 1)
        n = scaled
        truncated = False
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            n, truncated = max(1, max_prompt_tokens), True
        parts: list[np.ndarray] = []
        segments: list[tuple[int, int]] = []
        key = hash(("m", marker_key))
        m = self.marker(marker_key)[:n]
        parts.append(m)
        segments.append((key, len(m)))
        left = n - len(m)
        for hid in hash_ids:
            if left <= 0:
                break
            b = self.block(scope, hid)[:left]
            key = hash((key, int(hid)))
            parts.append(b)
            segments.append((key, len(b)))
            left -= len(b)
        if left > 0:  # the trace's ids cover less than `in`: pad with unshared tokens
            pad = self._draw(("p", marker_key, pad_key, left), left)
            parts.append(pad)
            segments.append((hash(("p", marker_key, pad_key)), left))
            self._cache.pop(("p", marker_key, pad_key, left), None)
        tokens = np.concatenate(parts).tolist()
        return Prompt(tokens=tokens, segments=segments, scaled_tokens=scaled, truncated=truncated)


@dataclass
class PrefixTracker:
    """An infinite prefix cache over one session replay's sent prompts, in send order.

    observe() returns how many leading tokens of the prompt were already sent before (its
    theoretical cached tokens) and then records the prompt."""

    seen: dict[int, int] = field(default_factory=dict)

    def observe(self, segments: list[tuple[int, int]]) -> int:
        hit = 0
        for key, length in segments:
            s = self.seen.get(key, 0)
            if s >= length:
                hit += length
                continue
            hit += s
            break
        for key, length in segments:
            if self.seen.get(key, 0) < length:
                self.seen[key] = length
        return hit


# A fixed vocabulary of common lowercase English words, each a single token (with its leading
# space) in common BPE and SentencePiece vocabularies.
WORDS = tuple("""
the of and to in is was for on are as with his they at be this from have or by one had not but
what all were when we there can an your which their said if do will each about how up out them
then she many some so these would other into has more her two like him see time could no make
than first been its who now people my made over did down only way find use may water long little
very after words called just where most know get through back much go good new write our me man
too any day same right look think also around another came come work three must because does part
even place well such here take why help put different away again off went old number great tell
men say small every found still between name should home big give air line set own under read
last never us left end along while might next sound below saw something thought both few those
always show large often together asked house world going want school important until form food
keep children feet land side without boy once animal life enough took four head above kind began
almost live page got earth need far hand high year mother light country father let night picture
being study second soon story since white ever paper hard near sentence better best across during
today however sure knew try told young sun thing whole hear example heard several change answer
room sea against top turned learn point city play toward five himself usually money seen car
morning body upon family later turn move face door cut done group true leave color red friend
""".split())


def ids_to_text(ids) -> str:
    """Token ids -> words joined by single spaces (one word per id)."""
    w = WORDS
    n = len(w)
    return " ".join(w[i % n] for i in ids)
