"""One long-context request against a running server, timed from its stream.

`timed_request` posts a streaming /v1/completions request with a token-id prompt (greedy,
`ignore_eos`, `cache_prompt` for llama-server) and stamps every chunk that carries a choice
(the client is http_stream.py's: little CPU per token beside the server's on the same cores):

    ttft        = first choice chunk - request sent      (the prefill, plus one token)
    decode ms/t = (last choice chunk - first) / (completion tokens - 1)

Completion tokens come from the usage chunk (a token whose bytes are held back as partial UTF-8
still counts there). llama-server's own `timings` (prompt_ms, predicted_per_token_ms) are kept
when it sends them, as a cross-check of the client-side figures.

Invariant: a request that errs, or stops short of max_tokens, is returned with `error` set and
is never turned into a figure.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from loomserve.bench.replay.transport import sse_lines

from .http_stream import post_stream

__all__ = ["Timed", "timed_request", "concurrent_decode", "random_prompt"]


@dataclass
class Timed:
    prompt_tokens: int
    max_tokens: int
    ttft_s: float | None = None
    decode_ms_per_token: float | None = None
    completion_tokens: int | None = None
    wall_s: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    server_timings: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def random_prompt(n: int, seed: int, vocab: int, low: int = 1000) -> list[int]:
    """``n`` random token ids in [low, vocab): ordinary BPE pieces, no special tokens."""
    import numpy as np

    return np.random.default_rng(seed).integers(low, vocab, size=n).tolist()


def _body(prompt: Sequence[int], max_tokens: int, model: str | None) -> dict[str, Any]:
    body = {"prompt": list(prompt), "max_tokens": max_tokens, "n_predict": max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True, "cache_prompt": True,
            "stream_options": {"include_usage": True}, "timings_per_token": False}
    if model:
        body["model"] = model
    return body


async def _stream(base_url: str, prompt: Sequence[int], max_tokens: int,
                  model: str | None, timeout: float) -> Timed:
    res = Timed(len(prompt), max_tokens)
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            text = post_stream(base_url.rstrip("/") + "/v1/completions",
                               _body(prompt, max_tokens, model))
            async for line in sse_lines(text):  # CR/LF only, as SSE
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[5:])
                if chunk.get("timings"):
                    res.server_timings = chunk["timings"]
                usage = chunk.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    res.completion_tokens = int(usage["completion_tokens"])
                if chunk.get("choices"):
                    res.t_first = res.t_first or now
                    res.t_last = now
    except Exception as e:  # noqa: BLE001 - reported, never a figure
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.wall_s = time.perf_counter() - t0
    _finish(res, t0)
    return res


def _finish(res: Timed, t0: float) -> None:
    n = res.completion_tokens
    if res.t_first is None or n is None:
        res.error = res.error or f"no tokens / no usage (completion_tokens={n})"
        return
    res.ttft_s = res.t_first - t0
    if n != res.max_tokens:
        res.error = f"{n} completion tokens, asked {res.max_tokens}"
    elif n > 1:
        res.decode_ms_per_token = 1000 * (res.t_last - res.t_first) / (n - 1)


def timed_request(base_url: str, prompt: Sequence[int], max_tokens: int,
                  model: str | None = None, timeout: float = 3600.0) -> Timed:
    return asyncio.run(concurrent_decode(base_url, [prompt], max_tokens, model, timeout))[0]


async def _gather(base_url: str, prompts: Sequence[Sequence[int]], max_tokens: int,
                  model: str | None, timeout: float) -> list[Timed]:
    return list(await asyncio.gather(*(_stream(base_url, p, max_tokens, model, timeout)
                                       for p in prompts)))


def concurrent_decode(base_url: str, prompts: Sequence[Sequence[int]], max_tokens: int,
                      model: str | None = None, timeout: float = 3600.0):
    """A coroutine timing every prompt at once (one connection each)."""
    return _gather(base_url, prompts, max_tokens, model, timeout)
