"""A request's prompt as the instance will see it: token ids and their block-hash chain.

The router renders and tokenizes with the same chat layer the instances use
(loomserve.api.chat: the model's template, the Hermes fallback for tools) and hashes
with the same function (loomserve.kv.hashing.hash_chain, the request's cache_salt mixed into
block 0), so the keys it looks up are the keys the instances publish in their KV events.

Agent traffic resends a growing conversation, so per memo key (the session) the work is kept:
- tokenization restarts at the last special token (e.g. <|im_start|>) inside the part of the
  text that did not change. HF tokenizers split on added tokens before anything else, so the
  ids before it are exactly what a full encode would give, and only the new turn is encoded;
- hashing restarts at the first block whose tokens changed.
What it cannot reproduce (a Responses turn continuing a stored previous_response_id, whose
history lives on the instance; a body the instance will reject) yields None: the policy then
routes without prefix knowledge.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from pydantic import ValidationError

from loomserve.api.chat.render import ChatRenderer
from loomserve.api.chat.validate import ChatInputError, check_messages, check_tools
from loomserve.api.errors import APIError
from loomserve.kv.hashing import hash_chain

API_CHAT, API_COMPLETIONS, API_MESSAGES, API_RESPONSES = (
    "chat", "completions", "messages", "responses")


@dataclass
class _Text:
    """One session's last rendered prompt: text, ids, the indices of the ids that are safe
    restart points (added tokens without lstrip), and where each of those tokens starts and
    ends in the text (all ascending)."""

    text: str
    ids: list[int]
    cuts: list[int]
    cut_starts: list[int]
    cut_ends: list[int]


def _last_kept_cut(prev: _Text, text: str) -> int:
    """The last restart point k of prev whose token lies wholly in the part of `text` equal
    to prev.text (-1: none). Checked last first (a new turn appends), then by bisection: if
    the text up to cut k is unchanged, so is the text up to every earlier cut."""
    ends = prev.cut_ends
    old = prev.text

    def same(k: int) -> bool:
        return text.startswith(old[:ends[k]])
    if not ends:
        return -1
    if same(len(ends) - 1):
        return len(ends) - 1
    lo, hi = -1, len(ends) - 1  # same(lo) (or lo == -1), not same(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if same(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class _Chain:
    salt: str | None
    ids: list[int]
    hashes: list[bytes]


def common_prefix_len(a, b, lo: int = 0) -> int:
    """Length of the common prefix of two sequences (str or list), by bisection on slice
    equality: O(n log n) element compares done in C instead of a Python loop. `lo`: a length
    the caller believes common (checked with one compare; only what follows is bisected)."""
    n = min(len(a), len(b))
    lo = min(lo, n)
    if lo and a[:lo] != b[:lo]:
        lo = 0
    if a[lo:n] == b[lo:n]:
        return n
    hi = n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PromptKeys:
    """Prompt ids and block hashes of requests, memoized per session (LRU, max_sessions)."""

    def __init__(self, tokenizer, block_size: int, max_sessions: int = 10_000,
                 chat_template: str | None = None) -> None:
        """chat_template: the text of the template the instances were started with
        (their --chat-template), else the model's."""
        self.tok = tokenizer
        self.block_size = block_size
        self.max_sessions = max_sessions
        template = chat_template or tokenizer.chat_template
        hf = tokenizer.hf
        self.renderer = (ChatRenderer(template, hf.bos_token or "", hf.eos_token or "")
                         if template else None)
        self._backend = hf.backend_tokenizer
        self._cut_ids = frozenset(i for i, t in hf.added_tokens_decoder.items()
                                  if not getattr(t, "lstrip", False))
        self._lock = threading.Lock()  # keys() runs in worker threads: one at a time
        self._reused = 0  # leading ids the last encode took from its memo
        self._texts: OrderedDict[str, _Text] = OrderedDict()
        self._chains: OrderedDict[str, _Chain] = OrderedDict()

    @classmethod
    def from_folder(cls, folder: str, block_size: int,
                    chat_template: str | None = None) -> "PromptKeys":
        from loomserve.engine.tokenizer import Tokenizer
        return cls(Tokenizer.from_folder(folder), block_size, chat_template=chat_template)

    def forget(self, session: str) -> None:
        with self._lock:
            self._texts.pop(session, None)
            self._chains.pop(session, None)

    def keys(self, api: str, body: dict, session: str | None,
             parent: str | None = None) -> tuple[list[int], list] | None:
        """(prompt ids, block hashes) of the request, or None when the router cannot know
        them (see the module doc). A session seen for the first time starts from its parent's
        memo (a subagent usually repeats its parent's leading context)."""
        with self._lock:
            seed = parent if session is None or session not in self._texts else None
            self._reused = 0
            ids = self.prompt_ids(api, body, session, seed)
            if ids is None:
                return None
            salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
            return ids, self.hashes(ids, salt, session, seed, self._reused)

    def prompt_ids(self, api: str, body: dict, session: str | None,
                   seed: str | None = None) -> list[int] | None:
        try:
            if api == API_COMPLETIONS:
                return self._completion_ids(body)
            messages, tools, kwargs = _chat_parts(api, body)
            if messages is None or self.renderer is None:
                return None
            text = self.renderer.render(check_messages(messages), check_tools(tools), True,
                                        kwargs)
        except (ValidationError, ChatInputError, APIError, ValueError, TypeError, KeyError):
            return None  # the instance answers with the precise 400
        except Exception:  # a template error: the instance reports it the same way
            return None
        return self._encode(text, session, seed)

    def hashes(self, ids: list[int], salt: str | None, session: str | None,
               seed: str | None = None, same_hint: int = 0) -> list:
        """hash_chain(ids, block_size, salt), reusing the session's (else the seed session's)
        previous chain for the leading blocks whose tokens did not change."""
        bs = self.block_size
        prev = self._chains.get(session) if session is not None else None
        if prev is None and seed is not None:
            prev = self._chains.get(seed)
        keep = 0
        if prev is not None and prev.salt == salt:
            keep = min(common_prefix_len(ids, prev.ids, same_hint) // bs, len(prev.hashes))
        out = prev.hashes[:keep] if keep else []
        hash_chain(ids, bs, salt, out[-1] if keep else None, keep, out=out)
        if session is not None:
            self._remember(self._chains, session, _Chain(salt, ids, out))
        return out

    def _completion_ids(self, body: dict) -> list[int] | None:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return self.tok.encode(p, add_special_tokens=True)
        if isinstance(p, list) and p and all(type(x) is int for x in p):
            return list(p)
        return None

    def _encode(self, text: str, session: str | None, seed: str | None = None) -> list[int]:
        prev = self._texts.get(session) if session is not None else None
        if prev is None and seed is not None:
            prev = self._texts.get(seed)
        k = _last_kept_cut(prev, text) if prev is not None else -1
        n = prev.cuts[k] if k >= 0 else 0  # reuse prev.ids[:n]; encode text from char `start`
        start = prev.cut_starts[k] if k >= 0 else 0
        enc = self._backend.encode(text[start:] if start else text, add_special_tokens=False)
        new_ids = enc.ids
        ids = prev.ids[:n] + new_ids if n else list(new_ids)
        self._reused = n  # ids[:n] are prev's: the hash memo's compare can start there
        if session is not None:
            offsets = enc.offsets
            cut_ids = self._cut_ids
            fresh = [j for j, t in enumerate(new_ids) if t in cut_ids]
            kept = k if n else 0  # prev's cuts before the restart point (the restart is redone)
            self._remember(self._texts, session, _Text(
                text, ids, (prev.cuts[:kept] if kept else []) + [n + j for j in fresh],
                (prev.cut_starts[:kept] if kept else []) + [offsets[j][0] + start for j in fresh],
                (prev.cut_ends[:kept] if kept else []) + [offsets[j][1] + start for j in fresh]))
        return ids

    def _remember(self, memo: OrderedDict, session: str, value) -> None:
        memo[session] = value
        memo.move_to_end(session)
        while len(memo) > self.max_sessions:
            memo.popitem(last=False)


def _chat_parts(api: str, body: dict) -> tuple[list | None, list | None, dict]:
    """(neutral messages, neutral tools, template kwargs) of a chat-style body, converted by
    the instances' own protocol classes; messages None when the history is not in the body."""
    if api == API_CHAT:
        from loomserve.api.openai_protocol import ChatCompletionRequest
        req = ChatCompletionRequest.model_validate(body).to_chat_request()
        return req.messages, req.tools, dict(req.template_kwargs)
    if api == API_MESSAGES:
        from loomserve.api.anthropic_protocol import MessagesRequest
        req, _ = MessagesRequest.model_validate(body).to_chat_request()
        return req.messages, req.tools, dict(req.template_kwargs)
    if api == API_RESPONSES:
        from loomserve.api.responses_protocol import (
            ResponsesRequest,
            convert_tools,
            to_messages,
        )
        r = ResponsesRequest.model_validate(body)
        if r.previous_response_id:
            return None, None, {}
        return (to_messages(r.input_items(), r.instructions), convert_tools(r.tools).tools,
                r.template_kwargs())
    raise ValueError(f"unknown API {api!r}")
