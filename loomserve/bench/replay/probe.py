"""Probing the endpoint before a replay: model, context length, vocabulary, prompt mode.

`probe_server` reads /v1/models, then tries a three-token token-id prompt; when the server
rejects ids it tries to learn the vocabulary size (from its error message, else by bisection)
and falls back to text prompts, measuring how many tokens a word of filler text becomes.

Invariants:
- an explicit `vocab_size` is never overridden; ids sent stay below the vocabulary size;
- mode "ids" either succeeds with ids or raises; mode "auto" ends in "ids" or "text" with a
  note saying why; `ServerInfo.vocab_source` says where the vocabulary size came from.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from loomserve.bench.prompts import ids_to_text, token_id_range
from loomserve.bench.replay.transport import Transport, TransportError

__all__ = ["ServerInfo", "probe_server"]


@dataclass
class ServerInfo:
    model: str | None = None
    max_model_len: int | None = None
    vocab_size: int = 32000
    vocab_source: str = "default"
    mode: str = "ids"
    ids_prompt_tokens_delta: int | None = None   # usage.prompt_tokens - ids sent (ids mode)
    text_token_ratio: float | None = None        # usage.prompt_tokens / words (text mode)
    text_stable: bool | None = None
    notes: list[str] = field(default_factory=list)


_VOCAB_HINT = re.compile(r"\[0,\s*(\d+)\)")


async def probe_server(transport: Transport, model: str | None, vocab_size: int | None = None,
                       mode: str = "auto") -> ServerInfo:
    info = ServerInfo(model=model)
    try:
        status, models = await transport.request_json("GET", "/v1/models")
    except TransportError as e:
        raise RuntimeError(f"cannot reach the endpoint: {e}") from e
    card = None
    if status == 200 and isinstance(models, dict) and models.get("data"):
        data = models["data"]
        card = next((c for c in data if c.get("id") == model), data[0])
        if info.model is None:
            info.model = card.get("id")
        info.max_model_len = card.get("max_model_len") or card.get("context_length")
    if vocab_size:
        info.vocab_size, info.vocab_source = vocab_size, "option"
    elif card and card.get("vocab_size"):
        info.vocab_size, info.vocab_source = int(card["vocab_size"]), "models"

    async def try_ids(ids) -> tuple[bool, str, dict | None]:
        body = {"prompt": list(ids), "max_tokens": 1, "stream": False, "ignore_eos": True}
        if info.model:
            body["model"] = info.model
        st, resp = await transport.request_json("POST", "/v1/completions", body)
        return st == 200, (json.dumps(resp) if isinstance(resp, dict) else str(resp)), \
            (resp if isinstance(resp, dict) else None)

    if mode in ("auto", "ids"):
        lo, hi = token_id_range(info.vocab_size)
        ok, msg, resp = await try_ids([lo, lo + 1, hi - 1])
        if not ok and not vocab_size:
            m = _VOCAB_HINT.search(msg)
            if m and int(m.group(1)) >= 16:
                info.vocab_size, info.vocab_source = int(m.group(1)), "server error message"
                lo, hi = token_id_range(info.vocab_size)
                ok, msg, resp = await try_ids([lo, lo + 1, hi - 1])
            elif (await try_ids([10, 11, 12]))[0]:
                good, bad = 12, hi - 1  # largest accepted id by bisection
                while bad - good > 1:
                    mid = (good + bad) // 2
                    if (await try_ids([mid]))[0]:
                        good = mid
                    else:
                        bad = mid
                info.vocab_size, info.vocab_source = good + 1, "probed"
                lo, hi = token_id_range(info.vocab_size)
                ok, msg, resp = await try_ids([lo, lo + 1, hi - 1])
        if ok:
            info.mode = "ids"
            usage = (resp or {}).get("usage") or {}
            if usage.get("prompt_tokens") is not None:
                info.ids_prompt_tokens_delta = usage["prompt_tokens"] - 3
            return info
        if mode == "ids":
            raise RuntimeError(f"the server does not accept token-id prompts: {msg[:300]}")
        info.notes.append(f"token-id prompts rejected ({msg[:120]}); using text")
    info.mode = "text"
    n = 16
    lo, hi = token_id_range(info.vocab_size)
    ids = list(range(lo, lo + n))
    body = {"prompt": ids_to_text(ids), "max_tokens": 1, "stream": False}
    if info.model:
        body["model"] = info.model
    st, resp = await transport.request_json("POST", "/v1/completions", body)
    if st != 200 or not isinstance(resp, dict):
        raise RuntimeError(f"text probe failed: HTTP {st}: {str(resp)[:300]}")
    pt = ((resp.get("usage") or {}).get("prompt_tokens"))
    if pt is not None:
        info.text_token_ratio = pt / n
        info.text_stable = abs(pt - n) <= 2
        if not info.text_stable:
            info.notes.append(f"text prompts tokenize to {pt} tokens per {n} words: token "
                              "counts are approximate (the context cap is divided by the ratio)")
    return info
