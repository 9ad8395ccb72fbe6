"""OpenAI's output shapes built from engine outputs and chat events: chat messages and stream
deltas, chat and completions logprobs."""

from __future__ import annotations

from functools import lru_cache

from loomserve.api.chat.events import (
    ChatResult,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
)
from loomserve.api.openai_protocol import (
    AssistantMessage,
    FunctionCall,
    ToolCallOut,
)

LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def finish_reason(reason: str | None, result: ChatResult | None) -> str | None:
    """The engine's reason, "tool_calls" when a turn that stopped made calls."""
    if result is not None and result.tool_calls and reason == "stop":
        return "tool_calls"
    return reason


def assistant_message(result: ChatResult, parallel: bool = True) -> AssistantMessage:
    calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in (result.tool_calls or [])[:None if parallel else 1]]
    reasoning = result.reasoning or None
    return AssistantMessage(content=result.content or (None if calls else ""),
                            reasoning_content=reasoning, reasoning=reasoning,
                            tool_calls=calls or None)


def first_call_only(events) -> list:
    """parallel_tool_calls false: the events of calls after the first are dropped."""
    return [ev for ev in events
            if not isinstance(ev, (ToolCallStart, ToolCallArgs)) or ev.index == 0]


def deltas(events) -> list[dict]:
    """Chat events -> stream deltas: runs of text / reasoning / one call's arguments merge;
    a call's first delta carries its index, id, type and whole name, with arguments ""."""
    out: list[dict] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, TextDelta):
            if last is not None and set(last) == {"content"}:
                last["content"] += ev.text
            else:
                out.append({"content": ev.text})
        elif isinstance(ev, ReasoningDelta):
            if last is not None and set(last) == {"reasoning_content", "reasoning"}:
                last["reasoning_content"] += ev.text
                last["reasoning"] += ev.text
            else:
                out.append({"reasoning_content": ev.text, "reasoning": ev.text})
        elif isinstance(ev, ToolCallStart):
            out.append({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                        "function": {"name": ev.name, "arguments": ""}}]})
        elif isinstance(ev, ToolCallArgs):
            call = (last or {}).get("tool_calls", [{}])[0]
            if "id" not in call and call.get("index") == ev.index:
                call["function"]["arguments"] += ev.text
            else:
                out.append({"tool_calls": [{"index": ev.index,
                                            "function": {"arguments": ev.text}}]})
    return out


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable stand-ins for the 256 bytes) -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenTexts:
    """Token id -> its text and its UTF-8 bytes, as logprobs report them (cached per id). A
    token that is part of a character decodes to U+FFFD alone; its bytes are still exact for
    byte-level BPE vocabularies (read from the token's byte-level spelling)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)
        self._decoder = _byte_decoder()

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        text = self.text(token_id)
        if "\ufffd" in text:
            piece = self.tokenizer.hf.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(ch in self._decoder for ch in piece):
                return [self._decoder[ch] for ch in piece]
        return list(text.encode("utf-8"))


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


def chat_logprobs(texts: TokenTexts, entries) -> dict:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}, one per
    generated token (entries: (token_id, (logprob, [(top_id, top_logprob), ...])))."""
    def item(tid: int, lp: float) -> dict:
        return {"token": texts.text(tid), "logprob": _lp(lp), "bytes": texts.bytes(tid)}

    return {"content": [{**item(tid, lp), "top_logprobs": [item(t, v) for t, v in top]}
                        for tid, (lp, top) in entries]}


def completion_logprobs(texts: TokenTexts, entries, offset: int) -> tuple[dict, int]:
    """OpenAI completions shape: tokens, token_logprobs, top_logprobs (token -> logprob),
    text_offset (from `offset`, the characters already reported); and the next offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, (lp, top) in entries:
        t = texts.text(tid)
        tokens.append(t)
        lps.append(_lp(lp))
        tops.append({texts.text(k): _lp(v) for k, v in top})
        offsets.append(offset)
        offset += len(t)
    return ({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
             "text_offset": offsets}, offset)


def new_entries(out) -> list:
    """(token_id, logprob entry) for the tokens new in this output."""
    return list(zip(out.new_token_ids, out.new_logprobs or []))


def all_entries(out) -> list:
    return list(zip(out.token_ids, out.logprobs or []))
